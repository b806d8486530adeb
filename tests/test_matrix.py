"""`swinbench matrix`: planning cells, rendering the table from stored records, resuming, bad input."""
import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from record_helpers import ENV, record
from workbench.errors import UserError
from workbench.ladder import matrix
from workbench.models import TINY_MODEL
from workbench.results.matrix_table import (README_BEGIN, README_END, SLOWER_MARK, cell_folders, matrix_markdown,
                                            matrix_rows, read_matrix,
                                            readme_matrix_block, render_matrix_for_readme, write_matrix)
from workbench.results.record import write_record

CHAIN = ["baseline", "amp", "apex", "window", "fmha"]


def cell_records(model="swin_tiny_patch4_window7_224", mode="train", batch=128, *, amp=(80.0, 66.0),
                 fmha=(60.0, 24.0), peer=(34.0, 29.0), run_id="r1", cpu=False, fmha_gate="PASS"):
    """The three stage records of one cell: (eager ms, graph ms or None) per stage, as apply writes them."""
    out = []
    for i, (stage, (eager, graph), alone) in enumerate([("amp", amp, True), ("fmha", fmha, False),
                                                        ("torch-compile", peer, True)]):
        rec = record(i, stage, {"amp": "baseline", "fmha": "window", "torch-compile": "amp"}[stage], eager,
                     gate=fmha_gate if stage == "fmha" else "PASS")
        rec.update(run_id=run_id, model=model, mode=mode, batch=batch, pytorch_alone=alone)
        rec["chain"] = [{"name": n, "source": None, "passes": []} for n in
                        (CHAIN[: CHAIN.index(stage) + 1] if stage in CHAIN else ["baseline", "amp", stage])]
        if graph is not None:
            rec["graph"] = {"timing": {"samples_ms": [graph] * 4, "warmup": 5, "clock": "cuda-events",
                                       "median_ms": graph, "iqr_ms": 0.02, "repeats": 4},
                            "img_per_s": batch / graph * 1e3, "step_ms": graph, "step_iqr_ms": 0.02,
                            "how": "the whole step captured once and replayed as one CUDA graph"}
        if cpu:
            rec["env"] = {**ENV, "device_type": "cpu", "gpu": None, "driver": None, "cuda": None}
            rec["device"] = "cpu"
        out.append(rec)
    return out


def write_cell(out: Path, name: str, records) -> Path:
    for rec in records:
        write_record(rec, out / name / "records")
    return out / name


# ---------------------------------------------------------------- planning


def test_plan_is_models_by_modes_with_per_model_training_batch():
    cells = matrix.plan_cells(matrix.FAMILY, matrix.DEFAULT_MODES)
    assert len(cells) == 18
    assert [(c.mode, c.batch) for c in cells[:3]] == [("train", 128), ("infer", 64), ("infer", 1)]
    train = {c.model: c.batch for c in cells if c.mode == "train"}
    assert train == {m: matrix.TRAIN_BATCH[m] for m in matrix.FAMILY}
    assert train["swin_base_patch4_window12_384"] == 32
    assert cells[0].name == "swin_tiny_patch4_window7_224-train-b128"
    assert cells[-1].name == "swinv2_tiny_window8_256-infer-b1"
    assert len({c.name for c in cells}) == 18


def test_train_batch_option_and_rule_for_unlisted_models():
    cells = matrix.plan_cells(["swin_small_patch4_window7_224"], ["train", "infer1"], train_batch=16)
    assert [(c.mode, c.batch) for c in cells] == [("train", 16), ("infer", 1)]
    assert matrix.train_batch_for("swin_large_patch4_window12_384") == 32
    assert matrix.train_batch_for("swin_base_patch4_window7_224_in22k") == 64
    assert matrix.train_batch_for(TINY_MODEL) == 8
    assert matrix.train_batch_for("swinv2_cr_small_ns_224") == 128
    assert matrix.train_batch_for("swinv2_cr_base_224") == 64 and matrix.train_batch_for("swinv2_cr_huge_224") == 32


@pytest.mark.parametrize("kwargs, needle", [
    (dict(models=["swin_nope"], modes=["train"]), "unknown model 'swin_nope'"),
    (dict(models=[TINY_MODEL], modes=["train", "infer32"]), "unknown mode 'infer32'"),
    (dict(models=[TINY_MODEL], modes=["train"], train_batch=0), "--train-batch must be at least 1"),
])
def test_bad_plans_are_refused(kwargs, needle):
    with pytest.raises(UserError, match=needle):
        matrix.plan_cells(**kwargs)


