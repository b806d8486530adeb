"""`swinbench train`: the parity rule on made-up curves, the shipped digits and their fixed split and order,
the command end to end on a few CPU steps (records, curves, report, parity verdicts), and its refusals."""
import json
import math
import random
import statistics
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli import app
from workbench.datasets import DIGITS_TRAIN, DigitsData, load_digits
from workbench.results.parity import ACCURACY_POINTS, baseline_spread, parity, smooth, smoothing_window
from workbench.results.train_runs import RunRecords, read_runs

runner = CliRunner()


# ---------------------------------------------------------------- the parity rule


def noisy_curve(seed: int, steps: int = 200, offset: float = 0.0) -> list[float]:
    """A falling loss with step-to-step noise of its own seed (sd 0.05)."""
    rng = random.Random(seed)
    return [2.3 * math.exp(-t / 60) + 0.2 + offset + rng.gauss(0, 0.05) for t in range(steps)]


def test_smooth_is_a_trailing_mean():
    assert smooth([1, 2, 3, 4, 5], 2) == [1, 1.5, 2.5, 3.5, 4.5]
    assert smooth([1.0, math.nan, 3.0], 2)[1:] != smooth([1.0, 2.0, 3.0], 2)[1:]
    assert all(math.isnan(v) for v in smooth([1.0, math.nan, 3.0], 2)[1:])
    assert smoothing_window(300) == 15 and smoothing_window(20) == 5


def test_a_run_of_the_same_process_passes_and_an_offset_one_fails():
    base = baseline_spread([noisy_curve(1), noisy_curve(2)], [97.0, 97.4])
    assert base.window == 10 and base.first == 9 and 0 < base.spread_mean < base.spread_max
    same = parity(noisy_curve(3), 97.3, base, [noisy_curve(1), noisy_curve(2)])
    assert same.loss_ok and same.accuracy_ok and same.verdict == "converges like the baseline"
    assert 0 < same.inside_share < 1
    off = parity(noisy_curve(3, offset=0.1), 97.2, base)
    assert not off.loss_ok and off.verdict.startswith("differs: loss")


def test_accuracy_must_be_within_half_a_point_of_the_baseline_mean():
    base = baseline_spread([noisy_curve(1), noisy_curve(2)], [97.1, 97.3])
    assert parity(noisy_curve(3), 97.2 + ACCURACY_POINTS - 1e-9, base).accuracy_ok
    late = parity(noisy_curve(3), 97.2 - ACCURACY_POINTS - 0.01, base)
    assert not late.accuracy_ok and late.decided and not late.passed
    assert late.verdict.startswith("differs: accuracy -0.51 points")


def test_an_accuracy_miss_inside_the_seeds_noise_is_not_decided():
    """Seeds 1.3 points apart: a miss of 0.67 points is within 2 standard deviations of the difference of
    the means, so the rule says it cannot tell; three seeds of the recipe narrow the noise; a miss past the
    noise, or a loss off the spread, fails."""
    accuracies = [97.82, 98.49, 97.65]
    base = baseline_spread([noisy_curve(1), noisy_curve(2), noisy_curve(4)], accuracies)
    s = statistics.stdev(accuracies)
    assert base.accuracy_noise(1) == pytest.approx(2 * s * math.sqrt(1 + 1 / 3))
    assert base.accuracy_noise(3) == pytest.approx(2 * s * math.sqrt(2 / 3))
    mean = sum(accuracies) / 3
    near = parity(noisy_curve(3), mean - 0.67, base)
    assert not near.passed and not near.decided and near.accuracy_noise == pytest.approx(base.accuracy_noise(1))
    assert near.verdict.startswith("not decided: accuracy -0.67 points") and "noise: ±" in near.verdict
    far = parity(noisy_curve(3), mean - 0.67, base, seeds=20)      # 20 seeds: noise ±0.65
    assert far.decided and far.verdict.startswith("differs: accuracy")
    assert parity(noisy_curve(3), mean - 3.35, base).decided
    off = parity(noisy_curve(3, offset=0.3), mean - 0.67, base)
    assert off.decided and not off.loss_ok and off.verdict.startswith("differs: loss")


