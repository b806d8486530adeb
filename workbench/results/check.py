"""`swinbench check`: compare stored stage records (current) with a stored baseline, for CI.

Reads two sets of stage records through `records.read_records` (files or folders, several runs allowed;
a record holding anything that is not a measurement, such as an img/s that is NaN, infinite, null or
not a number, is refused there), matches stages by name and checks, per stage:

    img_per_s        higher is better   % change, limit in %      noise band from the step-time IQRs
    step_ms          lower is better    % change, limit in %      noise band from the step-time IQRs
    graph_ms         lower is better    the step replayed as one CUDA graph (record.graph), where the stage's
                     own step is no graph; % change, noise band from the two graph timings' IQRs
    peak_mem_bytes   lower is better    % change, limit in %      no noise band (memory is exact)
    speedup          higher is better   img_per_s / img_per_s of stage 'baseline' of the same run
    launches_per_step        lower is better  % change   host kernel launches per step in the stage's
                             profile (profile.api_calls_per_step.launch); exact counts, no noise band
    blocking_calls_per_step  lower is better  % change   synchronizing + allocating CUDA calls per step;
                             from 0, any such call is an infinite % change, so REGRESSED
    paired_speedup   higher is better   the stage's paired ratio over the stage it extends (or its nearest
                             interleaved ancestor) from `apply --interleave`: the median over rounds timed
                             in alternation, so a host's drift between stages does not move it; noise band
                             from the ratio's quartiles; compared only against the same ancestor
    share:<category> kernel category share (profile.category_share_pct), drift in percentage points
    dp_img_per_s     higher is better   `apply --nproc N` (record.scaling): the global batch over the
                     slowest rank's median step, all N ranks together
    dp_step_ms       lower is better    that slowest rank's median step
    dp_efficiency    higher is better   dp_img_per_s / (N x the stage's one-process img/s)
                     noise band of the three from the slowest rank's IQR (efficiency: plus the one-process
                     IQR); none where a record kept no per-rank IQRs
    dp_gate          the gate over the global batch on every rank; turning FAIL is a regression
    gate             correctness gate; turning FAIL (from PASS, SKIP or REFERENCE) is a regression
    activation_dtypes  the dtype each part of the model outputs under the stage's precision (records from
                     `apply`); any change is REGRESSED, as a different kernel mix is for the shares: a
                     kernel change that also moves activations to another precision must be taken on
                     purpose, by refreshing the baseline. Skipped where either side's record predates it.

Status of a row (`limit` and `band` are both >= 0):

    |Δ| <= limit                   -> unchanged
    |Δ| >  limit, |Δ| <= band      -> noise        (the change is inside the run-to-run spread)
    |Δ| >  limit, |Δ| >  band      -> REGRESSED if worse, improved if better

The noise band (in %) of a timed metric is

    band = noise_iqr_scale * 100 * (iqr_base / median_base + iqr_cur / median_cur)

with noise_iqr_scale = 0.5 by default: half the IQR on each side, summed, i.e. the change must
be large enough that the two interquartile boxes around the medians no longer overlap. The speedup
band adds the same terms for the run's 'baseline' stage (the spread of a ratio is about the sum of
the spreads). Share drift has no better direction: any drift beyond its limit is REGRESSED, since a
different kernel mix means the baseline should be refreshed on purpose.

What the baseline measured and the current run lacks is MISSING, a regression (a half-finished run or a
kernel that stopped loading must not pass CI): a stage of the baseline absent from current, a stage 'ok'
in the baseline and 'not available' now, and a timed metric (MEASURED_METRICS) of the baseline that the
current record lacks. `allow_missing` lists them as "only in baseline" instead, which does not fail.
Stages only in current are listed and do not fail, unless their correctness gate FAILs. Records whose
status is not 'ok' are otherwise listed ("not compared"), except a stage that was 'ok' in the baseline
and is 'error' now: that is REGRESSED (the stage no longer runs). Model, mode, batch, precision, GPU,
torch/triton versions and the data-parallel world size must match unless `force`; with `force` the
difference becomes a note.
A stage held by several records on one side (several runs) is taken from the newest (env.date).

Everything returns plain data: `check_records` -> `CheckResult` (a DataFrame of rows plus verdict),
`render_markdown` and `to_json` render it. Exit codes: 0 nothing regressed, 1 a measured regression and
nothing else, 2 bad input (unreadable or invalid records or thresholds, mismatched experiments without
`force`, an output that cannot be written): every problem with the inputs raises UserError (exit 2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from workbench.analysis.frames import blocking_calls
from workbench.errors import UserError
from workbench.files import load_yaml_file, short_repr
from workbench.labels import GPU_WORDS, MIXED_WORDS, DeviceWords, record_words
from workbench.results.record import StageRecord, read_records, short_dtype

ROW_COLUMNS = ["stage", "metric", "baseline", "current", "delta_pct", "limit", "noise_band_pct", "status", "unit"]
STATUSES = ("improved", "unchanged", "noise", "REGRESSED", "MISSING", "only in baseline", "only in current",
            "FAIL gate", "not compared")
REGRESSION_STATUSES = ("REGRESSED", "FAIL gate", "MISSING")

# metric -> +1 when higher is better, -1 when lower is better
PCT_METRICS = {"img_per_s": +1, "step_ms": -1, "graph_ms": -1, "peak_mem_bytes": -1, "speedup": +1,
               "launches_per_step": -1, "blocking_calls_per_step": -1, "paired_speedup": +1,
               "dp_img_per_s": +1, "dp_step_ms": -1, "dp_efficiency": +1}
# the data-parallel figures of `apply --nproc N` (record.scaling), compared by _scaling_rows
DP_PREFIX = "dp_"
DP_METRICS = tuple(m for m in PCT_METRICS if m.startswith(DP_PREFIX))
TIMED_METRICS = ("img_per_s", "step_ms", "graph_ms", "speedup")
# what every measured stage records (graph_ms: where its step was also graph-replayed): lacking one that the
# baseline has is MISSING. The others depend on how apply was called (--profile, --interleave, --nproc).
MEASURED_METRICS = ("img_per_s", "step_ms", "graph_ms", "peak_mem_bytes", "speedup")
SHARE_PREFIX = "share:"
BASELINE_STAGE = "baseline"

DEFAULT_MAX_REGRESSION_PCT = 5.0
DEFAULT_SHARE_DRIFT_PP = 2.0
DEFAULT_NOISE_IQR_SCALE = 0.5

# Settings that make two measurements different experiments; comparing them needs --force.
# (record key, label, plural label)
# Precision is per stage (the amp pass changes it), so it is compared per matched stage instead.
RUN_SETTINGS = (("model", "model", "models"), ("mode", "mode", "modes"), ("batch", "batch", "batch sizes"),
                ("shape_label", "image size", "image sizes"), ("weights", "checkpoint", "checkpoints"))
ENV_SETTINGS = (("device_type", "device type", "device types"), ("device_name", "device", "devices"),
                ("torch", "torch version", "torch versions"), ("triton", "triton version", "triton versions"))
# Worth a note, not worth refusing.
ENV_NOTES = (("driver", "driver version"), ("cuda", "CUDA version"), ("timm", "timm version"),
             ("cpu", "host CPU"))      # CPU records name no other device; a host-bound GPU stage moves with it



@dataclass
class CheckResult:
    """rows: one row per (stage, metric), columns ROW_COLUMNS; `baseline`/`current` hold numbers,
    or strings for the gate and record-status rows. `delta_pct` is in % (pp for share rows, see
    `unit`), `limit` and `noise_band_pct` likewise. `regressed` is True when any row is REGRESSED,
    FAIL gate or MISSING."""

    rows: pd.DataFrame
    regressed: bool
    summary: str
    notes: list[str] = field(default_factory=list)
    # stage -> its largest per-kernel changes (diff.join_per_unit columns), for regressed stages whose
    # records both carry a profile's per-kernel table: where to look first
    kernel_changes: dict = field(default_factory=dict)
    words: DeviceWords = GPU_WORDS   # CPU (or CPU/GPU, mixed) when records ran on the CPU (labels.record_words)

    @property
    def exit_code(self) -> int:
        return 1 if self.regressed else 0


# ---------------------------------------------------------------- thresholds


@dataclass
class Thresholds:
    """Limits per metric: `default` (metric -> limit), `share_drift_pp`, per-stage overrides."""

    max_regression_pct: float = DEFAULT_MAX_REGRESSION_PCT
    share_drift_pp: float = DEFAULT_SHARE_DRIFT_PP
    noise_iqr_scale: float = DEFAULT_NOISE_IQR_SCALE
    metric_defaults: dict = field(default_factory=dict)   # metric -> limit
    stages: dict = field(default_factory=dict)            # stage -> {metric -> limit}

    def limit(self, stage: str, metric: str) -> float:
        """Most specific first: stage+metric, stage share_drift_pp (shares), default metric, default."""
        per_stage = self.stages.get(stage, {})
        if metric in per_stage:
            return per_stage[metric]
        is_share = metric.startswith(SHARE_PREFIX)
        if is_share and "share_drift_pp" in per_stage:
            return per_stage["share_drift_pp"]
        if metric in self.metric_defaults:
            return self.metric_defaults[metric]
        return self.share_drift_pp if is_share else self.max_regression_pct


def _printable(text) -> bool:
    return isinstance(text, str) and bool(text) and not any(ord(c) < 32 or ord(c) == 127 for c in text)


def _quoted(key) -> str:
    """A key from the thresholds file as an error line shows it: as is when printable, else its repr."""
    return key if _printable(key) else short_repr(key)


def _valid_metric_key(key) -> bool:
    return _printable(key) and (key in PCT_METRICS or key == "share_drift_pp"
                                or (key.startswith(SHARE_PREFIX) and len(key) > len(SHARE_PREFIX)))


def _limit_value(value, where: str, path: Path) -> float:
    """A limit: a finite number >= 0 (a limit of .inf would let every change pass)."""
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or number < 0:
        raise UserError(f"{path}: {where} must be a number >= 0 (finite), got {short_repr(value)}")
    return number


def load_thresholds(path, *, max_regression_pct: float = DEFAULT_MAX_REGRESSION_PCT,
                    share_drift_pp: float = DEFAULT_SHARE_DRIFT_PP) -> Thresholds:
    """Read and validate a thresholds YAML file (shape in .ci/check-thresholds.example.yaml).

    Values in the file replace the arguments. UserError (exit 2) for a missing file, bad YAML,
    an unknown key or a limit that is not a number >= 0."""
    th = Thresholds(max_regression_pct=max_regression_pct, share_drift_pp=share_drift_pp)
    if path is None:
        return th
    path = Path(path)
    data = load_yaml_file(path, "thresholds file")
    if data is None:
        return th
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping with keys default, share_drift_pp, noise_iqr_scale, stages")
    allowed = {"version", "default", "share_drift_pp", "noise_iqr_scale", "stages"}
    for key in data:
        if key not in allowed:
            raise UserError(f"{path}: unknown key {short_repr(key)} (allowed: {', '.join(sorted(allowed))})")
    version = data.get("version", 1)
    if type(version) is not int or version != 1:
        raise UserError(f"{path}: version {short_repr(version)} is not supported (expected 1)")

    default = data.get("default")
    default = {} if default is None else default     # `default:` left empty
    if not isinstance(default, dict):
        raise UserError(f"{path}: 'default' must be a mapping, e.g. {{max_regression_pct: 5}}")
    for key, value in default.items():
        if key == "max_regression_pct":
            th.max_regression_pct = _limit_value(value, "default.max_regression_pct", path)
        elif key == "share_drift_pp":
            th.share_drift_pp = _limit_value(value, "default.share_drift_pp", path)
        elif _valid_metric_key(key):
            th.metric_defaults[key] = _limit_value(value, f"default.{key}", path)
        else:
            raise UserError(f"{path}: unknown key default.{_quoted(key)} (metrics: {', '.join(PCT_METRICS)}, "
                            f"share_drift_pp, share:<category>, or max_regression_pct)")
    if "share_drift_pp" in data:
        if "share_drift_pp" in default:
            raise UserError(f"{path}: share_drift_pp is given both at the top level and under default; keep one")
        th.share_drift_pp = _limit_value(data["share_drift_pp"], "share_drift_pp", path)
    if "noise_iqr_scale" in data:
        th.noise_iqr_scale = _limit_value(data["noise_iqr_scale"], "noise_iqr_scale", path)

    stages = data.get("stages")
    stages = {} if stages is None else stages
    if not isinstance(stages, dict):
        raise UserError(f"{path}: 'stages' must map stage names to {{metric: limit}}")
    for stage, limits in stages.items():
        if not _printable(stage):
            raise UserError(f"{path}: stages must be keyed by stage name, got {short_repr(stage)}")
        if not isinstance(limits, dict):
            raise UserError(f"{path}: stages.{stage} must be a mapping of metric to limit, e.g. {{img_per_s: 3}}")
        checked = {}
        for key, value in limits.items():
            if not _valid_metric_key(key):
                raise UserError(f"{path}: unknown metric stages.{stage}.{_quoted(key)} (metrics: "
                                f"{', '.join(PCT_METRICS)}, share_drift_pp, share:<category>)")
            checked[key] = _limit_value(value, f"stages.{stage}.{key}", path)
        th.stages[stage] = checked
    return th


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class _Stage:
    """One side's record of a stage with the figures derived from it (what `_pct_row` compares)."""

    record: StageRecord
    speedup: float | None = None              # img_per_s / that of the run's 'baseline' stage
    speedup_rel_iqr: float = 0.0
    launches_per_step: float | None = None
    blocking_calls_per_step: float | None = None
    paired_speedup: float | None = None
    paired_against: str | None = None
    paired_rel_spread: float = 0.0

    def metric(self, name: str) -> float | None:
        """The value of a PCT_METRICS metric, None when the record does not have it."""
        if name in ("img_per_s", "step_ms", "peak_mem_bytes"):
            return getattr(self.record, name)
        if name.startswith(DP_PREFIX):
            scaling = self.record.scaling
            ok = scaling is not None and scaling.status == "ok"
            return getattr(scaling, name[len(DP_PREFIX):]) if ok else None
        if name == "graph_ms":
            graph = self.record.graph
            # a stage whose own step is a graph has the same figure as step_ms: compared once, there
            return graph.step_ms if graph is not None and graph.timing != self.record.timing else None
        return getattr(self, name)