def test_parse_list_and_fused_check():
    assert matrix.parse_list(" a, b ", "models") == ["a", "b"]
    for empty in (" , ", []):
        with pytest.raises(UserError, match="empty"):
            matrix.parse_list(empty, "modes")
    for doubled in ("train,,infer1", "train,infer1,"):   # refused as --stages refuses it, not dropped
        with pytest.raises(UserError, match="has an empty item"):
            matrix.parse_list(doubled, "modes")
    with pytest.raises(UserError, match="twice"):
        matrix.parse_list("train,train", "modes")
    with pytest.raises(UserError, match="runs PyTorch alone"):
        matrix.check_fused("torch-compile")
    matrix.check_fused("fmha")
    # a quantizing stage cannot train: refused before any cell runs, for the training cells only
    with pytest.raises(UserError, match="cannot train.*--fused train=fmha,infer=fp8"):
        matrix.plan_stages({"train": "fp8", "infer": "fp8"}, {"train", "infer"})
    assert matrix.plan_stages({"train": "fp8", "infer": "fp8"}, {"infer"})["infer"][1] == "fp8"
    assert matrix.parse_fused(None) == {"train": "fmha", "infer": "dense"}
    assert matrix.parse_fused("block") == {"train": "block", "infer": "block"}
    assert matrix.parse_fused(" infer = fp8 ") == {"train": "fmha", "infer": "fp8"}
    assert matrix.parse_fused("train=block,infer=dense") == {"train": "block", "infer": "dense"}
    for bad, needle in (("warp=fmha", "MODE=STAGE pairs"), ("train=", "MODE=STAGE pairs"),
                        ("train=fmha,train=block", "named twice"), (" ", "empty")):
        with pytest.raises(UserError, match=needle):
            matrix.parse_fused(bad)


def test_each_mode_runs_its_own_fused_stage(tmp_path):
    """Training cells run fmha, inference cells dense (by default); --compiled adds a compiled form only
    where the stage has one, and says so for the others."""
    fake = FakeApply()
    console = Console(record=True, width=200)
    matrix.run_matrix(models=[TINY_MODEL], modes=["train", "infer1"], out_dir=tmp_path / "m", device="cpu",
                      run_apply=fake, progress=False, compiled=True, console=console)
    assert [(c["recipe"], c["stages"]) for c in fake.calls] == [
        ("fmha", ["amp", "fmha", "fmha-compile", "torch-compile"]), ("dense", ["amp", "dense", "torch-compile"])]
    assert "dense has no built-in compiled form" in console.export_text()
    with pytest.raises(UserError, match="no built-in block-compile"):
        matrix.run_matrix(models=[TINY_MODEL], modes=["infer1"], out_dir=tmp_path / "n", device="cpu",
                          run_apply=FakeApply(), progress=False, compiled=True, fused="block")
    with pytest.raises(UserError, match="runs PyTorch alone"):
        matrix.run_matrix(models=[TINY_MODEL], modes=["infer1"], out_dir=tmp_path / "o", device="cpu",
                          run_apply=FakeApply(), progress=False, fused="train=fmha,infer=amp")


# ---------------------------------------------------------------- rendering


def test_row_takes_each_sides_best_form():
    row = matrix_rows([("c", cell_records())])[0]
    assert (row["swinbench"], row["swinbench_form"], row["swinbench_ms"]) == ("fmha", "graph-replayed", 24.0)
    assert (row["peer"], row["peer_form"], row["peer_ms"]) == ("torch-compile", "graph-replayed", 29.0)
    assert (row["amp_ms"], row["amp_form"]) == (66.0, "graph-replayed")
    assert row["x_peer"] == pytest.approx(29 / 24) and row["x_amp"] == pytest.approx(66 / 24)
    assert row["swinbench_img_per_s"] == pytest.approx(128 / 24e-3) and row["peak_mem_bytes"] == 3 * 2**30
    assert row["gate"] == "PASS" and not row["slower"] and row["device"] == "NVIDIA H200"


