"""Every command line of README.md that runs on a CPU runs as written, in a clone of the committed tree,
and leaves that tree as it was: no tracked file changed, nothing untracked written into it.

The convention README.md follows: the commands are the lines inside fenced code blocks that start with
`swinbench `; a line ending in the comment `# needs a GPU` is skipped; a runnable line holds no
`<placeholder>`. A command whose default output folder is inside the tree writes into an ignored folder
(profiles/, reports/runs/) or is given an --out that is. Each command runs as `python cli.py ...` in the
clone, with the clone on PYTHONPATH (nothing is installed)."""
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPU_MARK = "# needs a GPU"
PLACEHOLDER = re.compile(r"<[^<>\s]+>")


def readme_commands(text: str) -> list[str]:
    """The lines inside fenced code blocks that start with `swinbench `, stripped, in order."""
    commands, fence = [], None
    for line in text.splitlines():
        stripped = line.strip()
        marker = stripped[:3]
        if marker in ("```", "~~~") and (fence is None or marker == fence):
            fence = None if fence else marker
            continue
        if fence and stripped.startswith("swinbench "):
            commands.append(stripped)
    return commands


def runnable(commands: list[str]) -> list[str]:
    return [c for c in commands if not c.endswith(GPU_MARK)]


def test_the_convention_picks_fenced_swinbench_lines_and_skips_gpu_ones():
    text = "\n".join([
        "    swinbench indented --not-fenced",
        "```bash",
        "swinbench env   # a comment",
        "pip install -e . && swinbench profile",
        "  swinbench apply --device cpu",
        "swinbench apply --batch 64   # needs a GPU",
        "```",
        "swinbench outside --fence",
        "~~~",
        "swinbench recipes",
        "~~~",
    ])
    assert readme_commands(text) == ["swinbench env   # a comment", "swinbench apply --device cpu",
                                     "swinbench apply --batch 64   # needs a GPU", "swinbench recipes"]
    assert runnable(readme_commands(text)) == ["swinbench env   # a comment", "swinbench apply --device cpu",
                                               "swinbench recipes"]


def test_runnable_readme_lines_hold_no_placeholders():
    commands = runnable(readme_commands((ROOT / "README.md").read_text()))
    assert commands, "README.md has no runnable `swinbench ...` line in a fenced code block"
    bad = [c for c in commands if PLACEHOLDER.search(c)]
    assert not bad, f"placeholders in runnable README lines (give a real path, or end the line with '{GPU_MARK}'): {bad}"


def _git(clone: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=clone, check=True, capture_output=True, text=True).stdout


@pytest.mark.slow
def test_readme_commands_run_on_a_cpu_and_leave_the_tree_clean(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, capture_output=True)
    commands = runnable(readme_commands((clone / "README.md").read_text()))
    assert commands and not any(PLACEHOLDER.search(c) for c in commands)
    # as a user runs them: without the test session's Triton interpreter (conftest sets it on a CPU)
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
           "PYTHONPATH": str(clone), "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "120"}
    for command in commands:
        args = shlex.split(command, comments=True)[1:]
        proc = subprocess.run([sys.executable, "cli.py", *args], cwd=clone, env=env, capture_output=True,
                              text=True, timeout=600)
        allowed = (0, 1) if args[0] == "check" else (0,)   # check exits 1 when it finds a regression
        assert proc.returncode in allowed and "Traceback" not in proc.stderr, (
            f"{command!r} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        status = _git(clone, "status", "--porcelain", "--untracked-files=all")
        assert status == "", f"{command!r} changed the tree (point its output at an ignored folder):\n{status}"