def _relative_iqr(rec: StageRecord) -> float:
    """iqr / median of the step time (timing.*, else step_iqr_ms / step_ms); 0 when unknown."""
    if rec.timing is not None:
        return rec.timing.iqr_ms / rec.timing.median_ms
    if rec.step_ms and rec.step_iqr_ms is not None:
        return rec.step_iqr_ms / rec.step_ms
    return 0.0


def _slowest_rank(scaling) -> int:
    """The rank with the longest median step: the one every data-parallel step waits for."""
    medians = scaling.step_ms_per_rank
    return max(range(len(medians)), key=medians.__getitem__)


def _slowest_rank_rel_iqr(scaling) -> float | None:
    """iqr / median of the slowest rank's step (the data-parallel step); None when the record kept no IQRs."""
    if not scaling.step_iqr_ms_per_rank:
        return None
    slowest = _slowest_rank(scaling)
    return scaling.step_iqr_ms_per_rank[slowest] / scaling.step_ms_per_rank[slowest]


def _derive(rec: StageRecord, base: StageRecord | None) -> _Stage:
    """`rec` with its speedup over `base` (its run's 'baseline' stage), host calls and paired speedup."""
    if not rec.ok:
        return _Stage(rec)
    speedup, speedup_iqr = None, 0.0
    if base is not None and rec.stage != BASELINE_STAGE:
        speedup = rec.img_per_s / base.img_per_s
        speedup_iqr = _relative_iqr(rec) + _relative_iqr(base)
    calls = rec.profile.api_calls_per_step if rec.profile is not None else None
    paired = rec.interleaved.x_previous if rec.interleaved is not None else None
    paired_ok = paired is not None and paired.median is not None
    return _Stage(rec, speedup=speedup, speedup_rel_iqr=speedup_iqr,
                  launches_per_step=float(calls.get("launch", 0.0)) if calls else None,
                  blocking_calls_per_step=blocking_calls(calls) if calls else None,
                  paired_speedup=paired.median if paired_ok else None,
                  paired_against=rec.interleaved.previous_stage if paired_ok else None,
                  paired_rel_spread=(paired.q3 - paired.q1) / paired.median if paired_ok else 0.0)