def test_slower_cell_is_marked_and_counted():
    rows = matrix_rows([("fast", cell_records()),
                        ("slow", cell_records("swin_base_patch4_window12_384", batch=32, fmha=(70.0, 48.0),
                                              peer=(40.0, 29.0), run_id="r2"))])
    assert [r["slower"] for r in rows] == [False, True]
    text = matrix_markdown(rows, "swinbench matrix --render-only X")
    slow_line = next(line for line in text.splitlines() if "window 12" in line)
    assert f"**0.60x** {SLOWER_MARK}" in slow_line and "48.00 ± 0.02 (fmha, graph)" in slow_line
    assert "slower than the strongest PyTorch-alone peer in 1 of 2 cells" in text
    assert "lowest 0.60x (Swin-B 384 (window 12), train, batch 32)" in text
    assert text.startswith("# swinbench matrix — NVIDIA H200") and text.rstrip().endswith("`swinbench matrix --render-only X`.")


def test_cpu_cells_without_graph_columns_use_eager_forms_and_say_cpu():
    rows = matrix_rows([("c", cell_records(TINY_MODEL, batch=8, amp=(9.0, None), fmha=(12.0, None),
                                           peer=(10.0, None), cpu=True))])
    row = rows[0]
    assert (row["swinbench_ms"], row["swinbench_form"], row["peer_ms"], row["device"]) == (12.0, "as written", 10.0, "CPU")
    assert row["slower"]
    assert "CPU — not a GPU speed figure" in matrix_markdown(rows)


def test_failed_gate_leaves_the_swinbench_side_empty():
    row = matrix_rows([("c", cell_records(fmha_gate="FAIL"))])[0]
    assert row["swinbench"] is None and row["x_peer"] is None and row["gate"] == "fmha FAIL"
    assert (row["peer"], row["peer_form"], row["peer_ms"]) == ("torch-compile", "graph-replayed", 29.0)
    assert "No cell has both" in matrix_markdown([row])


def test_a_cell_without_a_comparison_is_named_in_the_summary():
    rows = matrix_rows([("ok", cell_records()),
                        ("failed", cell_records("swin_base_patch4_window7_224", batch=64, fmha_gate="FAIL", run_id="r2"))])
    text = matrix_markdown(rows)
    assert "at least as fast as the strongest PyTorch-alone peer in 1 of 2 cells" in text
    assert "1 cell(s) without both a swinbench stage and a peer that passed the gate: Swin-B 224 train b64." in text


def test_a_table_of_several_devices_names_each_rows_device():
    rows = matrix_rows([("gpu", cell_records()),
                        ("cpu", cell_records(TINY_MODEL, batch=8, amp=(9.0, None), fmha=(12.0, None),
                                             peer=(10.0, None), cpu=True, run_id="r2"))])
    lines = matrix_markdown(rows).splitlines()
    assert any(line.startswith("| Swin-T 224 (NVIDIA H200) |") for line in lines)
    assert any("(CPU) |" in line.split("|")[1] + "|" for line in lines if line.startswith("| "))


def test_write_matrix_orders_cells_and_skips_moved_aside_runs(tmp_path):
    write_cell(tmp_path, "b-infer-b64", cell_records("swin_base_patch4_window7_224", "infer", 64, run_id="r3"))
    write_cell(tmp_path, "t-infer-b1", cell_records(mode="infer", batch=1, run_id="r2"))
    write_cell(tmp_path, "t-train-b8", cell_records(run_id="r1"))
    write_cell(tmp_path, "t-train-b8.previous-r0", cell_records(run_id="r0"))
    md, js = write_matrix(tmp_path, matrix.FAMILY, "cmd")
    cells = json.loads(js.read_text())["cells"]
    assert [c["cell"] for c in cells] == ["t-train-b8", "t-infer-b1", "b-infer-b64"]
    assert md.read_text().count("| Swin-") == 3
    with pytest.raises(UserError, match="no matrix cells"):
        read_matrix(tmp_path / "t-train-b8" / "records")


# ---------------------------------------------------------------- running (run_apply mocked)


class FakeApply:
    """Stands in for run_apply: writes the cell's three records, measured as asked (device, steps)."""

    def __init__(self, fail_on=None):
        self.calls = []
        self.fail_on = fail_on

    def __call__(self, recipe, *, model, batch, mode, out_dir, stages, resume, **kw):
        self.calls.append(dict(recipe=recipe, model=model, batch=batch, mode=mode, out_dir=Path(out_dir),
                               stages=stages, resume=resume, **kw))
        if self.fail_on == (model, mode, batch):
            raise KeyboardInterrupt
        for rec in cell_records(model, mode, batch, run_id=Path(out_dir).name, cpu=kw["device"] == "cpu"):
            if rec["stage"] == "fmha":   # the fused stage the cell asked for
                rec["stage"] = rec["recipe"] = recipe
                rec["chain"][-1]["name"] = recipe
            timing = rec["timing"]
            timing.update(repeats=kw["steps"], warmup=kw["warmup"], samples_ms=timing["samples_ms"][:1] * kw["steps"])
            write_record(rec, Path(out_dir) / "records")


