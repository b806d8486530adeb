"""Where a training run is, shown the way its output can show it: one rich bar per run with loss and
throughput on a terminal; plain lines when the output is not a terminal (a CI log): every tenth of a run,
each validation, each run's end; nothing when progress is off. The loop calls the same methods in every case."""
from __future__ import annotations

from workbench.progress_lines import ProgressOutput


class TrainProgress(ProgressOutput):
    """Context manager over `runs` training runs. console: a rich Console; enabled: show anything."""

    def __init__(self, console, enabled: bool, runs: int):
        super().__init__(console, enabled)
        self.runs = runs
        self._task = None
        self._name = self._desc = ""
        self._steps = 0

    def __enter__(self) -> "TrainProgress":
        if self.bars:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[status]}"), TimeElapsedColumn(), console=self.console)
            self._bar.__enter__()
        return self

    def start_run(self, index: int, name: str, steps: int) -> None:
        self._name, self._steps = name, steps
        self.line(f"run {index + 1}/{self.runs} {name}: {steps} steps")
        self._desc = f"{index + 1}/{self.runs} {name}"
        if self._bar is not None:
            self._task = self._bar.add_task(self._desc, total=steps, status="")

    def step(self, step: int, loss: float, img_per_s: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=f"loss {loss:.4f}  {img_per_s:,.0f} img/s")
        elif step == self._steps or step % max(1, self._steps // 10) == 0:
            self.line(f"  {self._name} step {step}/{self._steps}: loss {loss:.4f}, {img_per_s:,.1f} img/s")

    def validation(self, epoch: int, accuracy: float, averaged: float | None = None) -> None:
        """An epoch's validation accuracy (averaged: the EMA weights', with --ema)."""
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self._desc} | epoch {epoch + 1} val {accuracy:.1f}%")
        self.line(f"  {self._name} epoch {epoch + 1}: val accuracy {accuracy:.2f}%"
                  + (f", EMA {averaged:.2f}%" if averaged is not None else ""))

    def end_run(self, text: str) -> None:
        self.line(f"  {self._name}: {text}")
        if self._bar is not None:
            self._bar.update(self._task, status=text)
