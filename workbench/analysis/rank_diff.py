"""`swinbench diff BEFORE AFTER` on multi-rank captures (`profile --nproc N`: `rank<r>/` folders).

`diff_plan` says what is compared:

- two traces: compared as before (`diff.diff_analyses`);
- two rank folders with the same ranks: rank by rank (`diff_ranks`): every rank's row of `ranks.rank_row`
  on both sides (step ms, kernel ms, communication ms and its exposed part per step, busy %) and the
  change, then the kernel-by-kernel diff of one rank: the slowest after the change (the longest median
  step), or the one `--rank` names. A DDP step waits for its slowest rank, and a faster rank's NCCL
  kernels include the time it waits for that rank, so a mean over the ranks would fold that wait into
  the communication rows; the slowest rank's kernels are the ones the step is made of;
- a rank folder and a single trace, or two rank folders of different world sizes: only with `--rank R`,
  which compares rank R of each folder (and a single trace as it is) as two traces, with a note.
  Without it `diff_plan` refuses in one line (UserError, exit 2): comparing rank by rank needs the
  same ranks on both sides, and which rank stands for a run of another size is the user's choice.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.table import Table

from workbench.analysis.analyze import TableFiles, analyze_trace, trace_origin
from workbench.analysis.diff import TraceDiff, diff_analyses, render_diff
from workbench.analysis.ranks import RankSummary, rank_frame, rank_row, rank_summary, rank_traces
from workbench.errors import UserError

# the ranks table's figures a rank diff compares, in the order shown
RANK_METRICS = ["step_ms", "kernel_ms", "comm_ms", "exposed_ms", "busy_pct"]
RANK_DIFF_COLUMNS = ["rank", "metric", "before", "after", "delta"]


@dataclass
class DiffPlan:
    """What `diff` compares. ranks: [(rank, before trace, after trace)] for a rank-by-rank diff, else None
    and before_trace / after_trace are the two traces (a rank's trace where `--rank` picked one).
    rank: the rank `--rank` asked for. notes: what the plan chose, for the output."""

    before_trace: Path | None = None
    after_trace: Path | None = None
    ranks: list[tuple[int, Path, Path]] | None = None
    rank: int | None = None
    notes: list[str] = field(default_factory=list)


def _side(path: Path, label: str) -> list[tuple[int, Path]] | None:
    """A rank folder's (rank, trace) pairs, or None for a trace file; UserError for a folder without ranks."""
    try:
        is_dir = Path(path).is_dir()
    except OSError:   # a path the system cannot look up is not a folder: the trace loader says why
        is_dir = False
    if not is_dir:
        return None
    ranks = rank_traces(path)
    if not ranks:
        raise UserError(f"{label} {path} is a folder without rank0/, rank1/, ... traces: give a trace file, or the "
                        "folder `swinbench profile --nproc` wrote")
    return ranks


def _names(ranks: list[tuple[int, Path]]) -> str:
    numbers = [r for r, _ in ranks]
    return f"{len(numbers)} rank{'s' if len(numbers) != 1 else ''} ({', '.join(map(str, numbers))})"


def _pick(ranks: list[tuple[int, Path]], rank: int, label: str, path: Path) -> Path:
    found = dict(ranks).get(rank)
    if found is None:
        raise UserError(f"--rank {rank}: {label} {path} holds {_names(ranks)}")
    return found


def diff_plan(before: Path, after: Path, rank: int | None = None) -> DiffPlan:
    """What `diff BEFORE AFTER [--rank R]` compares (see the module doc); UserError (one line) when the two
    sides cannot be compared as given."""
    if rank is not None and rank < 0:
        raise UserError(f"--rank must be 0 or more, got {rank}")
    b, a = _side(before, "BEFORE"), _side(after, "AFTER")
    if b is None and a is None:
        if rank is not None:
            raise UserError("--rank picks a rank of a folder that `swinbench profile --nproc` wrote; both sides "
                            "are single traces")
        return DiffPlan(before, after)
    if b is not None and a is not None and [r for r, _ in b] == [r for r, _ in a]:
        if rank is not None:
            _pick(b, rank, "BEFORE", before)
        return DiffPlan(ranks=[(r, tb, ta) for (r, tb), (_, ta) in zip(b, a)], rank=rank)
    if rank is None:
        if b is not None and a is not None:
            raise UserError(f"BEFORE holds {_names(b)} and AFTER {_names(a)}: diff compares rank by rank, so both "
                            "need the same ranks; --rank R compares rank R of each")
        folder, one = ("BEFORE", "AFTER") if b is not None else ("AFTER", "BEFORE")
        raise UserError(f"{folder} is a folder of {_names(b or a)} and {one} a single trace: --rank R compares the "
                        f"trace with rank R of {folder} (e.g. --rank 0)")
    plan = DiffPlan(_pick(b, rank, "BEFORE", before) if b is not None else before,
                    _pick(a, rank, "AFTER", after) if a is not None else after, rank=rank)
    if b is not None and a is not None:
        plan.notes.append(f"rank {rank} of each: BEFORE holds {_names(b)}, AFTER {_names(a)}; with another world "
                          "size a rank's communication differs")
    else:
        plan.notes.append(f"the single trace against rank {rank} of the "
                          f"{'BEFORE' if b is not None else 'AFTER'} folder of {_names(b or a)}: a data-parallel "
                          "rank also spends time on communication that one process does not")
    return plan


@dataclass
class RankDiff:
    """ranks: RANK_DIFF_COLUMNS, one row per rank and RANK_METRICS metric (per step, busy in %), ranks in
    order. summaries: rank_summary of each side. rank: the rank `kernels` compares, and chosen: why that
    one ('slowest after', 'asked', or 'first' when the traces have no step ranges). cpu: CPU captures
    (figures of CPU operators)."""

    before: str
    after: str
    ranks: pd.DataFrame
    summaries: tuple[RankSummary, RankSummary]
    rank: int
    chosen: str
    kernels: TraceDiff
    cpu: bool = False
    notes: list[str] = field(default_factory=list)


def rank_diff_frame(before: pd.DataFrame, after: pd.DataFrame) -> pd.DataFrame:
    """Two ranks tables (ranks.rank_frame, the same ranks) -> RANK_DIFF_COLUMNS, rank by rank."""
    rows = []
    for (_, b), (_, a) in zip(before.iterrows(), after.iterrows()):   # one iteration per rank
        for metric in RANK_METRICS:
            rows.append((int(b["rank"]), metric, float(b[metric]), float(a[metric]), float(a[metric] - b[metric])))
    return pd.DataFrame(rows, columns=RANK_DIFF_COLUMNS)


def diff_ranks(plan: DiffPlan, before_label: str, after_label: str, *, name_style: str = "short",
               range_name: str | None = None, on_rank=None) -> RankDiff:
    """Every rank of `plan.ranks` analyzed on both sides (each trace parsed once; only the tables are kept),
    the ranks table of each side compared rank by rank, and one rank's kernels (see the module doc).
    on_rank(i, n, rank) hears that the i-th of n ranks is being read."""
    rows_b, rows_a, kept, cpu = [], [], {}, False
    for i, (rank, trace_b, trace_a) in enumerate(plan.ranks):
        if on_rank is not None:
            on_rank(i, len(plan.ranks), rank)
        pair = []
        for trace, rows in ((trace_b, rows_b), (trace_a, rows_a)):
            analysis = analyze_trace(trace, name_style=name_style, range_name=range_name)
            rows.append(rank_row(rank, analysis.trace))
            cpu = cpu or analysis.trace_meta.get("device") == "cpu"
            analysis.trace = None   # the diff reads the tables only
            pair.append(analysis)
        kept[rank] = pair
    before, after = rank_frame(rows_b), rank_frame(rows_a)
    summaries = rank_summary(before), rank_summary(after)
    notes = []
    if plan.rank is not None:
        rank, chosen = plan.rank, "asked"
    elif summaries[1].slowest is not None:
        rank, chosen = summaries[1].slowest, "slowest after"
    else:
        rank, chosen = plan.ranks[0][0], "first"
        notes.append(f"no step ranges after the change, so no slowest rank: rank {rank}'s kernels are compared")
    if range_name is not None:
        notes.append(f"the ranks table covers whole steps; --range {range_name} scopes the kernel tables")
    kernels = diff_analyses(*kept[rank], f"{before_label} rank {rank}", f"{after_label} rank {rank}")
    return RankDiff(before_label, after_label, rank_diff_frame(before, after), summaries, rank, chosen, kernels,
                    cpu, notes)


def _num(x: float, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.1f}" if pct else f"{x:.3f}"


def _change(b: float, a: float, pct: bool) -> str:
    """'before → after (delta)' in one cell; the delta of a percentage is in points."""
    if not all(isinstance(v, float) and math.isfinite(v) for v in (b, a)):
        return f"{_num(b, pct)} → {_num(a, pct)}"
    delta = f"{a - b:+.1f}" if pct else f"{a - b:+.3f}"
    return f"{_num(b, pct)} → {_num(a, pct)} ({delta}{' pp' if pct else ''})"


def _summary_change(b: RankSummary, a: RankSummary, cpu: bool = False) -> str:
    """The slowest rank, the skew and communication's share, before → after, in one line."""
    def slowest(s: RankSummary) -> str:
        return "-" if s.slowest is None else f"rank {s.slowest} (skew {s.skew_pct:.1f}%)"

    def share(s: RankSummary) -> str:
        return "-" if s.comm_share_pct is None else f"{s.comm_share_pct:.1f}%"

    return (f"slowest {slowest(b)} → {slowest(a)}; communication {share(b)} → {share(a)} of the "
            f"{'CPU operator' if cpu else 'kernel'} time, all ranks")


def render_rank_diff(diff: RankDiff, console: Console, top: int = 15) -> None:
    """The per-rank table (before → after, change), the summary line, which rank the kernel tables are of and
    why, then that rank's diff (diff.render_diff)."""
    unit = "op" if diff.cpu else "kernel"
    heads = {"step_ms": "step ms (median)", "kernel_ms": f"{unit} ms/step", "comm_ms": "comm ms/step",
             "exposed_ms": "exposed comm ms/step", "busy_pct": f"{'CPU' if diff.cpu else 'GPU'} busy %"}
    console.print(f"[bold]before[/] {diff.before}\n[bold]after[/]  {diff.after}\n"
                  f"{diff.summaries[0].ranks} ranks, compared rank by rank: "
                  "before → after (change)")
    t = Table(title="Ranks (per step)", title_justify="left")
    t.add_column("rank", justify="right")
    for metric in RANK_METRICS:
        t.add_column(heads[metric], justify="right")
    for rank, group in diff.ranks.groupby("rank", sort=True):   # one row per rank
        cells = {r.metric: _change(r.before, r.after, r.metric.endswith("pct")) for r in group.itertuples()}
        t.add_row(str(rank), *(cells[m] for m in RANK_METRICS))
    console.print(t)
    console.print(_summary_change(*diff.summaries, cpu=diff.cpu), highlight=False)
    why = {"slowest after": "the slowest rank after the change (longest median step): a DDP step waits for it, and "
                            "a faster rank's communication includes its wait for that rank",
           "asked": "chosen with --rank",
           "first": "the first rank (no step ranges to find the slowest)"}[diff.chosen]
    console.print(f"[bold]Kernel tables: rank {diff.rank}[/], {why}; --rank R shows another.", highlight=False)
    for note in diff.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    render_diff(diff.kernels, console, top=top)


RANK_DIFF_TABLES = ["ranks", "kernels", "categories", "summary"]


def rank_diff_tables(out_dir, fmt: str, before, after, range_name: str | None) -> TableFiles:
    """Where write_rank_diff puts the tables of rank folder `before` against `after` in out_dir; `.check()`
    it before analyzing, so a refusal comes before the work."""
    origin = {"before_trace": trace_origin(before, out_dir), "after_trace": trace_origin(after, out_dir),
              "trace_range": range_name}
    return TableFiles(Path(out_dir), fmt, RANK_DIFF_TABLES, origin, csv_prefix="diff_", json_stem="diff")


def write_rank_diff(diff: RankDiff, out_dir, fmt: str = "csv", *, range_name: str | None = None,
                    overwrite: bool = False, on_note=None) -> list[Path]:
    """diff_ranks / diff_kernels / diff_categories / diff_summary as csv (the last three of one rank, with a
    leading `rank` column), or one diff.json with all four, the rank and the two sides' rank summaries.
    Tables of other traces are not replaced without `overwrite` (analyze.TableFiles)."""
    k = diff.kernels

    def of_rank(frame: pd.DataFrame) -> pd.DataFrame:
        return frame.assign(rank=diff.rank)[["rank", *frame.columns]]

    frames = {"ranks": diff.ranks, "kernels": of_rank(k.kernels), "categories": of_rank(k.categories),
              "summary": of_rank(k.summary)}
    meta = {"before": diff.before, "after": diff.after, "unit": k.unit, "steps": list(k.steps), "rank": diff.rank,
            "rank_chosen": diff.chosen, "rank_summary": {"before": asdict(diff.summaries[0]),
                                                         "after": asdict(diff.summaries[1])},
            "notes": diff.notes + k.notes, "warnings": k.warnings, "devices": k.devices}
    tables = rank_diff_tables(out_dir, fmt, diff.before, diff.after, range_name)
    return tables.write(frames, meta, overwrite=overwrite, on_note=on_note)