def test_run_matrix_runs_each_cell_into_its_folder_then_resume_skips_them(tmp_path):
    fake = FakeApply(fail_on=(TINY_MODEL, "infer", 1))
    out = tmp_path / "m"
    with pytest.raises(KeyboardInterrupt):
        matrix.run_matrix(models=[TINY_MODEL], out_dir=out, device="cpu", run_apply=fake, progress=False)
    assert [c["out_dir"].name for c in fake.calls] == [f"{TINY_MODEL}-train-b8", f"{TINY_MODEL}-infer-b64",
                                                       f"{TINY_MODEL}-infer-b1"]
    assert fake.calls[0]["stages"] == ["amp", "fmha", "torch-compile"] and fake.calls[0]["recipe"] == "fmha"
    assert fake.calls[0]["device"] == "cpu" and fake.calls[0]["steps"] == 20
    assert len(json.loads((out / "matrix.json").read_text())["cells"]) == 2   # the finished cells, after Ctrl-C

    with pytest.raises(UserError, match="holds an earlier matrix.*--resume continues it"):
        matrix.run_matrix(models=[TINY_MODEL], out_dir=out, device="cpu", run_apply=FakeApply())
    again = FakeApply()
    result = matrix.run_matrix(models=[TINY_MODEL], out_dir=out, device="cpu", run_apply=again, resume=True,
                               progress=False)
    assert [c["out_dir"].name for c in again.calls] == [f"{TINY_MODEL}-infer-b1"]
    assert again.calls[0]["resume"] is False   # nothing of that cell on disk: a plain run
    assert result["skipped"] == [f"{TINY_MODEL}-train-b8", f"{TINY_MODEL}-infer-b64"]
    assert len(json.loads((out / "matrix.json").read_text())["cells"]) == 3


def test_resume_reads_each_cells_records_once(tmp_path, monkeypatch):
    """The device check and the finished-cell check of --resume share one read of each cell's records."""
    out = tmp_path / "m"
    matrix.run_matrix(models=[TINY_MODEL], out_dir=out, device="cpu", run_apply=FakeApply(), progress=False)
    reads = []
    read = matrix.read_records
    monkeypatch.setattr(matrix, "read_records", lambda paths: reads.append(Path(paths[0]).parent.name) or read(paths))
    result = matrix.run_matrix(models=[TINY_MODEL], out_dir=out, device="cpu", run_apply=FakeApply(), resume=True,
                               progress=False)
    assert result["skipped"] == [c.name for c in result["cells"]] and result["ran"] == []
    assert sorted(reads) == sorted(c.name for c in result["cells"])


def test_a_run_of_one_mode_keeps_the_folders_other_cells_in_the_table(tmp_path):
    out = tmp_path / "m"
    matrix.run_matrix(models=[TINY_MODEL], out_dir=out, device="cpu", run_apply=FakeApply(), progress=False)
    buf = Console(file=__import__("io").StringIO(), width=200)
    matrix.run_matrix(models=[TINY_MODEL], modes=["infer1"], out_dir=out, device="cpu", run_apply=FakeApply(),
                      resume=True, progress=False, console=buf)
    assert len(json.loads((out / "matrix.json").read_text())["cells"]) == 3
    assert "(0 cell(s) run, 1 kept, 2 other cell(s) of the folder)" in buf.file.getvalue()