def _load_side(paths, side: str, notes: list[str]) -> dict[str, _Stage]:
    """stage name -> its _Stage. When several runs hold the same stage, the newest (env.date, run_id) wins."""
    records = read_records(paths)
    # speedup needs the 'baseline' stage of the same run, so compute it before choosing among runs
    base_by_run = {r.run_id: r for r in records if r.stage == BASELINE_STAGE and r.ok}
    by_stage: dict[str, list[_Stage]] = {}
    for rec in records:
        by_stage.setdefault(rec.stage, []).append(_derive(rec, base_by_run.get(rec.run_id)))
    chosen = {}
    for stage, entries in by_stage.items():
        entries.sort(key=lambda s: (s.record.env.date or "", s.record.run_id))
        chosen[stage] = entries[-1]
        if len(entries) > 1:
            notes.append(f"{side}: stage '{stage}' appears in {len(entries)} records; compared the newest "
                         f"({entries[-1].record.source})")
    return dict(sorted(chosen.items(), key=lambda kv: (kv[1].record.stage_index, kv[0])))


def _values(stages, key: str, env: bool) -> list:
    """Distinct values of `key` (a StageRecord field, or an Env field when `env`), in record order."""
    out: list = []
    for entry in stages:
        value = getattr(entry.record.env if env else entry.record, key)
        if value not in out:
            out.append(value)
    return out


