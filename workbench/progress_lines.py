"""How long-running commands show where they are: rich bars on a terminal, one plain line per event when
the output is not a terminal (a CI log), nothing when progress is off. `apply`'s LadderProgress and
`train`'s TrainProgress build on this."""
from __future__ import annotations


class ProgressOutput:
    """console: a rich Console; enabled: show anything. `plain` is True when lines are printed, `bars`
    when rich bars are drawn (a terminal); subclasses keep their rich Progress in `_bar`."""

    def __init__(self, console, enabled: bool):
        self.console = console
        self.plain = enabled and not console.is_terminal
        self.bars = enabled and not self.plain
        self._bar = None

    def __exit__(self, *exc) -> bool:
        return bool(self._bar.__exit__(*exc)) if self._bar is not None else False

    def line(self, text: str) -> None:
        """One plain line (no markup, no wrapping), shown only when the output is not a terminal."""
        if self.plain:
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)