def test_cell_with_a_failed_stage_is_continued_with_apply_resume(tmp_path):
    out = tmp_path / "m"
    name = f"{TINY_MODEL}-train-b8"
    recs = cell_records(TINY_MODEL, batch=8)
    recs[1].update(status="error", error="boom")
    write_cell(out, name, recs)
    plan = dict(steps=4, warmup=5, on_gpu=True)   # what record_helpers' records were measured with
    assert not matrix.cell_finished(out / name, matrix.cell_stages("fmha"), **plan)
    recs[1].update(status="ok", error=None)
    write_record(recs[1], out / name / "records")
    assert matrix.cell_finished(out / name, matrix.cell_stages("fmha"), **plan)
    assert not matrix.cell_finished(out / name, matrix.cell_stages("fmha"), **{**plan, "steps": 20})
    assert not matrix.cell_finished(out / name, matrix.cell_stages("fmha"), **{**plan, "on_gpu": False})
    assert not matrix.cell_finished(out / name, matrix.cell_stages("fmha"), **plan, profile=True)   # never captured
    fake = FakeApply()
    with pytest.raises(UserError, match="holds cells measured on NVIDIA H200 .*this command measures on CPU"):
        matrix.run_matrix(models=[TINY_MODEL], modes=["train"], out_dir=out, device="cpu", run_apply=fake,
                          resume=True)
    assert fake.calls == []
    cpu = cell_records(TINY_MODEL, batch=8, cpu=True)
    cpu[1].update(status="error", error="boom")
    write_cell(out, name, cpu)
    matrix.run_matrix(models=[TINY_MODEL], modes=["train"], out_dir=out, device="cpu", run_apply=fake, resume=True)
    assert fake.calls[0]["resume"] is True


def test_a_failed_stage_does_not_stop_the_other_cells(tmp_path):
    class Failing(FakeApply):
        def __call__(self, recipe, **kw):
            super().__call__(recipe, **kw)
            if kw["mode"] == "train":
                err = UserError("1 stage(s) failed (fmha: boom)")
                err.result = object()
                raise err

    fake = Failing()
    with pytest.raises(UserError, match="1 matrix cell.*fmha: boom"):
        matrix.run_matrix(models=[TINY_MODEL], out_dir=tmp_path / "m", device="cpu", run_apply=fake)
    assert len(fake.calls) == 3
    assert len(json.loads((tmp_path / "m" / "matrix.json").read_text())["cells"]) == 3


# ---------------------------------------------------------------- the command


def test_cli_bad_input_is_one_line_exit_2(tmp_path):
    from cli import app

    runner = CliRunner()
    for args, needle in ((["--models", "swin_nope"], "unknown model"), (["--modes", "train,warp"], "unknown mode"),
                         (["--train-batch", "0"], "at least 1"), (["--modes", ","], "empty"),
                         (["--fused", "amp"], "PyTorch alone"), (["--resume"], "--resume needs --out"),
                         (["--render-only", str(tmp_path)], "no matrix cells")):
        res = runner.invoke(app, ["matrix", *args] if args[0] == "--render-only" else
                            ["matrix", "--device", "cpu", "--out", str(tmp_path / "o"), *args]
                            if args[0] != "--resume" else ["matrix", "--device", "cpu", *args])
        assert res.exit_code == 2, (args, res.output)
        assert needle in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "o").exists()


def test_render_only_takes_cells_alone_and_says_what_a_run_folder_is(tmp_path):
    """Folders of other runs (a reports/ folder of apply runs) are not cells: nothing is rendered there; a
    cell's own folder is named as one run's, not a matrix."""
    write_cell(tmp_path, "h200-swin_base-b64-train", cell_records())
    with pytest.raises(UserError, match="holds no matrix cells"):
        write_matrix(tmp_path, matrix.FAMILY, "cmd")
    assert not (tmp_path / "matrix.md").exists() and not (tmp_path / "matrix.json").exists()
    cell = write_cell(tmp_path, "t-train-b8", cell_records())
    with pytest.raises(UserError, match="is one run's folder .* not a matrix"):
        write_matrix(cell, matrix.FAMILY, "cmd")
    assert [p.name for p in cell_folders(tmp_path)] == ["t-train-b8"]


