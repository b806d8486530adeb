"""The parity verdicts of `swinbench train --compare` runs found on disk, for other reports to cite.

`apply`'s report flags a stage whose recipe failed the parity rule in a comparison it can find: the
committed comparisons under the source tree's `reports/` and the user's own under `./reports/`. A
verdict is read from a comparison's records alone (workbench.results.train_runs.compare_runs), so it is the
one that comparison's report.md shows."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from workbench import SOURCE_ROOT

TRAIN_SCHEMA_PREFIX = "swinbench.train/"


@dataclass(frozen=True)
class TrainingVerdict:
    recipe: str
    reference: str          # the recipe it was held against ('baseline': fp32)
    model: str
    steps: int | None
    seeds: int              # the recipe's finished seeds the verdict averages
    passed: bool
    detail: str             # the rule's words: 'converges like the baseline' / 'differs: ...' / 'not decided: ...'
    source: Path            # the comparison's folder
    decided: bool = True    # False: the accuracy missed the rule by less than the comparison's noise
    device: str | None = None   # what trained: 'NVIDIA H200', 'CPU' (the runs' env)

    def where(self) -> str:
        """The comparison's folder as the user would type it: under the source tree or here, relative."""
        for root in (Path.cwd(), SOURCE_ROOT):
            try:
                return str(self.source.resolve().relative_to(root.resolve()))
            except ValueError:
                continue
        return str(self.source)


def default_roots() -> list[Path]:
    """Where comparisons are looked for: ./reports, then the source tree's reports/ (once if the same)."""
    roots = []
    for root in (Path.cwd() / "reports", SOURCE_ROOT / "reports"):
        if root.is_dir() and all(root.resolve() != r.resolve() for r in roots):
            roots.append(root)
    return roots


def _is_train_records(folder: Path) -> bool:
    first = next(iter(sorted(folder.glob("*.jsonl"))), None)
    if first is None:
        return False
    try:
        with open(first, encoding="utf-8") as fh:
            header = json.loads(fh.readline())
    except (OSError, ValueError):
        return False
    return (isinstance(header, dict) and header.get("kind") == "run"
            and str(header.get("schema", "")).startswith(TRAIN_SCHEMA_PREFIX))


def find_verdicts(roots: list[Path] | None = None) -> list[TrainingVerdict]:
    """Every parity verdict of every comparison (a `records/` folder of train records) under `roots`
    (default_roots()). Folders that cannot be read are passed over: a report citing verdicts must not
    fail on an unrelated broken run; so are runs that --overwrite moved aside (`*.previous-*`)."""
    from workbench.results.record import Env
    from workbench.results.train_runs import compare_runs, read_runs

    out = []
    for root in (default_roots() if roots is None else roots):
        for folder in sorted(Path(root).glob("**/records")):
            if not folder.is_dir() or not _is_train_records(folder):
                continue
            if any(".previous-" in part for part in folder.relative_to(root).parts):
                continue        # a run that --overwrite moved aside: replaced, not cited
            try:
                runs = read_runs(folder)
                comparison = compare_runs(runs)
            except Exception:   # any damage in an unrelated run's files: passed over, never a traceback here
                continue
            for recipe, p in comparison.parity.items():
                group = [r for r in runs if r.recipe == recipe and r.status in ("ok", "diverged")]
                header = group[0].header if group else runs[0].header
                env = header.get("env") if isinstance(header.get("env"), dict) else {}
                device = Env(env["device_type"], gpu=env.get("gpu")).device_name if env.get("device_type") else None
                out.append(TrainingVerdict(recipe, comparison.reference, str(header.get("model")),
                                           header.get("steps"), len(group), p.passed, p.verdict, folder.parent,
                                           p.decided, device))
    return out


def verdict_line(v: TrainingVerdict) -> str:
    """One Markdown bullet: the recipe, pass or fail, against what, where, and the rule's figures."""
    against = "the fp32 baseline" if v.reference == "baseline" else f"`{v.reference}`"
    seeds = f"{v.seeds} seed{'s' if v.seeds != 1 else ''}"
    head = ("trains like" if v.passed else "**fails parity** with" if v.decided else "is **not decided** against")
    detail = "" if v.passed else ": " + v.detail.split(": ", 1)[-1]
    on = f", on {v.device}" if v.device else ""
    return (f"**{v.recipe}** {head} {against} in `{v.where()}` ({v.model}, {v.steps} steps, {seeds}{on})"
            f"{detail}")
