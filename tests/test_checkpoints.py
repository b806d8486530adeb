"""Trained weights from `swinbench train --save-checkpoints` into `swinbench apply --mode infer --checkpoint`:
the checkpoint is a plain timm state_dict (it loads into timm's model as built), every stage loads it and
runs the held-out digits, the gate holds accuracy and top-1 agreement against the baseline's at the
recipe's tolerances, and every wrong input is one line (exit 2)."""
import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from cli import app
from workbench.checkpoints import FORMAT, load_checkpoint, load_into, save_checkpoint
from workbench.errors import UserError
from workbench.ladder.apply import run_apply
from workbench.models import TINY_MODEL, build_model
from workbench.results.record import StageRecord, read_records
from workbench.train.loop import TrainConfig, run_train

HERE = Path(__file__).resolve().parent
runner = CliRunner()

FP8_SIM = """name: fp8-sim
extends: amp
description: fp8 fake quantization on any device
gate: {bf16: {logits_rel: 1.5e-1}}
passes:
  - name: quantize_linear
    params: {dtype: fp8, keep: [head.fc], simulate: true}
"""
# fp8 held to the baseline's every top-1 class and accuracy: the gate fails it exactly when it misses
STRICT = """name: strict
extends: amp
description: fp8 fake quantization held to the baseline's top-1 classes
gate: {bf16: {logits_rel: 1.5e-1, accuracy_drop: 0.0, top1_agreement: 1.0}}
passes:
  - name: quantize_linear
    params: {dtype: fp8, keep: [head.fc], simulate: true}
"""