@pytest.mark.parametrize("loss, why", [
    (noisy_curve(3)[:100] + [math.nan] * 100, "not finite"),
    (noisy_curve(3)[:150], "150 of 200 steps"),
])
def test_a_broken_or_short_loss_curve_fails(loss, why):
    base = baseline_spread([noisy_curve(1), noisy_curve(2)], [97.0, 97.4])
    result = parity(loss, 97.2, base)
    assert not result.loss_ok and why in result.verdict


def test_the_spread_needs_two_finite_seeds():
    with pytest.raises(ValueError):
        baseline_spread([noisy_curve(1)], [97.0])
    with pytest.raises(ValueError):
        baseline_spread([noisy_curve(1), [math.nan] * 200], [97.0, 97.0])


# ---------------------------------------------------------------- the digits


def test_digits_are_shipped_whole_with_a_fixed_split_and_order():
    images, labels = load_digits()
    assert images.shape == (1797, 8, 8) and images.max() == 16 and sorted(set(labels.tolist())) == list(range(10))
    a, b = DigitsData.load((56, 56)), DigitsData.load((56, 56))
    assert a.train_size == DIGITS_TRAIN and a.val_size == 1797 - DIGITS_TRAIN
    assert torch.equal(a.val_y, b.val_y) and torch.equal(a.train_x, b.train_x)
    first = [(x, y) for x, y in a.train_batches(0, 100, 0, "cpu")]
    assert len(first) == DIGITS_TRAIN // 100 and first[0][0].shape == (100, 3, 56, 56)
    again = next(b.train_batches(0, 100, 0, "cpu"))
    assert torch.equal(first[0][0], again[0]) and torch.equal(first[0][1], again[1])
    assert not torch.equal(next(a.train_batches(1, 100, 0, "cpu"))[1], first[0][1])   # another epoch
    assert not torch.equal(next(a.train_batches(0, 100, 1, "cpu"))[1], first[0][1])   # another seed
    val = list(a.val_batches(256, "cpu"))
    assert [len(y) for _, y in val] == [256, 256, 85]


# ---------------------------------------------------------------- the command


def train(tmp_path, *args):
    result = runner.invoke(app, ["train", "--device", "cpu", "--batch", "16", *args])
    assert result.exit_code == 0, result.output
    return result.output


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_train_writes_records_curves_and_report(tmp_path):
    out = tmp_path / "run"
    output = train(tmp_path, "--steps", "4", "--out", str(out))
    files = sorted((out / "records").iterdir())
    assert [f.name for f in files] == ["01-baseline-seed0.jsonl"]
    records = lines(files[0])
    assert [r["kind"] for r in records] == ["run"] + ["step"] * 4 + ["epoch", "end"]
    assert records[0]["recipe"] == "baseline" and records[0]["env"]["device_type"] == "cpu"
    assert all(set(r) >= {"step", "loss", "lr", "img_per_s", "grad_norm"} for r in records[1:5])
    assert all(r["grad_norm"] > 0 for r in records[1:5])
    assert 0 <= records[5]["val_acc"] <= 100 and records[-1]["status"] == "ok"
    # four steps are all warm-up: no img/s rather than a warm-up step's, and a note that says why
    assert records[-1]["img_per_s"] is None and "img/s not measured" in " ".join(records[-1]["notes"])
    assert "img/s not measured (warm-up steps only)" in output
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"
    report = (out / "report.md").read_text()
    assert "| baseline | 0 |" in report and "Made by `swinbench" in report
    assert "baseline" in output and "report" in output


def test_without_out_or_recipe_the_run_goes_to_a_folder_named_by_the_default_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train(tmp_path, "--steps", "2")
    (folder,) = (tmp_path / "reports" / "runs").iterdir()
    assert folder.name.startswith("train-baseline-swinbench_tiny_cpu-")
    assert [p.name for p in (folder / "records").iterdir()] == ["01-baseline-seed0.jsonl"]
    from workbench.train.loop import TrainConfig, default_run_name

    assert default_run_name(TrainConfig(compare=["amp"]), "m", "baseline").startswith("train-compare-m-")