def _check_settings(base: dict, cur: dict, force: bool, notes: list[str]) -> None:
    """Different experiments (model, mode, batch, GPU, torch/triton; precision per stage) need --force."""
    for keys, env in ((RUN_SETTINGS, False), (ENV_SETTINGS, True)):
        for key, label, plural in keys:
            bv, cv = _values(base.values(), key, env), _values(cur.values(), key, env)
            if len(bv) > 1 or len(cv) > 1:
                side, vals = ("baseline", bv) if len(bv) > 1 else ("current", cv)
                problem = f"{side} records mix {plural}: {', '.join(map(str, vals))}"
                if not force:
                    raise UserError(f"{problem}; pass --force to compare anyway")
                notes.append(f"compared with --force although {problem}")
            elif bv != cv:
                if not force:
                    raise UserError(f"baseline and current differ in {label}: {bv[0]} (baseline) vs {cv[0]} "
                                    f"(current); pass --force to compare anyway")
                notes.append(f"compared across different {plural} with --force: {bv[0]} (baseline) vs "
                             f"{cv[0]} (current); deltas mix both changes")
    _check_world_size(base, cur, force, notes)
    for stage in base.keys() & cur.keys():
        b, c = base[stage].record, cur[stage].record
        bp, cp = b.precision, c.precision
        if bp != cp and b.ok and c.ok:   # a failed stage's record keeps the run's precision, not the stage's
            if not force:
                raise UserError(f"stage '{stage}' ran in different precision: {bp} (baseline) vs {cp} (current); "
                                f"pass --force to compare anyway")
            notes.append(f"stage '{stage}' compared across precisions with --force: {bp} (baseline) vs {cp} (current)")
    for key, label in ENV_NOTES:
        bv, cv = _values(base.values(), key, True), _values(cur.values(), key, True)
        shown = lambda vals: ", ".join("none" if v is None else str(v) for v in vals)   # None: a CPU record's
        if shown(bv) != shown(cv):
            notes.append(f"{label} differs: {shown(bv)} (baseline) vs {shown(cv)} (current)")


def _world_sizes(stages) -> list[int]:
    """The distinct data-parallel world sizes of the records' `apply --nproc` results, in record order."""
    out: list[int] = []
    for entry in stages:
        scaling = entry.record.scaling
        if scaling is not None and scaling.world_size not in out:
            out.append(scaling.world_size)
    return out


def check_planned_run(baseline_paths, nproc: int | None, force: bool = False, planned: dict | None = None) -> None:
    """Before `apply --check-against BASELINE` runs: UserError (one line) when the check at the end would
    refuse the run's records, unless `force`: a baseline of another model, mode, batch or device type
    (`planned`: {record or env key: the value this run will record}, None where not known yet), or whose data-parallel
    results are of another world size than --nproc N. Reads (and so validates) the baseline records."""
    stages = [_Stage(r) for r in read_records(baseline_paths)]
    labels = {key: label for key, label, _ in RUN_SETTINGS}
    env_labels = {key: label for key, label, _ in ENV_SETTINGS}
    for key, value in (planned or {}).items():
        have = _values(stages, key, key in env_labels)
        labels.setdefault(key, env_labels.get(key, key))
        if value is not None and len(have) == 1 and have[0] != value and not force:
            raise UserError(f"the baseline's {labels[key]} is {have[0]} and this run's {value}: the check would "
                            f"refuse them; run with the baseline's, or pass --force to compare anyway")
    sizes = _world_sizes(stages)
    if nproc and sizes and sizes != [nproc] and not force:
        raise UserError(f"the baseline's data-parallel results are of {', '.join(map(str, sizes))} ranks and this "
                        f"run has --nproc {nproc}: the check would refuse them; use --nproc {sizes[0]}, or pass "
                        "--force to compare anyway")


