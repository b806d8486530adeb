"""The parity rule: does a recipe train like the fp32 baseline? Pure functions over loss curves and accuracies.

A recipe converges like the baseline when both hold:

1. Loss: its loss curve stays within the baseline's spread across seeds. Every curve is smoothed with a
   trailing mean over W steps (`smoothing_window`: a twentieth of the run, at least 5 steps). At each step t
   from W on, the baseline's spread s(t) is the range (max - min) of its seeds' smoothed losses and m(t)
   their mean. The recipe's distance is d(t) = |r(t) - m(t)|. It passes when the mean of d over those
   steps is at most the mean of s: on average the recipe sits no farther from the baseline's mean than
   the baseline's own seeds sit from each other.
2. Accuracy: its final validation accuracy is within ACCURACY_POINTS (0.5) points of the mean of the
   baseline seeds' final accuracies.

When the loss holds and the accuracy misses by less than the comparison's own noise, the verdict is
"not decided" rather than a failure. The noise is how far the mean accuracy of k seeds of an unchanged
recipe may fall from the mean of the baseline's n seeds by chance: NOISE_SIGMAS (2) standard deviations
of that difference, 2 s sqrt(1/k + 1/n), with s the sample standard deviation of the baseline seeds'
accuracies. A setup whose seeds spread wider than the rule (a chaotic run, a small validation set) then
says so instead of failing every recipe on noise; more seeds or a stabler run narrow it.

Why an average and not every step: with two seeds, a third run of the very same recipe lies outside the
[min, max] of the first two at two steps in three (for three samples of one distribution, each is the
middle one a third of the time). The mean distance of such a run from m is about 0.87 of the mean range
(for independent normal noise: E|r - m| = 0.98 sigma, E|a - b| = 1.13 sigma), so an unchanged recipe passes
with room, and a recipe whose loss sits off by more than the seeds' spread fails. A loss that is not
finite fails. The measured spread is reported with every verdict, not only the verdict.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

ACCURACY_POINTS = 0.5
NOISE_SIGMAS = 2.0
MIN_WINDOW = 5


def smoothing_window(steps: int) -> int:
    """W: the trailing mean's width for a run of `steps` steps (a twentieth of it, at least MIN_WINDOW)."""
    return max(MIN_WINDOW, round(steps / 20))


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` values (fewer at the start); NaN from a non-finite value on."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window) if math.isfinite(total) else math.nan)
    return out


def _finite(values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


@dataclass
class BaselineSpread:
    """The baseline seeds' smoothed curves summed up over the compared steps [first, steps)."""

    seeds: int
    window: int
    first: int
    steps: int
    mean: list[float]           # m(t) for every step (smoothed)
    spread: list[float]         # s(t) for every step
    spread_mean: float          # over the compared steps
    spread_max: float
    accuracies: list[float]
    accuracy_mean: float

    @property
    def accuracy_spread(self) -> float:
        return max(self.accuracies) - min(self.accuracies)

    @property
    def accuracy_std(self) -> float:
        """The sample standard deviation of the seeds' final accuracies (points)."""
        return statistics.stdev(self.accuracies)

    def accuracy_noise(self, seeds: int) -> float:
        """How far the mean accuracy of `seeds` runs of an unchanged recipe may fall from this mean by
        chance (points): NOISE_SIGMAS standard deviations of the difference of the two means."""
        return NOISE_SIGMAS * self.accuracy_std * math.sqrt(1 / max(seeds, 1) + 1 / self.seeds)


def baseline_spread(losses: list[list[float]], accuracies: list[float], window: int | None = None) -> BaselineSpread:
    """The spread of the baseline over its seeds: `losses` one per-step curve per seed (compared over their
    common length), `accuracies` the final validation accuracy (%) of each. ValueError with fewer than two
    seeds or a curve with a non-finite loss."""
    if len(losses) < 2 or len(accuracies) != len(losses):
        raise ValueError("the baseline's spread needs at least two seeds, each with a loss curve and an accuracy")
    steps = min(len(c) for c in losses)
    if steps < 1 or not all(_finite(c[:steps]) for c in losses) or not _finite(accuracies):
        raise ValueError("a baseline seed has no loss curve or a loss that is not finite")
    window = window or smoothing_window(steps)
    curves = [smooth(c[:steps], window) for c in losses]
    mean = [sum(vals) / len(vals) for vals in zip(*curves)]
    spread = [max(vals) - min(vals) for vals in zip(*curves)]
    first = min(window - 1, steps - 1)
    compared = spread[first:]
    return BaselineSpread(len(losses), window, first, steps, mean, spread, sum(compared) / len(compared),
                          max(compared), list(accuracies), sum(accuracies) / len(accuracies))


@dataclass
class Parity:
    """One recipe against the baseline's spread: the figures and the verdict."""

    distance_mean: float | None        # mean |r(t) - m(t)| over the compared steps
    distance_max: float | None
    inside_share: float | None         # share of compared steps with r(t) within [min, max] of the seeds
    spread_mean: float
    accuracy: float | None
    accuracy_delta: float | None       # accuracy - the baseline's mean accuracy, in points
    loss_ok: bool
    accuracy_ok: bool
    verdict: str                       # 'converges like the baseline' | 'differs: ...' | 'not decided: ...'
    accuracy_noise: float | None = None   # the comparison's noise on the accuracy difference (points)

    @property
    def passed(self) -> bool:
        return self.loss_ok and self.accuracy_ok

    @property
    def decided(self) -> bool:
        """False when the loss holds and the accuracy misses the rule by less than the noise."""
        return not self.verdict.startswith("not decided")

    def to_dict(self) -> dict:
        return asdict(self)


def parity(loss: list[float], accuracy: float | None, base: BaselineSpread,
           baseline_losses: list[list[float]] | None = None, seeds: int = 1) -> Parity:
    """The parity rule (this module's docstring) for a recipe's per-step `loss` curve and final `accuracy` (%)
    against `base`; seeds: how many runs the curve and the accuracy are the mean of. baseline_losses (the
    seeds' raw curves) adds the share of steps inside their range."""
    steps = min(len(loss), base.steps)
    if steps < base.steps or not _finite(loss[:steps]):
        where = "not finite" if not _finite(loss[:steps]) else f"{len(loss)} of {base.steps} steps"
        return Parity(None, None, None, base.spread_mean, accuracy, None, False, False,
                      f"differs: loss {where}")
    curve = smooth(loss[:steps], base.window)
    distance = [abs(r - m) for r, m in zip(curve, base.mean)][base.first:]
    inside = None
    if baseline_losses:
        seed_curves = [smooth(c[:steps], base.window) for c in baseline_losses]
        inside = sum(min(v) <= r <= max(v) for r, v in zip(curve[base.first:], list(zip(*seed_curves))[base.first:]))
        inside /= len(distance)
    distance_mean = sum(distance) / len(distance)
    loss_ok = distance_mean <= base.spread_mean
    delta = None if accuracy is None or not math.isfinite(accuracy) else accuracy - base.accuracy_mean
    accuracy_ok = delta is not None and abs(delta) <= ACCURACY_POINTS
    noise = base.accuracy_noise(seeds)
    within_noise = delta is not None and not accuracy_ok and abs(delta) <= noise
    problems = []
    if not loss_ok:
        problems.append(f"loss {distance_mean:.3g} from the baseline's mean on average, its seeds' spread "
                        f"{base.spread_mean:.3g}")
    if not accuracy_ok:
        problems.append("no accuracy" if delta is None else
                        f"accuracy {delta:+.2f} points from the baseline's mean (rule: within {ACCURACY_POINTS}"
                        + (f"; this comparison's noise: ±{noise:.2f}, from the baseline seeds' standard deviation "
                           f"{base.accuracy_std:.2f} over {seeds} and {base.seeds} seeds)" if within_noise else ")"))
    if not problems:
        verdict = "converges like the baseline"
    elif loss_ok and within_noise:
        verdict = "not decided: " + problems[0] + ": more seeds or a stabler run decide it"
    else:
        verdict = "differs: " + "; ".join(problems)
    return Parity(distance_mean, max(distance), inside, base.spread_mean, accuracy, delta, loss_ok, accuracy_ok,
                  verdict, noise)