def test_ema_is_validated_beside_the_weights_and_saved_beside_them(tmp_path):
    out = tmp_path / "run"
    output = train(tmp_path, "--steps", "4", "--ema", "0.5", "--save-checkpoints", "--out", str(out))
    records = lines(next((out / "records").iterdir()))
    assert records[0]["ema"] == 0.5
    epoch, end = records[5], records[-1]
    assert 0 <= epoch["val_acc_ema"] <= 100 and end["final_val_acc_ema"] == epoch["val_acc_ema"]
    averaged = torch.load(end["checkpoint_ema"], weights_only=False)["state_dict"]
    weights = torch.load(end["checkpoint"], weights_only=False)["state_dict"]
    assert averaged.keys() == weights.keys() and Path(end["checkpoint_ema"]).name == "01-baseline-seed0-ema.pt"
    assert not torch.equal(averaged["head.fc.weight"], weights["head.fc.weight"])
    report = (out / "report.md").read_text()
    assert "EMA val acc %" in report and "an EMA of the fp32 weights, decay 0.5" in report
    assert "EMA" in output


def test_a_reference_that_cannot_run_here_stops_before_the_others_train(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)      # fmha-graph's kernels: not available here
    out = tmp_path / "ref"
    result = runner.invoke(app, ["train", "--device", "cpu", "--batch", "16", "--compare", "baseline,amp",
                                 "--reference", "fmha-graph", "--steps", "2", "--out", str(out)])
    assert result.exit_code == 2 and "the reference fmha-graph is not available here" in result.output
    assert [(r.recipe, r.status) for r in read_runs(out / "records")] == [("fmha-graph", "not available")]


def test_compare_gives_each_recipe_a_parity_verdict_with_the_measured_spread(tmp_path):
    out = tmp_path / "cmp"
    output = train(tmp_path, "--compare", "baseline,amp,fmha-graph", "--baseline-seeds", "2", "--steps", "6",
                   "--out", str(out))
    runs = read_runs(out / "records")
    assert [(r.recipe, r.seed, r.status) for r in runs] == [
        ("baseline", 0, "ok"), ("baseline", 1, "ok"), ("amp", 0, "ok"), ("fmha-graph", 0, "not available")]
    assert [s["step"] for s in runs[2].steps] == list(range(1, 7))
    report = (out / "report.md").read_text()
    assert "## Parity with the baseline" in report and "Measured on the baseline (2 seeds): spread" in report
    amp_row = next(line for line in report.splitlines() if line.startswith("| amp |"))
    assert any(verdict in amp_row for verdict in ("PASS", "FAIL", "NOT DECIDED"))    # six steps decide little
    assert "| fmha-graph | 0 |" in report and "not available" in report
    assert "amp" in output and "reference" in output
    from workbench.results.verdicts import find_verdicts

    (verdict,) = find_verdicts([tmp_path])       # apply's report cites it (test_report)
    assert verdict.recipe == "amp" and verdict.reference == "baseline" and verdict.source == out
    assert verdict.passed == ("PASS" in amp_row) and verdict.steps == 6 and verdict.seeds == 1


def test_a_reference_other_than_the_baseline_and_several_seeds_per_recipe(tmp_path):
    out = tmp_path / "ref"
    output = train(tmp_path, "--compare", "baseline,amp", "--reference", "amp", "--baseline-seeds", "2", "--seeds", "2",
                   "--steps", "5", "--out", str(out))
    runs = read_runs(out / "records")
    assert [(r.recipe, r.seed) for r in runs] == [("amp", 0), ("amp", 1), ("baseline", 0), ("baseline", 1)]
    assert all(r.header["reference"] == "amp" for r in runs)
    report = (out / "report.md").read_text()
    assert "## Parity with `amp`" in report and "Measured on `amp` (2 seeds)" in report
    assert "| baseline | 0, 1 |" in report and "reference spread" in report and "the baseline" not in report
    assert "reference" in output


