"""Progress events of the processes `apply` starts (a stage, the interleaved phase): one JSON object per
line of the child's stdout, after EVENT_PREFIX; every other line of its output goes to its log."""
from __future__ import annotations

import json

EVENT_PREFIX = "@swinbench "


def print_event(event: dict) -> None:
    """Report `event` to the parent process (on stdout, flushed at once)."""
    print(EVENT_PREFIX + json.dumps(event), flush=True)