def _check_world_size(base: dict, cur: dict, force: bool, notes: list[str]) -> None:
    """Data-parallel figures compare only at one world size, the same on both sides, unless `force`."""
    bw, cw = _world_sizes(base.values()), _world_sizes(cur.values())
    for side, sizes in (("baseline", bw), ("current", cw)):
        if len(sizes) > 1:
            problem = f"{side} records mix data-parallel world sizes: {', '.join(map(str, sizes))}"
            if not force:
                raise UserError(f"{problem}; pass --force to compare anyway")
            notes.append(f"compared with --force although {problem}")
    if bw and cw and set(bw) != set(cw):
        both = f"{', '.join(map(str, bw))} ranks (baseline) vs {', '.join(map(str, cw))} (current)"
        if not force:
            raise UserError(f"baseline and current differ in data-parallel world size: {both}; pass --force to "
                            "compare anyway")
        notes.append(f"data-parallel figures compared across world sizes with --force: {both}; img/s and step "
                     "times of different world sizes differ by design, efficiency is the comparable figure")
    elif bw and cw:
        notes.append(f"dp_* rows: the stages again data parallel over {bw[0]} ranks (`apply --nproc {bw[0]}`), "
                     "on both sides")
    elif bw or cw:
        side, other = ("baseline", "current") if bw else ("current", "baseline")
        notes.append(f"only the {side} records hold data-parallel results (`apply --nproc {(bw or cw)[0]}`): "
                     f"the {other} ran without --nproc, so none are compared")


# ---------------------------------------------------------------- comparison


def _classify(worse: float, limit: float, band: float | None) -> str:
    """`worse`: signed change, positive = worse. See the module docstring for the rule."""
    worse = round(worse, 9)   # 1.05 * x is not exactly +5 %; don't let float dust cross a limit
    if abs(worse) <= limit:
        return "unchanged"
    if band is not None and abs(worse) <= band:
        return "noise"
    return "REGRESSED" if worse > 0 else "improved"


def _row(stage, metric, base, cur, delta, limit, band, status, unit="%") -> dict:
    return dict(stage=stage, metric=metric, baseline=base, current=cur, delta_pct=delta, limit=limit,
                noise_band_pct=band, status=status, unit=unit)


def _pct_row(stage: str, metric: str, b: _Stage, c: _Stage, th: Thresholds, allow_missing: bool = True) -> dict | None:
    bv, cv = b.metric(metric), c.metric(metric)
    limit = th.limit(stage, metric)
    if bv is None and cv is None:
        return None
    if bv is None or cv is None:
        status = ("only in current" if bv is None else
                  "MISSING" if metric in MEASURED_METRICS and not allow_missing else "only in baseline")
        return _row(stage, metric, bv, cv, None, limit, None, status)
    bv, cv = float(bv), float(cv)
    band = None
    if metric == "paired_speedup":
        if b.paired_against != c.paired_against:
            return _row(stage, f"{metric} (vs {b.paired_against} / {c.paired_against})", bv, cv, None,
                        limit, None, "not compared")
        band = th.noise_iqr_scale * 100.0 * (b.paired_rel_spread + c.paired_rel_spread)
    if metric in TIMED_METRICS:
        if metric == "speedup":
            spread = b.speedup_rel_iqr + c.speedup_rel_iqr
        elif metric == "graph_ms":
            spread = sum(g.step_iqr_ms / g.step_ms for g in (b.record.graph, c.record.graph))
        else:
            spread = _relative_iqr(b.record) + _relative_iqr(c.record)
        band = th.noise_iqr_scale * 100.0 * spread
    if metric in DP_METRICS:
        spreads = [_slowest_rank_rel_iqr(side.record.scaling) for side in (b, c)]
        if None not in spreads:
            if metric == "dp_efficiency":   # over the one-process img/s: that spread adds in
                spreads += [_relative_iqr(b.record), _relative_iqr(c.record)]
            band = th.noise_iqr_scale * 100.0 * sum(spreads)
    if bv == 0:
        delta = 0.0 if cv == 0 else math.copysign(math.inf, cv)
    else:
        delta = (cv - bv) / abs(bv) * 100.0
    worse = -delta * PCT_METRICS[metric]
    return _row(stage, metric, bv, cv, delta, limit, band, _classify(worse, limit, band))


def _share_rows(stage: str, b: StageRecord, c: StageRecord, th: Thresholds) -> list[dict]:
    bs = b.profile.category_share_pct if b.profile is not None else None
    cs = c.profile.category_share_pct if c.profile is not None else None
    if not bs or not cs:
        return []
    rows = []
    # a category missing on one side has share 0 there (shares sum to 100 on each side)
    for cat in list(bs) + [k for k in cs if k not in bs]:
        metric = f"{SHARE_PREFIX}{cat}"
        bv, cv = bs.get(cat, 0.0), cs.get(cat, 0.0)
        drift = cv - bv
        limit = th.limit(stage, metric)
        status = "unchanged" if abs(round(drift, 9)) <= limit else "REGRESSED"
        rows.append(_row(stage, metric, bv, cv, drift, limit, None, status, unit="pp"))
    return rows


def _gate_row(stage: str, b: StageRecord, c: StageRecord, notes: list[str]) -> dict:
    bg, cg = b.gate.status, c.gate.status
    if cg == "FAIL" and bg != "FAIL":
        status = "FAIL gate"
        reason = c.gate.reason
        notes.append(f"stage '{stage}': correctness gate {bg} -> FAIL" + (f" ({reason})" if reason else ""))
    elif bg == "FAIL":
        status = "unchanged" if cg == "FAIL" else "improved"
        if cg == "FAIL":
            notes.append(f"stage '{stage}': correctness gate FAILs in the baseline too")
    else:
        status = "unchanged"
    return _row(stage, "gate", bg, cg, None, None, None, status, unit="")