def test_parity_holds_the_mean_of_a_recipes_seeds_against_the_reference(tmp_path):
    """Two seeds of a recipe that sit on either side of the reference average out; one of them alone fails."""
    from workbench.results.train_runs import compare_runs

    def run(recipe, seed, curve, acc):
        return RunRecords(Path(f"{recipe}{seed}"), {"recipe": recipe, "seed": seed, "reference": "ref"},
                          [{"loss": v} for v in curve], [{"val_acc": acc}], {"status": "ok"})

    ref = [run("ref", s, noisy_curve(s), 90.0 + 0.1 * s) for s in range(3)]
    lo, hi = (run("r", s, noisy_curve(10 + s, offset=d), 90.1 + d) for s, d in ((0, -0.4), (1, 0.4)))
    both = compare_runs(ref + [lo, hi]).parity["r"]
    alone = compare_runs(ref + [lo]).parity["r"]
    assert both.loss_ok and both.accuracy_ok
    assert not alone.loss_ok


def test_an_earlier_run_is_refused_then_moved_aside_with_overwrite(tmp_path):
    out = tmp_path / "run"
    train(tmp_path, "--steps", "2", "--save-checkpoints", "--out", str(out))
    result = runner.invoke(app, ["train", "--device", "cpu", "--batch", "16", "--steps", "2", "--out", str(out)])
    assert result.exit_code == 2 and "--overwrite" in result.output
    train(tmp_path, "--steps", "2", "--out", str(out), "--overwrite")
    previous = list(tmp_path.glob("run.previous-*"))
    assert len(previous) == 1 and (previous[0] / "checkpoints").is_dir()   # the checkpoints go with their run
    assert not (out / "checkpoints").exists()


def test_an_image_folder_trains(tmp_path):
    pytest.importorskip("torchvision")
    from PIL import Image

    for c, color in enumerate(((255, 0, 0), (0, 0, 255))):
        folder = tmp_path / "images" / f"class{c}"
        folder.mkdir(parents=True)
        for i in range(10):
            Image.new("RGB", (40 + i, 30), color).save(folder / f"{i}.png")
    out = tmp_path / "run"
    train(tmp_path, "--data", str(tmp_path / "images"), "--steps", "2", "--batch", "4", "--workers", "0",
          "--out", str(out))
    header = lines(next((out / "records").iterdir()))[0]
    assert header["data"]["classes"] == 2 and header["data"]["train"] == 18 and header["data"]["val"] == 2


@pytest.mark.parametrize("args, message", [
    (["--data", "{tmp}/nothere"], "no such folder"),
    (["--data", "{tmp}/a-file.png"], "a file, not a folder"),
    (["--compare", "baseline,,amp"], "--compare 'baseline,,amp' has an empty item"),
    (["--data", "{tmp}"], "not an ImageFolder"),
    (["--recipe", "fmha-fast"], "unknown recipe"),
    (["--compare", "baseline,nope"], "unknown recipe"),
    (["--compare", "amp,amp"], "names 'amp' twice"),
    (["--compare", "baseline,amp", "--baseline-seeds", "1"], "at least 2"),
    (["--baseline-seeds", "3"], "goes with --compare"),
    (["--reference", "amp"], "goes with --compare"),
    (["--compare", "amp", "--reference", "nope"], "unknown recipe"),
    (["--seeds", "0"], "--seeds must be"),
    (["--resume"], "does not exist"),
    (["--steps", "0"], "--steps must be"),
    (["--batch", "0"], "--batch must be"),
    (["--batch", "5000"], "larger than the 1200 training images"),
    (["--steps", "5", "--epochs", "2"], "not both"),
    (["--lr", "-1"], "--lr must be"),
    (["--lr", "nan"], "--lr must be"),
    (["--label-smoothing", "1.5"], "below 1"),
    (["--clip-grad", "-1"], "--clip-grad"),
    (["--ema", "1"], "--ema must be a decay between 0 and 1"),
    (["--seed", "-1"], "--seed must be a whole number"),
    (["--ema", "0.99", "--nproc", "2", "--parallel", "fsdp"], "--ema is not kept under --parallel fsdp"),
    (["--model", "resnet50"], "not a timm Swin"),
])
def test_mistakes_are_one_line_and_exit_2_before_anything_is_written(tmp_path, args, message):
    if args[0] == "--data":
        pytest.importorskip("torchvision")
    (tmp_path / "a-file.png").write_bytes(b"")
    out = tmp_path / "out"
    result = runner.invoke(app, ["train", "--device", "cpu", "--out", str(out),
                                 *[a.replace("{tmp}", str(tmp_path)) for a in args]])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not out.exists()


