"""Where a ladder run is, shown the way its output can show it: rich bars on a terminal; one plain line
as each stage starts and ends (and per interleaved round) when the output is not a terminal (a CI log);
nothing when progress is off. The ladder calls the same methods in every case."""
from __future__ import annotations

from workbench.progress_lines import ProgressOutput


class LadderProgress(ProgressOutput):
    """Context manager over a run of `total` stages. console: a rich Console; enabled: show anything."""

    def __init__(self, console, enabled: bool, total: int):
        super().__init__(console, enabled)
        self.total = total
        self._run_task = self._task = None
        self._stage = ""

    def __enter__(self) -> "LadderProgress":
        if self.bars:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console, transient=False)
            self._bar.__enter__()
            self._run_task = self._bar.add_task("stages", total=self.total)
        return self

    # ------------------------------------------------------------------ stages

    def start_stage(self, index: int, stage: str, steps: int) -> None:
        self._stage = stage
        self.line(f"stage {index + 1}/{self.total} {stage}: started")
        if self._bar is not None:
            self._task = self._bar.add_task(f"  {stage}", total=steps)

    def note(self, what: str) -> None:
        """What the current stage is doing ('reference', 'kept from the earlier run', ...)."""
        if self._bar is not None:
            self._bar.update(self._task, description=f"  {self._stage}: {what}")

    def event(self, event: dict) -> None:
        """A stage's progress event (run_stage's `emit`: step, reference, gate, profile, done)."""
        kind = event.get("event")
        if kind == "profile":
            self.line(f"stage {self._stage}: profiling")
        if kind == "graph":
            self.line(f"stage {self._stage}: timing the step replayed as one CUDA graph")
        if self._bar is None:
            return
        if kind == "graph":
            self._bar.reset(self._task, description=f"  {self._stage}: CUDA graph")
        elif kind == "step":
            self._bar.advance(self._task)
        elif kind in ("reference", "gate", "profile"):
            self.note(kind)
        elif kind == "done":
            self.note(str(event.get("status")))

    def end_stage(self, index: int, stage: str, record: dict) -> None:
        self.line(f"stage {index + 1}/{self.total} {stage}: {outcome(record)}")
        if self._bar is not None:
            self._bar.update(self._task, visible=False)
            self._bar.advance(self._run_task)

    # ------------------------------------------------------------------ interleaved rounds

    def start_rounds(self, rounds: int) -> None:
        self._rounds = rounds
        if self._bar is not None:
            self._task = self._bar.add_task("  interleaved rounds", total=rounds)

    def round_event(self, event: dict) -> None:
        """An event of the interleaved phase (build, round)."""
        kind = event.get("event")
        if kind == "round":
            self.line(f"interleaved round {event.get('i', 0) + 1}/{self._rounds} done")
            if self._bar is not None:
                self._bar.advance(self._task)
        elif kind == "build" and self._bar is not None:
            self._bar.update(self._task, description=f"  interleaved: building {event['stage']}")

    def end_rounds(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, visible=False)


def outcome(record: dict) -> str:
    """A finished stage in a few words: 'ok, 21.0 img/s, gate PASS', with the graph-replayed rate when
    there is one ('ok, 612.0 img/s, 2,410.3 img/s graph-replayed, gate PASS'), or 'error: ...'."""
    if record.get("status") != "ok":
        return f"{record.get('status')}" + (f": {record['error']}" if record.get("error") else "")
    rate = record.get("img_per_s")
    rate = f"{rate:,.1f} img/s" if isinstance(rate, (int, float)) else "not timed"
    graph = record.get("graph") or {}
    if isinstance(graph.get("img_per_s"), (int, float)) and graph.get("step_ms") != record.get("step_ms"):
        rate += f", {graph['img_per_s']:,.1f} img/s graph-replayed"
    reused = " (reused)" if record.get("reused") else ""
    return f"ok{reused}, {rate}, gate {(record.get('gate') or {}).get('status', 'SKIP')}"