def _dtype_row(stage: str, b: StageRecord, c: StageRecord, notes: list[str]) -> dict | None:
    bd, cd = b.activation_dtypes, c.activation_dtypes
    if not bd or not cd:
        return None
    changed = [p for p in bd if p in cd and bd[p] != cd[p]]
    if not changed:
        return _row(stage, "activation_dtypes", "same", "same", None, None, None, "unchanged", unit="")
    notes.append(f"stage '{stage}': activations changed dtype: "
                 + ", ".join(f"{p} {short_dtype(bd[p])} -> {short_dtype(cd[p])}" for p in changed)
                 + "; refresh the baseline if that is intended")
    return _row(stage, "activation_dtypes", " ".join(f"{p}:{short_dtype(bd[p])}" for p in changed),
                " ".join(f"{p}:{short_dtype(cd[p])}" for p in changed), None, None, None, "REGRESSED", unit="")


def _stage_rows(stage: str, bs: _Stage | None, cs: _Stage | None, th: Thresholds, notes: list[str],
                allow_missing: bool = True) -> list[dict]:
    b, c = bs and bs.record, cs and cs.record
    if b is None or c is None:
        if c is not None and c.gate.status == "FAIL":
            notes.append(f"stage '{stage}' (only in current) FAILs its correctness gate"
                         + (f" ({c.gate.reason})" if c.gate.reason else ""))
            return [_row(stage, "gate", None, "FAIL", None, None, None, "FAIL gate", unit="")]
        status = ("only in current" if b is None else
                  "MISSING" if b.ok and not allow_missing else "only in baseline")
        return [_row(stage, "stage", b and b.status, c and c.status, None, None, None, status, unit="")]
    if not b.ok or not c.ok:
        # A stage that ran and now errors is lost work: count it; one that ran and is now not available
        # here (a kernel that no longer loads) is MISSING. Otherwise just list it.
        status = ("REGRESSED" if (b.ok and c.status == "error") else
                  "MISSING" if (b.ok and not allow_missing) else "not compared")
        for side, rec in (("baseline", b), ("current", c)):
            if not rec.ok:
                notes.append(f"stage '{stage}' is '{rec.status}' in {side}"
                             + (f": {rec.error}" if rec.error else "") + "; not compared")
        return [_row(stage, "stage", b.status, c.status, None, None, None, status, unit="")]
    rows = []
    for metric in PCT_METRICS:
        row = _pct_row(stage, metric, bs, cs, th, allow_missing) if metric not in DP_METRICS else None
        if row is not None:
            rows.append(row)
    rows += _share_rows(stage, b, c, th)
    rows.append(_gate_row(stage, b, c, notes))
    dtypes = _dtype_row(stage, b, c, notes)
    if dtypes is not None:
        rows.append(dtypes)
    return rows + _scaling_rows(stage, bs, cs, th, notes)


def _scaling_rows(stage: str, bs: _Stage, cs: _Stage, th: Thresholds, notes: list[str]) -> list[dict]:
    """The stage's `apply --nproc` figures (DP_METRICS and the gate on every rank) when both records hold
    them; one `dp` row when one side has none or either did not run ('error' after 'ok' is REGRESSED)."""
    b, c = bs.record.scaling, cs.record.scaling
    if b is None and c is None:
        return []
    if b is None or c is None:
        return [_row(stage, "dp", b and f"{b.world_size} ranks", c and f"{c.world_size} ranks", None, None, None,
                     "only in baseline" if c is None else "only in current", unit="")]
    if b.status != "ok" or c.status != "ok":
        for side, s in (("baseline", b), ("current", c)):
            if s.status != "ok":
                notes.append(f"stage '{stage}': data parallel '{s.status}' in {side}"
                             + (f": {s.reason}" if s.reason else ""))
        status = "REGRESSED" if (b.status == "ok" and c.status == "error") else "not compared"
        return [_row(stage, "dp", b.status, c.status, None, None, None, status, unit="")]
    rows = [row for row in (_pct_row(stage, m, bs, cs, th) for m in DP_METRICS) if row is not None]
    if any(r["status"] == "REGRESSED" for r in rows):
        def per_rank(s) -> str:
            return f"{' / '.join(f'{ms:.2f}' for ms in s.step_ms_per_rank)} ms (slowest: rank {_slowest_rank(s)})"

        notes.append(f"stage '{stage}': median step per rank {per_rank(b)} (baseline) -> {per_rank(c)} (current)")
    bg, cg = b.gate.get("status"), c.gate.get("status")
    status = "FAIL gate" if cg == "FAIL" and bg != "FAIL" else ("improved" if bg == "FAIL" and cg != "FAIL"
                                                                 else "unchanged")
    if status == "FAIL gate":
        ranks = c.gate.get("ranks") or []
        notes.append(f"stage '{stage}': data-parallel gate {bg} -> FAIL"
                     + (f" (by rank: {', '.join(ranks)})" if ranks else "")
                     + (f" ({c.gate['reason']})" if c.gate.get("reason") else ""))
    return rows + [_row(stage, "dp_gate", bg, cg, None, None, None, status, unit="")]


