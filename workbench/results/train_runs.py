"""A `swinbench train` run's record files, parsed (`read_runs`), and each recipe's parity with the reference
(`compare_runs`): what the train report renders and what other reports cite (results.verdicts). Pure
functions over the records: no model, no GPU."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from workbench.errors import UserError
from workbench.results.parity import BaselineSpread, Parity, baseline_spread, parity


@dataclass
class RunRecords:
    """One run's record file, parsed: its header ('run'), step and epoch records, and its 'end' (None while
    it trains or when it was cut short)."""

    path: Path
    header: dict
    steps: list[dict]
    epochs: list[dict]
    end: dict | None

    @property
    def recipe(self) -> str:
        return self.header.get("recipe", "?")

    @property
    def seed(self) -> int:
        return self.header.get("seed", 0)

    @property
    def status(self) -> str:
        return (self.end or {}).get("status", "unfinished")

    @property
    def losses(self) -> list[float]:
        return [math.nan if s.get("loss") is None else s["loss"] for s in self.steps]

    @property
    def grad_norms(self) -> list[float] | None:
        """The gradient norm before clipping of every step, or None when the run did not record it (no
        clipping, or records older than the field)."""
        if not self.steps or "grad_norm" not in self.steps[0]:
            return None
        return [math.nan if s.get("grad_norm") is None else s["grad_norm"] for s in self.steps]

    @property
    def final_accuracy(self) -> float | None:
        return self.epochs[-1]["val_acc"] if self.epochs else None

    @property
    def final_accuracy_ema(self) -> float | None:
        """The last validation accuracy of the run's EMA of the weights (train --ema), or None."""
        return self.epochs[-1].get("val_acc_ema") if self.epochs else None

    @property
    def img_per_s(self) -> float | None:
        return (self.end or {}).get("img_per_s")


def read_runs(records_dir: Path, skip=()) -> list[RunRecords]:
    """Every `*.jsonl` record file in records_dir (but those in `skip`), in file-name order. A line cut
    short by a killed run is skipped; a file without a run header, or a record whose fields are not as
    the train records write them, is a UserError naming the file and line."""
    records_dir = Path(records_dir)
    if not records_dir.is_dir():
        raise UserError(f"no records folder {records_dir}")
    runs = []
    skipped = {Path(p) for p in skip}
    for path in sorted(records_dir.glob("*.jsonl")):
        if path in skipped:
            continue
        lines = []
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read {path}: {exc}") from None
        for n, line in enumerate(text.splitlines(), 1):
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                continue
            if not isinstance(rec, dict):
                raise UserError(f"{path} line {n}: not a train record (a JSON object)")
            why = _bad_field(rec)
            if why:
                raise UserError(f"{path} line {n}: {why}")
            lines.append(rec)
        if not lines or lines[0].get("kind") != "run":
            raise UserError(f"{path} is not a swinbench train record file (no run header)")
        kinds = {"step": [], "epoch": [], "end": []}
        for rec in lines[1:]:
            kinds.get(rec.get("kind"), []).append(rec)
        runs.append(RunRecords(path, lines[0], kinds["step"], kinds["epoch"], (kinds["end"] or [None])[-1]))
    return runs


# The fields each kind of record must hold, and what they may be: a number, or null where a run diverged
_NUMBER = (int, float)
_FIELDS = {"step": {"step": (int,), "loss": _NUMBER + (type(None),), "grad_norm": _NUMBER + (type(None),)},
           "epoch": {"step": (int,), "val_acc": _NUMBER + (type(None),), "val_loss": _NUMBER + (type(None),),
                     "val_acc_ema": _NUMBER + (type(None),)},
           "end": {"status": (str,), "img_per_s": _NUMBER + (type(None),)},
           "run": {"recipe": (str,), "seed": (int,)}}
_REQUIRED = {"step": ("step",), "epoch": ("step", "val_acc"), "end": ("status",), "run": ("recipe", "seed")}


def _bad_field(rec: dict) -> str | None:
    """Why a record's fields are not what the readers take (None: they are)."""
    kind = rec.get("kind")
    fields = _FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        return None
    missing = [k for k in _REQUIRED[kind] if k not in rec]
    if missing:
        return f"a {kind} record without {missing[0]!r}"
    for key, types in fields.items():
        if key in rec and (not isinstance(rec[key], types) or isinstance(rec[key], bool)):
            return f"a {kind} record whose {key!r} is {type(rec[key]).__name__}, not a number" \
                if _NUMBER[0] in types else f"a {kind} record whose {key!r} is {type(rec[key]).__name__}"
    return None


@dataclass
class Comparison:
    """The reference's spread (None without two of its finished seeds) and each other recipe's parity: the
    mean of its seeds' loss curves and final accuracies held against the reference."""

    reference: str                          # the recipe name parity is measured against
    spread: BaselineSpread | None
    baseline: list[RunRecords]              # the reference's finished seeds
    parity: dict[str, Parity]               # by recipe name


def reference_of(runs: list[RunRecords]) -> str:
    """The recipe the runs were compared against (their headers say; records before --reference: baseline)."""
    return runs[0].header.get("reference") or "baseline" if runs else "baseline"


def reference_label(reference: str) -> str:
    return "the baseline" if reference == "baseline" else f"`{reference}`"


def _mean_curve(curves: list[list[float]]) -> list[float]:
    n = min(len(c) for c in curves)
    return [sum(c[i] for c in curves) / len(curves) for i in range(n)]


def compare_runs(runs: list[RunRecords]) -> Comparison:
    reference = reference_of(runs)
    base = [r for r in runs if r.recipe == reference and r.status == "ok"]
    spread = None
    if len(base) >= 2:
        try:
            spread = baseline_spread([r.losses for r in base], [r.final_accuracy for r in base])
        except ValueError:
            spread = None
    out = {}
    if spread is not None:
        for recipe in dict.fromkeys(r.recipe for r in runs if r.recipe != reference):
            group = [r for r in runs if r.recipe == recipe and r.status in ("ok", "diverged")]
            if not group:
                continue
            accuracies = [r.final_accuracy for r in group]
            accuracy = (None if any(a is None for a in accuracies) or any(r.status != "ok" for r in group)
                        else sum(accuracies) / len(accuracies))
            out[recipe] = parity(_mean_curve([r.losses for r in group]), accuracy, spread, [b.losses for b in base],
                                 seeds=len(group))
    return Comparison(reference, spread, base, out)