def test_resume_keeps_finished_runs_and_trains_the_rest(tmp_path):
    out = tmp_path / "cmp"
    args = ["--compare", "baseline,amp", "--baseline-seeds", "2", "--steps", "3", "--out", str(out)]
    train(tmp_path, *args)
    first = {p.name: p.read_text() for p in (out / "records").iterdir()}
    amp = out / "records" / "03-amp-seed0.jsonl"
    amp.write_text("\n".join(amp.read_text().splitlines()[:3]) + "\n")     # cut short: no end record
    output = train(tmp_path, *args, "--resume")
    assert "2 of 3 runs finished before and are kept" in output and "did not finish" in output
    now = {p.name: p.read_text() for p in (out / "records").iterdir()}
    assert now["01-baseline-seed0.jsonl"] == first["01-baseline-seed0.jsonl"]
    assert lines(amp)[-1]["kind"] == "end" and len([r for r in lines(amp) if r["kind"] == "step"]) == 3
    assert "| amp | 0 |" in (out / "report.md").read_text()
    output = train(tmp_path, *args, "--seeds", "2", "--resume")      # more seeds of the same plan: added
    assert "3 of 4 runs finished before" in output and (out / "records" / "04-amp-seed1.jsonl").exists()


@pytest.mark.parametrize("change, message", [
    (["--steps", "4"], "trained with steps 3"),
    (["--seed", "7"], "not a run of this plan"),
    (["--steps", "4", "--overwrite"], "--overwrite and --resume exclude each other"),   # said before the steps
])
def test_resume_refuses_another_setup_and_changes_nothing(tmp_path, change, message):
    out = tmp_path / "cmp"
    args = ["--compare", "baseline,amp", "--baseline-seeds", "2", "--steps", "3", "--out", str(out)]
    train(tmp_path, *args)
    before = {p.name: p.read_text() for p in (out / "records").iterdir()}
    args = ["--compare", "baseline,amp", "--out", str(out)] + (["--steps", "3"] if change[0] != "--steps" else []) \
        + (["--baseline-seeds", "2"] if change[0] != "--baseline-seeds" else [])
    result = runner.invoke(app, ["train", "--device", "cpu", "--batch", "16", *args, *change, "--resume"])
    assert result.exit_code == 2 and message in result.output, result.output
    assert {p.name: p.read_text() for p in (out / "records").iterdir()} == before


def test_resume_into_another_commands_run_is_refused(tmp_path):
    out = tmp_path / "profile-run"
    out.mkdir()
    (out / "trace.sqlite").write_text("")
    (out / "kernels.csv").write_text("kernel,ms\n")
    result = runner.invoke(app, ["train", "--device", "cpu", "--steps", "2", "--out", str(out), "--resume"])
    assert result.exit_code == 2 and "holds another command's run" in result.output, result.output
    assert sorted(p.name for p in out.iterdir()) == ["kernels.csv", "trace.sqlite"]


def test_resume_adds_seeds_to_a_comparison_and_renumbers_its_records(tmp_path):
    out = tmp_path / "cmp"
    args = ["--compare", "baseline,amp,torch-sdpa", "--steps", "2", "--out", str(out)]
    train(tmp_path, *args)
    first = {p.name: p.read_text() for p in (out / "records").iterdir()}
    assert sorted(first) == ["01-baseline-seed0.jsonl", "02-baseline-seed1.jsonl", "03-amp-seed0.jsonl",
                             "04-torch-sdpa-seed0.jsonl"]
    output = train(tmp_path, *args, "--seeds", "3", "--resume")
    assert "4 of 9 runs finished before and are kept" in output and "renumbered" in output
    now = {p.name: p.read_text() for p in (out / "records").iterdir()}
    assert sorted(now) == ["01-baseline-seed0.jsonl", "02-baseline-seed1.jsonl", "03-baseline-seed2.jsonl",
                           "04-amp-seed0.jsonl", "05-amp-seed1.jsonl", "06-amp-seed2.jsonl",
                           "07-torch-sdpa-seed0.jsonl", "08-torch-sdpa-seed1.jsonl", "09-torch-sdpa-seed2.jsonl"]
    assert now["04-amp-seed0.jsonl"] == first["03-amp-seed0.jsonl"]           # moved, byte for byte
    assert now["07-torch-sdpa-seed0.jsonl"] == first["04-torch-sdpa-seed0.jsonl"]


