"""Several ranks' traces of one data-parallel run, read together: what each rank spends per step, how
much of its communication hides behind its compute, and how far the ranks drift apart.

One row per rank (`rank_row`, gathered by `rank_frame`):

- steps: the `step<i>` ranges of the capture (the ranks' steps are the same steps: a step waits for the
  all-reduce);
- step_ms: the median wall time of those ranges on the rank's host thread (under a profiler: indicative;
  `apply --nproc` gives the clean figures);
- kernel_ms: the rank's kernel time per step (GPU kernels, or on a CPU-only trace its operators' self time);
- busy_pct: the union of its kernel intervals over the captured span;
- comm_ms: its communication kernels' time per step (the `communication` category: NCCL kernels, gloo /
  c10d collectives);
- overlap_pct: the share of the communication's wall time (the union of its intervals) during which a
  compute kernel of the same rank runs too, the rest being exposed_ms per step: time the step waits on
  the network with nothing else to do. Communication and compute are told apart by category, so a
  kernel is in exactly one of the two and no time is counted twice.

`rank_summary` adds the slowest rank and the skew: (slowest - fastest) / median of the ranks' step_ms.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from workbench.analysis.categories import categorize
from workbench.analysis.frames import STEP_RANGE, _union_ns
from workbench.errors import UserError

COMM = "communication"
RANK_FOLDER = re.compile(r"^rank(\d+)$")
TRACE_NAMES = ("trace.sqlite", "trace.sqlite.xz", "trace.nsys-rep", "trace.json")
COLUMNS = ["rank", "steps", "step_ms", "kernel_ms", "busy_pct", "comm_ms", "overlap_pct", "exposed_ms"]


def rank_traces(folder: Path) -> list[tuple[int, Path]]:
    """(rank, trace) for each `rank<r>/` folder under `folder` that holds a trace (`profile --nproc`'s
    layout), in rank order; [] when `folder` holds none."""
    out = []
    for sub in sorted(Path(folder).iterdir()) if Path(folder).is_dir() else []:
        m = RANK_FOLDER.match(sub.name)
        if not (m and sub.is_dir()):
            continue
        trace = next((sub / n for n in TRACE_NAMES if (sub / n).exists()), None)
        if trace is not None:
            out.append((int(m.group(1)), trace))
    return sorted(out)


def _merged(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of [start, end) intervals as disjoint sorted intervals."""
    if len(start) == 0:
        return start, end
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    run_end = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    return s[idx], np.append(run_end[idx[1:] - 1], run_end[-1])