# int8 with static activation scales: calibrated on the checkpoint's training images, not on noise
STATIC = """name: int8-static
extends: amp
description: int8 fake quantization, static activation scales
gate: {bf16: {logits_rel: 1.5e-1}}
passes:
  - name: quantize_linear
    params: {dtype: int8, keep: [head.fc], simulate: true, activations: static, calibration: max,
             calibration_batches: 2, calibration_batch: 16}
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    result = run_train(TrainConfig(steps=30, batch=32, lr=2e-3, device="cpu", save_checkpoints=True),
                       out_dir=out / "run", console=Console(file=io.StringIO()), progress=False)
    (summary,) = result.runs
    return summary


@pytest.fixture(scope="module")
def applied(trained, tmp_path_factory):
    folder = tmp_path_factory.mktemp("apply")
    (folder / "fp8-sim.yaml").write_text(FP8_SIM)
    (folder / "strict.yaml").write_text(STRICT)
    (folder / "int8-static.yaml").write_text(STATIC)
    run_apply("amp", model=None, batch=64, steps=1, warmup=0, device="cpu", progress=False, interleave=0,
              mode="infer", stages=["baseline", "amp", str(folder / "fp8-sim.yaml"), str(folder / "strict.yaml"),
                                    str(folder / "int8-static.yaml")],
              out_dir=folder / "run", console=Console(file=io.StringIO()), checkpoint=trained.checkpoint)
    return folder / "run", {r.stage: r for r in read_records(folder / "run" / "records")}


def test_train_saves_a_plain_timm_state_dict(trained):
    ckpt = load_checkpoint(trained.checkpoint)
    assert ckpt.model == TINY_MODEL and ckpt.num_classes == 10 and ckpt.data is None
    assert ckpt.meta["recipe"] == "baseline" and ckpt.meta["steps"] == 30
    assert ckpt.meta["val_acc"] == pytest.approx(trained.final_val_acc)
    plain = build_model(TINY_MODEL, num_classes=10)
    plain.load_state_dict(ckpt.state_dict)             # strict: the names are timm's own
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in ckpt.state_dict.items())
    end = json.loads(Path(trained.records).read_text().splitlines()[-1])
    assert end["kind"] == "end" and end["checkpoint"] == str(trained.checkpoint)


def test_every_stage_runs_the_heldout_images_and_the_gate_holds_them(applied):
    folder, records = applied
    base = records["baseline"].gate.metrics.heldout
    assert base["images"] == 597 and base["accuracy_drop_pts"] == 0 and base["top1_agreement"] == 1.0
    for stage in ("amp", "fp8-sim"):
        h = records[stage].gate.metrics.heldout
        assert h["reference_accuracy_pct"] == base["accuracy_pct"]
        assert h["accuracy_drop_pts"] == pytest.approx(h["reference_accuracy_pct"] - h["accuracy_pct"])
        assert 0.5 <= h["top1_agreement"] <= 1.0 and 0 < h["logits_rel"] < 0.2
        assert records[stage].gate.tolerance["accuracy_drop"] == 0.5
    strict = records["strict"].gate
    h = strict.metrics.heldout
    missed = h["accuracy_drop_pts"] > 0 or h["top1_agreement"] < 1
    assert (strict.status == "FAIL") == missed
    if missed:
        assert "held-out" in strict.reason
    assert records["amp"].checkpoint["path"] == str(load_checkpoint(records["amp"].checkpoint["path"]).path)
    assert records["amp"].checkpoint["heldout"].startswith("digits")
    text = (folder / "report.md").read_text()
    assert "## Trained model on held-out images" in text and "597 held-out images" in text
    assert "| strict | bf16 |" in text


def test_records_with_heldout_figures_round_trip_and_are_validated(applied):
    _, records = applied
    data = records["fp8-sim"].to_dict()
    assert StageRecord.from_dict(json.loads(json.dumps(data))).gate.metrics.heldout == records["fp8-sim"].gate.metrics.heldout
    bad = json.loads(json.dumps(data))
    bad["gate"]["metrics"]["heldout"]["extra"] = 1
    with pytest.raises(UserError, match="heldout"):
        StageRecord.from_dict(bad)
    bad = json.loads(json.dumps(data))
    del bad["checkpoint"]["path"]
    with pytest.raises(UserError, match="checkpoint"):
        StageRecord.from_dict(bad)


def test_heldout_failures_name_each_missed_limit():
    from workbench.optimize.gate import heldout_failures, heldout_metrics

    labels = torch.tensor([0, 1, 2, 3])
    ref = torch.eye(4)
    out = torch.eye(4)[[0, 1, 2, 2]]          # the last image flips to a wrong class
    m = heldout_metrics(out, ref, labels)
    assert m["accuracy_pct"] == 75.0 and m["reference_accuracy_pct"] == 100.0 and m["top1_agreement"] == 0.75
    why = heldout_failures(m, {"accuracy_drop": 0.5, "top1_agreement": 0.99})
    assert why == ["held-out accuracy 75.00% is 25.00 points below the baseline's 100.00% (> 0.5)",
                   "held-out top-1 agreement 0.75 < 0.99"]
    assert heldout_failures(m, {}) == [] and heldout_failures(m, {"accuracy_drop": 25.0}) == []


def test_gate_limits_outside_their_range_are_refused(tmp_path):
    from workbench.optimize.recipes import resolve_chain

    (tmp_path / "r.yaml").write_text("name: r\nextends: amp\ndescription: d\ngate: {bf16: {top1_agreement: 1.5}}\n")
    with pytest.raises(UserError, match="top1_agreement must be a share from 0 to 1"):
        resolve_chain(str(tmp_path / "r.yaml"))


def test_a_plain_state_dict_is_read_and_needs_data_to_measure(tmp_path):
    model = build_model(TINY_MODEL, num_classes=7)
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    ckpt = load_checkpoint(tmp_path / "plain.pt")
    assert ckpt.model is None and ckpt.num_classes == 7 and ckpt.meta is None
    load_into(build_model(TINY_MODEL, num_classes=7), ckpt)
    with pytest.raises(UserError, match="does not fit the model"):
        load_into(build_model(TINY_MODEL, num_classes=10), ckpt)
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, tmp_path / "wrapped.pt")
    assert load_checkpoint(tmp_path / "wrapped.pt").num_classes == 7
    saved = save_checkpoint(tmp_path / "ours.pt", model.state_dict(), model=TINY_MODEL, num_classes=7,
                            input_size=(3, 56, 56), data=None, recipe="amp", seed=1, steps=5, val_acc=None)
    assert torch.load(saved, weights_only=True)["format"] == FORMAT
    result = runner.invoke(app, ["apply", "--mode", "infer", "--checkpoint", str(tmp_path / "plain.pt"),
                                 "--model", TINY_MODEL, "--device", "cpu", "--stages", "baseline",
                                 "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "is a plain state_dict" in result.output and "give --data DIR" in result.output


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "{missing}"], "no such file"),
    (["--checkpoint", "{garbage}"], "cannot be read as a torch checkpoint"),
    (["--checkpoint", "{tensor}"], "holds a Tensor"),
    (["--checkpoint", "{ours}", "--mode", "train"], "--checkpoint goes with --mode infer"),
    (["--data", "{folder}"], "--data goes with --checkpoint"),
    (["--checkpoint", "{ours}", "--model", "swin_tiny_patch4_window7_224"], "holds a swinbench_tiny_cpu"),
    (["--checkpoint", "{ours}", "--data", "{empty}"], "not an ImageFolder"),
])
def test_wrong_inputs_are_one_line_and_exit_2(tmp_path, args, message):
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    model = build_model(TINY_MODEL, num_classes=10)
    save_checkpoint(tmp_path / "ours.pt", model.state_dict(), model=TINY_MODEL, num_classes=10,
                    input_size=(3, 56, 56), data=None, recipe="baseline", seed=0, steps=1, val_acc=None)
    names = {"missing": tmp_path / "missing.pt", "garbage": tmp_path / "garbage.pt", "tensor": tmp_path / "tensor.pt",
             "ours": tmp_path / "ours.pt", "folder": tmp_path, "empty": tmp_path / "empty"}
    (tmp_path / "empty").mkdir()
    args = [a.format(**names) for a in args]
    mode = [] if "--mode" in args else ["--mode", "infer"]
    result = runner.invoke(app, ["apply", *mode, *args, "--device", "cpu", "--stages", "baseline",
                                 "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) <= 3
    assert not (tmp_path / "run").exists()       # refused before the folder is claimed


def test_a_plain_state_dict_is_measured_on_an_imagefolder(tmp_path):
    pytest.importorskip("torchvision")
    from PIL import Image

    for c in range(2):
        for split, count in (("train", 2), ("val", 5)):
            folder = tmp_path / "images" / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (12, 12), (120 * c, 20 * i, 0)).save(folder / f"{i}.png")
    torch.save(build_model(TINY_MODEL, num_classes=2).state_dict(), tmp_path / "plain.pt")
    run_apply("baseline", model=TINY_MODEL, batch=4, steps=1, warmup=0, device="cpu", progress=False,
              interleave=0, mode="infer", stages=["baseline", "amp"], out_dir=tmp_path / "run",
              console=Console(file=io.StringIO()), checkpoint=tmp_path / "plain.pt", data=tmp_path / "images")
    records = {r.stage: r for r in read_records(tmp_path / "run" / "records")}
    assert records["amp"].gate.metrics.heldout["images"] == 10      # val/: 5 images of each class
    assert records["amp"].checkpoint["format"] == "state_dict"
    assert records["amp"].checkpoint["heldout"] == str((tmp_path / "images").resolve())


def test_static_scales_are_calibrated_on_the_checkpoints_training_images(applied):
    _, records = applied
    (quant,) = [p for p in records["int8-static"].passes if p.name == "quantize_linear"]
    calibration = quant.details["calibration"]
    assert calibration["data"] == "training images of the checkpoint's data"
    assert calibration["batches"] == 2 and calibration["batch"] == 16