def test_cli_render_only(tmp_path):
    from cli import app

    write_cell(tmp_path, "t-train-b8", cell_records())
    res = CliRunner().invoke(app, ["matrix", "--render-only", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "matrix.md" in res.output and (tmp_path / "matrix.json").is_file()


# ---------------------------------------------------------------- the README's block


def readme_command(block: str) -> list[str]:
    line = next(line for line in block.splitlines() if line.startswith("Rendered by `"))
    return line.split("`")[1].split()


def test_readme_matrix_block_is_what_its_records_render():
    """When README.md holds the matrix block, it is what its cells' committed records render."""
    readme = Path(__file__).resolve().parent.parent / "README.md"
    text = readme.read_text(encoding="utf-8")
    if README_BEGIN not in text:
        pytest.skip("README.md holds no matrix block yet (a GPU session renders it)")
    block = readme_matrix_block(text)
    argv = readme_command(block)
    assert argv[:3] == ["swinbench", "matrix", "--render-only"] and argv[-2:] == ["--readme", "README.md"], argv
    assert render_matrix_for_readme(readme.parent / argv[3], readme, matrix.FAMILY).strip("\n") == block, (
        "README.md's matrix differs from its records: run " + " ".join(argv))


def test_cli_rewrites_only_the_matrix_block(tmp_path):
    from cli import app

    out = tmp_path / "reports" / "m"
    write_cell(out, "t-train-b8", cell_records())
    readme = tmp_path / "README.md"
    readme.write_text(f"# t\n\nbefore\n{README_BEGIN}\nstale table\n{README_END}\nafter ü\n", encoding="utf-8")
    runner = CliRunner()
    res = runner.invoke(app, ["matrix", "--render-only", str(out), "--readme", str(readme)])
    assert res.exit_code == 0, res.output
    text = readme.read_text(encoding="utf-8")
    assert text.startswith(f"# t\n\nbefore\n{README_BEGIN}\n**swinbench matrix — NVIDIA H200**\n")
    assert text.endswith(f"--readme README.md`. Do not edit by hand.\n{README_END}\nafter ü\n") and "stale table" not in text
    block = readme_matrix_block(text)
    assert readme_command(block) == ["swinbench", "matrix", "--render-only", "reports/m", "--readme", "README.md"]
    assert render_matrix_for_readme(out, readme).strip("\n") == block
    assert runner.invoke(app, ["matrix", "--render-only", str(out), "--readme", str(readme)]).exit_code == 0
    assert readme.read_text(encoding="utf-8") == text
    readme.write_text("no markers\n")
    res = runner.invoke(app, ["matrix", "--render-only", str(out), "--readme", str(readme)])
    assert res.exit_code == 2 and "matrix:begin" in res.output and len(res.output.strip().splitlines()) == 1
    res = runner.invoke(app, ["matrix", "--readme", str(readme)])
    assert res.exit_code == 2 and "--render-only" in res.output


def test_a_quantized_fused_stage_brings_torchaos_peer_of_its_precision():
    assert matrix.cell_stages("fmha") == ["amp", "fmha", "torch-compile"]
    assert matrix.cell_stages("fp8-compile") == ["amp", "fp8-compile", "torch-compile", "torchao-fp8"]
    assert matrix.cell_stages("int8") == ["amp", "int8", "torch-compile", "torchao-int8"]
    cells = matrix.plan_cells(["swin_tiny_patch4_window7_224"], ["infer8"])
    assert [(c.mode, c.batch) for c in cells] == [("infer", 8)]


def test_profiled_cells_show_the_swinbench_stages_kernels_against_their_floor(tmp_path):
    floors = [{"kernel": f"_k{i}", "largest_argument": "64x49x96 bfloat16", "calls_per_step": 2.0,
               "median_us": 10.0 + i, "floor_us": 2.0, "floor_pct": 20.0} for i in range(6)]
    recs = cell_records()
    recs[1]["profile"] = {"backend": "nsys", "floors": floors, "floor_peak_gbps": 4800.0}    # the fmha stage
    write_cell(tmp_path, "t-train-b8", recs)
    write_cell(tmp_path, "t-infer-b1", cell_records(mode="infer", batch=1, run_id="r2"))        # not profiled
    md, js = write_matrix(tmp_path, matrix.FAMILY, "cmd")
    text = md.read_text()
    assert "## swinbench's kernels against their memory floor" in text
    assert "| Swin-T 224 | training | 128 | fmha | _k0 | 64x49x96 bfloat16 | 2 | 10.0 | 2.0 | 20% |" in text
    assert "_k3" in text and "_k4" not in text      # FLOOR_ROWS per cell
    cells = {c["cell"]: c for c in json.loads(js.read_text())["cells"]}
    assert len(cells["t-train-b8"]["floors"]) == 4 and cells["t-infer-b1"]["floors"] == []
    # the README's block keeps to the table
    assert "memory floor" not in matrix_markdown(read_matrix(tmp_path), heading=False)


def test_matrix_profile_asks_apply_to_profile_every_cell(tmp_path):
    fake = FakeApply()
    matrix.run_matrix(models=[TINY_MODEL], modes=["train"], out_dir=tmp_path / "m", device="cpu", run_apply=fake,
                      progress=False, profile=True)
    assert fake.calls[0]["profile"] is True


def test_compiled_adds_the_fused_stages_compiled_form_and_the_row_takes_the_faster(tmp_path):
    assert matrix.cell_stages("fmha", compiled=True) == ["amp", "fmha", "fmha-compile", "torch-compile"]
    assert matrix.cell_stages("int8", compiled=True) == ["amp", "int8", "int8-compile", "torch-compile", "torchao-int8"]
    with pytest.raises(UserError, match="no built-in block-compile that extends block; name a stage with one"):
        matrix.cell_stages("block", compiled=True)
    fake = FakeApply()
    matrix.run_matrix(models=[TINY_MODEL], modes=["train"], out_dir=tmp_path / "m", device="cpu", run_apply=fake,
                      progress=False, compiled=True)
    assert fake.calls[0]["stages"] == ["amp", "fmha", "fmha-compile", "torch-compile"]
    # a cell where the compiled form wins: the row names it
    recs = cell_records()
    compiled = dict(recs[1], stage="fmha-compile", stage_index=3, extends="fmha", timing={**recs[1]["timing"]})
    compiled["chain"] = recs[1]["chain"] + [{"name": "fmha-compile", "source": None, "passes": []}]
    compiled["graph"] = {**recs[1]["graph"], "step_ms": 20.0, "img_per_s": 128 / 20e-3,
                         "timing": {**recs[1]["graph"]["timing"], "median_ms": 20.0, "samples_ms": [20.0] * 4}}
    row = matrix_rows([("c", recs + [compiled])])[0]
    assert row["swinbench"] == "fmha-compile" and row["swinbench_ms"] == 20.0


def test_measured_line_names_each_machine_and_its_dates():
    """Under the table: what measured the cells, each distinct GPU/driver/versions once, with the dates."""
    from workbench.results.matrix_table import measured_line

    h200 = "NVIDIA H200 (driver 580.159.04); torch 2.11.0+cu130, triton 3.6.0, timm 1.0.29"
    rows = [{"measured_with": h200, "date": "2026-12-03"}, {"measured_with": h200, "date": "2026-12-05"},
            {"measured_with": "CPU; torch 2.14.1", "date": "2026-12-04"}]
    assert measured_line(rows) == (f"Measured with {h200}; measured 2026-12-03 to 2026-12-05; "
                                   "and CPU; torch 2.14.1; measured 2026-12-04.")
    assert measured_line(rows[:1]) == f"Measured with {h200}; measured 2026-12-03."


def test_a_first_cell_stopped_before_any_record_keeps_its_own_error(tmp_path):
    """Ctrl-C (or a refused folder) in the first cell, before any stage wrote a record: the error that
    stopped it comes out, not 'holds no matrix cells' from rendering an empty table."""
    def stop(*args, **kwargs):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        matrix.run_matrix(models=[TINY_MODEL], out_dir=tmp_path / "m", device="cpu", run_apply=stop, progress=False)


@pytest.mark.parametrize("name, text", [("matrix.md", "my notes on the matrix\n"), ("matrix.json", '{"mine": 1}\n')])
def test_render_only_never_replaces_a_file_it_did_not_write(tmp_path, name, text):
    from cli import app

    write_cell(tmp_path, "t-train-b8", cell_records())
    (tmp_path / name).write_text(text)
    res = CliRunner().invoke(app, ["matrix", "--render-only", str(tmp_path)])
    assert res.exit_code == 2 and "is not a table swinbench matrix wrote" in res.output
    assert len(res.output.strip().splitlines()) == 1
    assert (tmp_path / name).read_text() == text
    assert sorted(p.name for p in tmp_path.glob("matrix.*")) == [name]   # nothing written beside it
    (tmp_path / name).unlink()
    md, js = write_matrix(tmp_path, matrix.FAMILY, "cmd")
    assert write_matrix(tmp_path, matrix.FAMILY, "cmd") == (md, js)   # its own tables it renders again


def test_resume_with_nothing_to_resume_says_so_and_starts(tmp_path):
    console = Console(record=True, width=200)
    fake = FakeApply()
    matrix.run_matrix(models=[TINY_MODEL], modes=["infer1"], out_dir=tmp_path / "m", device="cpu", run_apply=fake,
                      progress=False, resume=True, console=console)
    text = console.export_text()
    assert "--resume: " in text and "holds no earlier matrix; starting a new one there" in text
    assert len(fake.calls) == 1