def test_a_run_stopped_before_its_header_leaves_nothing_that_blocks_the_next(tmp_path):
    out = tmp_path / "cmp"
    args = ["--compare", "baseline,amp", "--steps", "2", "--out", str(out)]
    train(tmp_path, *args)
    (out / "records" / "03-amp-seed0.jsonl").write_text("")        # what a run stopped at its start left
    output = train(tmp_path, *args, "--resume")
    assert "stopped before its first record" in output
    assert lines(out / "records" / "03-amp-seed0.jsonl")[-1]["kind"] == "end"


def test_resume_refuses_runs_trained_on_another_device(tmp_path, monkeypatch):
    import workbench.train.loop as loop

    out = tmp_path / "cmp"
    args = ["--compare", "baseline,amp", "--steps", "2", "--out", str(out)]
    train(tmp_path, *args)
    record = out / "records" / "03-amp-seed0.jsonl"
    rows = lines(record)
    rows[0]["env"] = {**rows[0]["env"], "device_type": "cuda", "gpu": "NVIDIA H200"}
    record.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = runner.invoke(app, ["train", "--device", "cpu", "--batch", "16", *args, "--resume"])
    assert result.exit_code == 2 and "was trained on NVIDIA H200" in result.output, result.output


def test_resume_refuses_an_unfinished_run_of_another_setup(tmp_path):
    """A run cut short holds measured steps: another setup is refused for it too, never trained over."""
    out = tmp_path / "cmp"
    args = ["--compare", "baseline,amp", "--steps", "3", "--out", str(out)]
    train(tmp_path, *args)
    amp = out / "records" / "03-amp-seed0.jsonl"
    amp.write_text("\n".join(amp.read_text().splitlines()[:3]) + "\n")     # cut short: no end record
    before = {p.name: p.read_text() for p in (out / "records").iterdir()}
    result = runner.invoke(app, ["train", "--device", "cpu", "--batch", "16", "--compare", "baseline,amp",
                                 "--steps", "3", "--lr", "1e-3", "--out", str(out), "--resume"])
    assert result.exit_code == 2 and "trained with optimizer" in result.output, result.output
    assert {p.name: p.read_text() for p in (out / "records").iterdir()} == before