def _intersection_ns(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> int:
    """Length of the intersection of two disjoint sorted interval sets (_merged's output)."""
    (as_, ae), (bs, be) = a, b
    i = j = total = 0
    while i < len(as_) and j < len(bs):
        lo, hi = max(as_[i], bs[j]), min(ae[i], be[j])
        if hi > lo:
            total += int(hi - lo)
        if ae[i] < be[j]:
            i += 1
        else:
            j += 1
    return total


def _length(m: tuple[np.ndarray, np.ndarray]) -> int:
    return int((m[1] - m[0]).sum())


def rank_row(rank: int, trace) -> dict:
    """One rank's row of the table from its parsed Trace (workbench.trace.load_trace)."""
    kernels, ranges = trace.kernels, trace.ranges
    steps = ranges[ranges["name"].str.match(STEP_RANGE)] if len(ranges) else ranges
    n = len(steps)
    per = max(n, 1)
    cats = categorize(kernels["name"]) if len(kernels) else pd.Series([], dtype=object)
    is_comm = (cats == COMM).to_numpy()
    start, end = kernels["start_ns"].to_numpy("int64"), kernels["end_ns"].to_numpy("int64")
    comm = _merged(start[is_comm], end[is_comm])
    compute = _merged(start[~is_comm], end[~is_comm])
    span = int(end.max() - start.min()) if len(start) else 0
    comm_wall = _length(comm)
    overlap = _intersection_ns(comm, compute)
    durations = (steps["end_ns"] - steps["start_ns"]).to_numpy("int64") if n else np.array([], dtype="int64")
    return {"rank": rank, "steps": n,
            "step_ms": float(np.median(durations)) / 1e6 if n else float("nan"),
            "kernel_ms": float(kernels["duration_ns"].sum()) / 1e6 / per,
            "busy_pct": 100.0 * _union_ns(start, end) / span if span else float("nan"),
            "comm_ms": float(kernels["duration_ns"].to_numpy("int64")[is_comm].sum()) / 1e6 / per,
            "overlap_pct": 100.0 * overlap / comm_wall if comm_wall else float("nan"),
            "exposed_ms": (comm_wall - overlap) / 1e6 / per}


def rank_frame(rows: list[dict]) -> pd.DataFrame:
    """The table of the module docstring from the ranks' rows (rank_row, made as each trace is analyzed,
    so that no trace is parsed twice nor all held at once)."""
    if not rows:
        raise UserError("no rank traces: give a folder with rank0/, rank1/, ... as `profile --nproc` writes it")
    return pd.DataFrame(rows, columns=COLUMNS)


@dataclass
class RankSummary:
    ranks: int
    slowest: int | None          # the rank with the longest median step
    skew_pct: float | None       # (slowest - fastest) / median of the ranks' step_ms
    comm_share_pct: float | None  # communication's share of the ranks' kernel time, all ranks together
    exposed_ms: float | None     # the largest exposed communication per step over the ranks

    def line(self, cpu: bool = False) -> str:
        if self.slowest is None:
            return f"{self.ranks} ranks: no step ranges, so no step times to compare"
        parts = [f"{self.ranks} ranks: the slowest is rank {self.slowest}, step-time skew {self.skew_pct:.1f}% "
                 "(slowest - fastest over the median)"]
        if self.comm_share_pct is not None:
            parts.append(f"communication {self.comm_share_pct:.1f}% of the {'CPU operator' if cpu else 'kernel'} time, at most "
                         f"{self.exposed_ms:.2f} ms a step exposed (not overlapped by compute)")
        return "; ".join(parts)


def rank_summary(table: pd.DataFrame) -> RankSummary:
    steps = table.dropna(subset=["step_ms"])
    slowest = skew = None
    if len(steps):
        slowest = int(steps.loc[steps["step_ms"].idxmax(), "rank"])
        med = float(steps["step_ms"].median())
        skew = 100.0 * float(steps["step_ms"].max() - steps["step_ms"].min()) / med if med else 0.0
    total = float(table["kernel_ms"].sum())
    comm = float(table["comm_ms"].sum())
    return RankSummary(len(table), slowest, skew, 100.0 * comm / total if total and comm else None,
                       float(table["exposed_ms"].max()) if comm else None)


def render_rank_table(table: pd.DataFrame, console, *, cpu: bool = False) -> None:
    """The ranks table and its summary line on the terminal."""
    from rich.table import Table

    unit = "op" if cpu else "kernel"
    heads = {"rank": "rank", "steps": "steps", "step_ms": "step ms (median)", "kernel_ms": f"{unit} ms/step",
             "busy_pct": f"{'CPU' if cpu else 'GPU'} busy %", "comm_ms": "comm ms/step",
             "overlap_pct": "comm overlapped %", "exposed_ms": "exposed comm ms/step"}
    out = Table(title="ranks", title_justify="left")
    for col in COLUMNS:
        out.add_column(heads[col], justify="right")
    for row in table.itertuples(index=False):
        out.add_row(*(_cell(getattr(row, c), c) for c in COLUMNS))
    console.print(out)
    console.print(rank_summary(table).line(cpu), highlight=False)


def _cell(value, col: str) -> str:
    if col in ("rank", "steps"):
        return str(int(value))
    if value is None or (isinstance(value, float) and not np.isfinite(value)):
        return "-"
    return f"{value:.1f}" if col.endswith("pct") else f"{value:.3f}"


def write_rank_table(table: pd.DataFrame, folder: Path, fmt: str) -> Path:
    """ranks.csv or ranks.json (the rows and the summary) in `folder`, written whole or not at all."""
    import json
    from dataclasses import asdict

    from workbench.files import atomic_write_text

    folder = Path(folder)
    if fmt == "csv":
        return atomic_write_text(folder / "ranks.csv", table.to_csv(index=False))
    rows = json.loads(table.to_json(orient="records"))
    return atomic_write_text(folder / "ranks.json", json.dumps({"ranks": rows, "summary": asdict(rank_summary(table))},
                                                               indent=2) + "\n")
