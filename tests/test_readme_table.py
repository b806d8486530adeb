"""The README's results table: rendered from the committed canonical records, written between its
markers and nowhere else, and equal to what the records give today (so the two cannot drift)."""
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import app
from workbench.errors import UserError
from workbench.results.readme_table import BEGIN, END, render_for_readme, replace_between_markers, short_model, table_block

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SAMPLE = Path(__file__).parent / "data" / "records" / "baseline"
runner = CliRunner()


def rendering_command(block: str) -> list[str]:
    """The `swinbench report ... --readme README.md` command the block says rendered it."""
    line = next(ln for ln in block.splitlines() if ln.startswith("Rendered by `"))
    return shlex.split(line.split("`")[1])


def test_readme_table_is_what_the_committed_records_render():
    block = table_block(README.read_text(encoding="utf-8"))
    argv = rendering_command(block)
    assert argv[:2] == ["swinbench", "report"] and argv[-2:] == ["--readme", "README.md"], argv
    paths = [ROOT / p for p in argv[2:-2]]
    assert paths and all(p.is_dir() and p.relative_to(ROOT).parts[0] == "reports" for p in paths), paths
    assert render_for_readme(paths, README) == block, (
        "README.md's results table differs from its records: run " + " ".join(argv))


def test_every_canonical_folder_in_reports_readme_exists_and_is_in_the_table():
    listed = [line.split("`")[1] for line in (ROOT / "reports" / "README.md").read_text().splitlines()
              if line.startswith("| `") and line.split("`")[1].endswith("/")]
    assert listed
    block = table_block(README.read_text(encoding="utf-8"))
    readme = README.read_text(encoding="utf-8")
    for folder in listed:
        records = ROOT / "reports" / folder / "records"
        if any(records.glob("*.json")):           # stage records: in the results table
            assert f"reports/{folder}records" in block, folder
        elif any(records.glob("*.jsonl")):        # a training comparison: its report is linked
            assert f"reports/{folder}report.md" in readme, folder
        elif (ROOT / "reports" / folder / "matrix.json").exists():   # the family matrix: cells, and its README block
            assert list((ROOT / "reports" / folder).glob("*/records/*.json")), folder
            assert f"reports/{folder.rstrip('/')}" in readme, folder
        else:                                     # profiles: one folder per recipe, each with its findings
            profiled = list((ROOT / "reports" / folder).glob("*/findings.csv"))
            assert profiled, f"reports/{folder} holds neither records nor profiles"
            assert f"reports/{folder.rstrip('/')}" in readme, folder


def readme_with_markers(tmp_path, inside="old table"):
    path = tmp_path / "README.md"
    path.write_text(f"# title\n\nbefore\n{BEGIN}\n{inside}\n{END}\nafter ü\n", encoding="utf-8")
    return path


def test_cli_rewrites_only_the_text_between_the_markers(tmp_path):
    path = readme_with_markers(tmp_path)
    result = runner.invoke(app, ["report", str(SAMPLE), "--readme", str(path)])
    assert result.exit_code == 0, result.output
    text = path.read_text(encoding="utf-8")
    assert text.startswith(f"# title\n\nbefore\n{BEGIN}\n| run | stage |")
    assert text.endswith(f"do not edit by hand.\n{END}\nafter ü\n")
    assert "old table" not in text and "| fmha | bf16 | 58.37 ± 0.37 | 2.39x | 1.22x | - | - | - | - | PASS |" in text
    assert not list(SAMPLE.parent.glob("*.md")) and not (SAMPLE / "report.md").exists()
    again = runner.invoke(app, ["report", str(SAMPLE), "--readme", str(path)])
    assert again.exit_code == 0 and path.read_text(encoding="utf-8") == text


def test_the_table_labels_a_cpu_run(tmp_path):
    import json
    import shutil

    run = tmp_path / "cpu"
    shutil.copytree(SAMPLE, run)
    for f in run.glob("*.json"):
        rec = json.loads(f.read_text())
        rec["env"] = {"device_type": "cpu", "gpu": None, "torch": "2.14", "triton": "3.8.0",
                      "date": "2026-01-02T00:00:00+00:00"}
        rec["model"] = "swinbench_tiny_cpu"
        f.write_text(json.dumps(rec))
    block = render_for_readme([run], readme_with_markers(tmp_path))
    assert "| tiny CPU Swin, training, batch 64, CPU | baseline |" in block
    assert "CPU, not a GPU speed figure" in block and "records `cpu`" in block


@pytest.mark.parametrize("text", ["no markers", f"{BEGIN}\n{BEGIN}\n{END}", f"{END}\n{BEGIN}"])
def test_bad_markers_are_one_line_errors(tmp_path, text):
    with pytest.raises(UserError):
        replace_between_markers(text, "table")
    path = tmp_path / "README.md"
    path.write_text(text)
    result = runner.invoke(app, ["report", str(SAMPLE), "--readme", str(path)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert path.read_text() == text


def test_short_model_names():
    assert short_model("swin_base_patch4_window7_224") == "Swin-B 224"
    assert short_model("swin_large_patch4_window12_384") == "Swin-L 384 (window 12)"
    assert short_model("swinbench_tiny_cpu") == "tiny CPU Swin"
    assert short_model("swinv2_tiny_window8_256") == "SwinV2-T 256 (window 8)"
    assert short_model("swinv2_base_window12to24_192to384") == "SwinV2-B 384 (window 24)"
    assert short_model("swinv2_cr_tiny_ns_224") == "SwinV2-CR-T 224 ns"
    assert short_model("swinv2_cr_giant_384") == "SwinV2-CR-G 384"


def test_a_run_at_another_resolution_says_so_in_its_label():
    from record_helpers import record
    from workbench.results.readme_table import run_label
    from workbench.results.record import as_records

    (rec,) = as_records([dict(record(0, "baseline", None, 100.0, gate="REFERENCE", precision="fp32"),
                              img_size=[384, 384])])
    assert run_label(rec) == "Swin-T 224 at 384x384, training, batch 64, H200"


def test_readme_through_a_symlink_rewrites_the_file_it_points_to(tmp_path):
    real = tmp_path / "README.md"
    real.write_text(f"x\n{BEGIN}\nstale table\n{END}\n")
    (tmp_path / "docs").mkdir()
    link = tmp_path / "docs" / "README.md"
    link.symlink_to("../README.md")
    res = CliRunner().invoke(app, ["report", str(SAMPLE), "--readme", str(link)])
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and "stale table" not in real.read_text()   # the link kept, its target rewritten
    assert "| run | stage |" in link.read_text()