def test_resume_refuses_a_recipe_file_whose_passes_changed(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("name: mine\nextends: baseline\ndescription: mine\npasses: []\n")
    out = tmp_path / "run"
    args = ["--recipe", str(recipe), "--steps", "2", "--out", str(out)]
    train(tmp_path, *args)
    recipe.write_text("name: mine\nextends: amp\ndescription: mine\npasses: []\n")
    result = runner.invoke(app, ["train", "--device", "cpu", "--batch", "16", *args, "--seeds", "2", "--resume"])
    assert result.exit_code == 2 and "recipe mine's passes" in result.output, result.output
    assert sorted(p.name for p in (out / "records").iterdir()) == ["01-mine-seed0.jsonl"]


@pytest.mark.parametrize("recipe", [["--compare", "baseline,fp8"], ["--recipe", "int8"]])
def test_an_inference_only_recipe_is_refused_before_anything_trains(tmp_path, recipe):
    out = tmp_path / "cmp"
    result = runner.invoke(app, ["train", "--device", "cpu", *recipe, "--out", str(out)])
    assert result.exit_code == 2 and "runs inference only" in result.output, result.output
    assert not out.exists()


@pytest.mark.parametrize("damage, message", [
    (lambda rows: rows.insert(2, []), "not a train record"),
    (lambda rows: rows[2].update(loss="abc"), "'loss' is str, not a number"),
    (lambda rows: [r.pop("val_acc") for r in rows if r.get("kind") == "epoch"], "without 'val_acc'"),
])
def test_a_damaged_records_file_is_one_line(tmp_path, damage, message):
    from workbench.results.verdicts import find_verdicts

    out = tmp_path / "cmp"
    args = ["--compare", "baseline,amp", "--baseline-seeds", "2", "--steps", "2", "--out", str(out)]
    train(tmp_path, *args)
    record = out / "records" / "02-baseline-seed1.jsonl"
    rows = lines(record)
    damage(rows)
    record.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = runner.invoke(app, ["train", "--device", "cpu", "--batch", "16", *args, "--resume"])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output
    assert find_verdicts([tmp_path]) == []           # a report citing verdicts passes over it


def test_renumbering_moves_files_either_way_without_overwriting_one(tmp_path):
    """A plan whose runs move later (more seeds) or earlier (a recipe dropped) keeps every file: each is
    renamed only onto a place already vacated."""
    from workbench.train.loop import renumber_runs

    def folder(names):
        records = tmp_path / "records"
        if records.exists():
            for p in records.iterdir():
                p.unlink()
        records.mkdir(exist_ok=True)
        for name in names:
            (records / name).write_text(name.split("-")[1].removesuffix(".jsonl") + "\n")
        return records

    records = folder(["02-b.jsonl", "03-c.jsonl", "04-d.jsonl"])          # each one place earlier
    renumber_runs([(records / f"{i:02d}-{n}.jsonl", records / f"{i - 1:02d}-{n}.jsonl")
                   for i, n in ((2, "b"), (3, "c"), (4, "d"))])
    assert {p.name: p.read_text().strip() for p in records.iterdir()} == \
        {"01-b.jsonl": "b", "02-c.jsonl": "c", "03-d.jsonl": "d"}
    records = folder(["01-a.jsonl", "02-b.jsonl"])                        # each one place later
    renumber_runs([(records / "01-a.jsonl", records / "02-a.jsonl"), (records / "02-b.jsonl", records / "03-b.jsonl")])
    assert {p.name: p.read_text().strip() for p in records.iterdir()} == {"02-a.jsonl": "a", "03-b.jsonl": "b"}


def test_a_single_run_that_diverged_says_so_in_its_table_and_exits_2(tmp_path):
    """A diverged run keeps its records, report and curves, and the command says so in one line, exit 2."""
    out = tmp_path / "div"
    result = runner.invoke(app, ["train", "--device", "cpu", "--batch", "16", "--steps", "8", "--lr", "1e4",
                                 "--clip-grad", "0", "--label-smoothing", "0", "--out", str(out)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "diverged: loss" in result.output
    error = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and error[0].startswith("error: 1 of 1 run(s) diverged (baseline seed 0: loss ")
    assert lines(out / "records" / "01-baseline-seed0.jsonl")[-1]["status"] == "diverged"
    assert (out / "curves.png").is_file()
    table = (out / "report.md").read_text().split("\n\n")[1]
    assert "| status |" in table and "diverged: loss" in table


def test_resume_with_checkpoints_names_kept_runs_that_have_none(tmp_path):
    out = tmp_path / "ck"
    train(tmp_path, "--steps", "2", "--out", str(out))
    output = train(tmp_path, "--steps", "2", "--seeds", "2", "--save-checkpoints", "--out", str(out), "--resume")
    assert "1 kept run(s) saved no checkpoint" in " ".join(output.split()) and "baseline seed 0" in output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["02-baseline-seed1.pt"]


def test_resume_finds_the_checkpoints_of_runs_it_renumbers(tmp_path):
    out = tmp_path / "ck"
    args = ["--compare", "baseline,amp", "--steps", "2", "--save-checkpoints", "--out", str(out)]
    train(tmp_path, *args)
    output = train(tmp_path, *args, "--baseline-seeds", "3", "--resume")
    assert "renumbered" in output and "saved no checkpoint" not in " ".join(output.split())
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "01-baseline-seed0.pt", "02-baseline-seed1.pt", "03-amp-seed0.pt", "03-baseline-seed2.pt"]