def _summary(rows: pd.DataFrame, regressed: bool) -> str:
    counts = rows["status"].value_counts()
    stages = rows["stage"].nunique()
    tail = ", ".join(f"{int(counts[s])} {s}" for s in STATUSES if s in counts and s not in REGRESSION_STATUSES)
    if not regressed:
        return f"OK: no regression in {len(rows)} checks over {stages} stages ({tail})"
    bad = rows[rows["status"].isin(REGRESSION_STATUSES)]
    parts = []
    for stage, group in bad.groupby("stage", sort=False):
        items = [f"{r.metric} {_fmt_delta(r.delta_pct, r.unit)}" if r.delta_pct is not None and not pd.isna(r.delta_pct)
                 else f"{r.metric} {_said(r.metric, r.baseline)} -> {_said(r.metric, r.current)}"
                 for r in group.itertuples()]
        parts.append(f"{stage}: {', '.join(items)}")
    n_stages = bad["stage"].nunique()
    return (f"REGRESSED: {len(bad)} of {len(rows)} checks in {n_stages} stage{'s' if n_stages > 1 else ''} "
            f"({'; '.join(parts)})" + (f"; {tail}" if tail else ""))


def check_records(baseline_paths, current_paths, *, max_regression_pct: float = DEFAULT_MAX_REGRESSION_PCT,
                  thresholds_file=None, force: bool = False,
                  max_share_drift_pp: float = DEFAULT_SHARE_DRIFT_PP, allow_missing: bool = False) -> CheckResult:
    """Compare current stage records with baseline ones (each: a path or list of files/folders).

    `max_regression_pct` limits img_per_s, step_ms, peak_mem_bytes and speedup; `max_share_drift_pp`
    limits kernel category share drift; a thresholds YAML file, when given, replaces both and adds
    per-stage limits. `force` compares records of different settings, GPUs or versions, with a note.
    `allow_missing`: stages and measurements of the baseline that current lacks do not fail.
    Raises UserError (exit 2) for unreadable records, bad thresholds or, without `force`, mismatches."""
    for name, value in (("--max-regression", max_regression_pct), ("--max-share-drift", max_share_drift_pp)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise UserError(f"{name} must be a number >= 0 (finite), got {short_repr(value)}")
    th = load_thresholds(thresholds_file, max_regression_pct=float(max_regression_pct),
                         share_drift_pp=float(max_share_drift_pp))
    notes: list[str] = []
    base = _load_side(baseline_paths, "baseline", notes)
    cur = _load_side(current_paths, "current", notes)
    _check_settings(base, cur, force, notes)
    for stage in th.stages:
        if stage not in base and stage not in cur:
            notes.append(f"thresholds name stage '{stage}', which no record has")

    stages = list(base) + [s for s in cur if s not in base]
    rows = []
    for stage in stages:
        rows += _stage_rows(stage, base.get(stage), cur.get(stage), th, notes, allow_missing)
    only_base = [s for s in base if s not in cur]
    only_cur = [s for s in cur if s not in base]
    if only_base and allow_missing:
        notes.append(f"only in baseline (not checked): {', '.join(only_base)}")
    elif only_base:
        notes.append(f"missing from current: {', '.join(only_base)} (--allow-missing lets a run of fewer stages "
                     "pass)")
    if only_cur:
        notes.append(f"only in current (no baseline to check against): {', '.join(only_cur)}")
    frame = pd.DataFrame(rows, columns=ROW_COLUMNS)
    regressed = bool(frame["status"].isin(REGRESSION_STATUSES).any())
    changes = _kernel_changes(frame, base, cur)
    return CheckResult(rows=frame, regressed=regressed, summary=_summary(frame, regressed), notes=notes,
                       kernel_changes=changes, words=record_words([s.record for s in (*base.values(), *cur.values())]))


KERNEL_CHANGE_ROWS = 5


def _kernel_changes(frame: pd.DataFrame, base: dict, cur: dict) -> dict:
    """For each stage with a regressed row whose baseline and current records both hold per-kernel
    profile tables: the KERNEL_CHANGE_ROWS kernels whose GPU ms per step changed most."""
    from workbench.analysis.diff import join_per_unit

    out = {}
    # the records' profiles are of the one-process stage: data-parallel rows do not point at them
    one_process = ~frame["metric"].str.startswith("dp")
    for stage in frame.loc[frame["status"].isin(REGRESSION_STATUSES) & one_process, "stage"].unique():
        fb, fc = _kernels(base.get(stage)), _kernels(cur.get(stage))
        if fb is not None and fc is not None:
            out[str(stage)] = join_per_unit(fb, fc, "kernel").head(KERNEL_CHANGE_ROWS)
    return out


def _kernels(entry: _Stage | None):
    profile = entry.record.profile if entry is not None else None
    return profile.kernels_frame() if profile is not None else None


# ---------------------------------------------------------------- rendering


def _fmt_delta(delta, unit: str) -> str:
    if delta is None or (isinstance(delta, float) and math.isnan(delta)):
        return "—"
    if math.isinf(delta):
        return "+∞%" if delta > 0 else "−∞%"
    sign = "+" if delta > 0 else ("−" if delta < 0 else "")
    return f"{sign}{abs(delta):.1f}{' pp' if unit == 'pp' else '%'}"


def _said(metric: str, value) -> str:
    """A value in the one-line summary: as the table shows it, 'missing' for none."""
    text = _fmt_value(metric, value)
    return "missing" if text == "—" else text


def _fmt_value(metric: str, value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, str):
        return value
    if metric in ("img_per_s", "dp_img_per_s"):
        return f"{value:,.1f}"
    if metric in ("step_ms", "graph_ms", "dp_step_ms"):
        return f"{value:.2f} ms"
    if metric == "dp_efficiency":
        return f"{value:.3f}"
    if metric == "peak_mem_bytes":
        return f"{value / 2**30:.2f} GiB"
    if metric in ("speedup", "paired_speedup") or metric.startswith("paired_speedup"):
        return f"{value:.2f}×"
    if metric.endswith("_per_step"):
        return f"{value:,.1f}"
    if metric.startswith(SHARE_PREFIX):
        return f"{value:.1f}%"
    return str(value)


def _fmt_limit(value, unit: str, prefix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{prefix}{round(value, 1):g}{' pp' if unit == 'pp' else '%'}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _folded_share_row(stage: str, shares: pd.DataFrame) -> list[str]:
    """Unchanged category shares of one stage, folded into one line (the table stays readable)."""
    worst = shares.loc[shares["delta_pct"].abs().idxmax()]
    limits = sorted(set(shares["limit"]))
    limit = _fmt_limit(limits[0], "pp") if len(limits) == 1 else "per category"
    drift = _fmt_delta(worst["delta_pct"], "pp")
    if worst["delta_pct"] != 0:
        drift = f"max {drift} ({worst['metric'][len(SHARE_PREFIX):]})"
    return [stage, f"share: {len(shares)} categories", "—", "—", drift,
            limit, "—", "unchanged"]


MD_HEADER = "| stage | metric | baseline | current | Δ | limit | noise band | status |"
CPU_NOTE = "**CPU records** (no GPU): times, shares and changes are CPU figures, not GPU ones."
MIXED_NOTE = ("**CPU and GPU records** (compared with --force): one side's figures are CPU figures, the other's "
              "GPU ones; a change between them is the device's, not the code's.")


def refuse_among_records(output: Path) -> None:
    """UserError (one line) when `output` would be a *.json in a folder of stage records (a run's records/),
    where every later report and check would read it as a record and refuse the folder."""
    from workbench.run_folder import stage_record_in

    output = Path(output)
    folder = output.parent
    if output.suffix.lower() != ".json" or output.name.startswith("_") or (folder / "records").is_dir():
        return
    if stage_record_in(folder, besides=output) is not None:
        raise UserError(f"--out {output}: report and check read every *.json in {folder} as a stage record; "
                        "write the table elsewhere (or name it _*.json, which they skip)")


def is_check_output(head: str) -> bool:
    """Whether a file's first characters are a table `swinbench check --out` wrote (Markdown or JSON)."""
    return head.startswith((MD_HEADER, CPU_NOTE, MIXED_NOTE)) or '"schema": "swinbench.check/' in head[:200]


def render_markdown(result: CheckResult) -> str:
    """A Markdown table (stage, metric, baseline, current, signed Δ, limit, noise band, status),
    then the notes, then the one-line summary. Unchanged category shares of a stage are folded
    into one row; every other row is shown."""
    w = result.words
    lines = [CPU_NOTE, ""] if w.is_cpu else [MIXED_NOTE, ""] if w == MIXED_WORDS else []
    lines += [MD_HEADER, "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    rows = result.rows
    quiet_share = rows["metric"].str.startswith(SHARE_PREFIX) & (rows["status"] == "unchanged")
    folded_done = set()
    for i, r in enumerate(rows.itertuples()):
        if quiet_share.iloc[i]:
            if r.stage in folded_done:
                continue
            folded_done.add(r.stage)
            cells = _folded_share_row(r.stage, rows[quiet_share & (rows["stage"] == r.stage)])
        else:
            status = f"**{r.status}**" if r.status in REGRESSION_STATUSES else r.status
            cells = [r.stage, r.metric, _fmt_value(r.metric, r.baseline), _fmt_value(r.metric, r.current),
                     _fmt_delta(r.delta_pct, r.unit), _fmt_limit(r.limit, r.unit),
                     _fmt_limit(r.noise_band_pct, "%", "±"), status]
        lines.append("| " + " | ".join(_cell(x) for x in cells) + " |")
    for stage, table in result.kernel_changes.items():
        lines += ["", f"Largest {w.unit} changes in **{_cell(stage)}** ({w.device} ms per step, from the two records' "
                  "profiles):", "",
                  f"| {w.unit} | baseline ms | current ms | Δ ms | {w.calls} baseline | {w.calls} current |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for k, bm, cm, d, bn, cn in table[["kernel", "before_ms", "after_ms", "delta_ms", "before_n", "after_n"]].values:
            lines.append(f"| `{_cell(str(k))}` | {bm:.3f} | {cm:.3f} | {d:+.3f} | {bn:.0f} | {cn:.0f} |")
    if result.notes:
        lines += ["", "Notes:", ""] + [f"- {_cell(n)}" for n in result.notes]
    lines += ["", f"**{result.summary}**"]
    return "\n".join(lines) + "\n"


def _plain(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):   # numpy scalars
        return _plain(value.item())
    return value


def to_json(result: CheckResult) -> dict:
    """{schema, regressed, exit_code, device ('CPU' | 'GPU' | 'CPU/GPU'), summary, notes, rows: [{column: value}],
    kernel_changes: {stage: [{kernel, before_ms, after_ms, delta_ms, before_n, after_n}]}}; NaN/inf become null."""
    rows = [{k: _plain(v) for k, v in row.items()} for row in result.rows.astype(object).to_dict(orient="records")]
    changes = {stage: [{k: _plain(v) for k, v in r.items()} for r in table.astype(object).to_dict(orient="records")]
               for stage, table in result.kernel_changes.items()}
    return {"schema": "swinbench.check/1", "regressed": result.regressed, "exit_code": result.exit_code,
            "device": result.words.device, "summary": result.summary, "notes": list(result.notes), "rows": rows, "kernel_changes": changes}
