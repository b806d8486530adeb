"""When a speedup between two timed stages is not significant.

A ratio of two medians is only worth reading when each median is steady and the two stages' step
times are apart. `speedup_significant` says no (the table prints the ratio as "1.04x (n.s.)") when

- either stage has fewer than MIN_STEPS timed steps: its spread is unknown;
- either stage's IQR exceeds SPREAD_LIMIT of its median: its median moves with the machine's load;
- the ranges median ± IQR of the two stages overlap: the difference is inside the step-to-step spread.

A paired ratio from stages timed in alternation (`apply --interleave`) is not significant when the
interquartile range of its per-round ratios holds 1.0, or fewer than MIN_STEPS rounds were timed
(`paired_significant`).
"""
from __future__ import annotations

import math

MIN_STEPS = 3
SPREAD_LIMIT = 0.25
NS_MARK = "n.s."
NS_NOTE = (f"{NS_MARK} = not significant: the step times of this stage or of the one it is compared with spread "
           f"widely (IQR over {SPREAD_LIMIT:.0%} of the median, or fewer than {MIN_STEPS} timed steps), or the "
           "two stages' ranges median ± IQR overlap, so the ratio may be noise. A paired ratio (timed in "
           "alternation) is n.s. when the quartiles of its per-round ratios hold 1.00x or it had fewer than "
           f"{MIN_STEPS} rounds.")


def _steady(median_ms, iqr_ms, steps) -> bool:
    if any(v is None or (isinstance(v, float) and math.isnan(v)) for v in (median_ms, iqr_ms)) or median_ms <= 0:
        return False
    if steps is not None and steps < MIN_STEPS:
        return False
    return iqr_ms <= SPREAD_LIMIT * median_ms


def speedup_significant(median_ms: float, iqr_ms: float, steps: int | None,
                        other_median_ms: float, other_iqr_ms: float, other_steps: int | None) -> bool:
    """Whether a stage (median step ms, its IQR, its number of timed steps; None: not known) is
    significantly faster or slower than the stage it is compared with (see the module doc)."""
    if not (_steady(median_ms, iqr_ms, steps) and _steady(other_median_ms, other_iqr_ms, other_steps)):
        return False
    low, high = sorted(((median_ms, iqr_ms), (other_median_ms, other_iqr_ms)))
    return low[0] + low[1] < high[0] - high[1]


def paired_significant(q1: float | None, q3: float | None, rounds: int | None) -> bool:
    """Whether a paired ratio whose per-round quartiles are q1..q3 (over `rounds` rounds) is significantly
    different from 1."""
    if q1 is None or q3 is None or (rounds is not None and rounds < MIN_STEPS):
        return False
    return not (q1 <= 1.0 <= q3)
