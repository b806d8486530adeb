"""The stage record and its one reader: the committed /1 records load, a written record reads back the
same, and every field that is not as the schema says is refused with one line naming the file, the stage
and the field."""
import json
import math
from pathlib import Path

import pytest

from record_helpers import ENV, record
from workbench.errors import UserError
from workbench.results.record import (MAX_RECORD_BYTES, SCHEMA, StageRecord, as_records, read_record, read_records,
                               write_record)

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = sorted({p.parent for p in [*ROOT.glob("reports/*/records/*.json"), *ROOT.glob("tests/data/records/*/*.json")]})


def test_committed_v1_records_load_and_round_trip():
    """Every committed record (schema /1, /2 or /3) reads, and writes as /3 that reads back to the same record."""
    records = read_records(COMMITTED)
    assert len({Path(r.source).parent for r in records}) == len(COMMITTED) >= 4
    schemas = [json.loads(Path(rec.source).read_text())["schema"] for rec in records]
    assert set(schemas) <= {"swinbench.stage/1", "swinbench.stage/2", SCHEMA} and "swinbench.stage/1" in schemas
    for rec in records:
        data = rec.to_dict()
        assert data["schema"] == SCHEMA == "swinbench.stage/3"
        assert StageRecord.from_dict(json.loads(json.dumps(data))) == rec


def test_written_record_round_trips(tmp_path):
    rec = record(1, "amp", "baseline", 50.0, shares={"gemm": 60.0, "other": 40.0})
    rec["interleaved"] = {"rounds": 2, "rounds_planned": 3, "block": 3, "with": ["baseline", "amp"], "step_ms": 50.0,
                          "iqr_ms": 0.5, "samples_ms": [49.5, 50.0, 50.5, 49.0, 50.0, 51.0],
                          "round_median_ms": [50.0, 50.0],
                          "first_stage": "baseline", "x_first": {"median": 2.0, "q1": 1.9, "q3": 2.1},
                          "previous_stage": "baseline", "x_previous": {"median": 2.0, "q1": 1.9, "q3": 2.1}}
    rec["passes"][0]["details"] = {"betas": (0.9, 0.999), "dtype": math}   # a tuple and a non-JSON object
    path = write_record(rec, tmp_path)
    assert path.name == "01-amp.json"
    (back,) = read_records([tmp_path])
    written = json.loads(path.read_text())
    assert written == back.to_dict() and written["schema"] == SCHEMA
    assert written["passes"][0]["details"] == {"betas": [0.9, 0.999], "dtype": str(math)}
    assert back.interleaved.x_previous.median == 2.0 and back.timing.repeats == 4 and back.env.gpu == "NVIDIA H200"
    assert write_record(back, tmp_path / "again").read_text() == path.read_text()


def test_a_record_the_reader_would_refuse_is_not_written(tmp_path):
    rec = record(1, "amp", "baseline", 50.0)
    rec["img_per_s"] = float("nan")
    with pytest.raises(UserError, match="'img_per_s'"):
        write_record(rec, tmp_path)
    assert not list(tmp_path.iterdir())


def _stored(tmp_path, rec) -> Path:
    path = tmp_path / "01-amp.json"
    path.write_text(json.dumps(rec))
    return path


def _set(path: str, value):
    """An edit of the record: set the field at dotted `path` ([i] for list items) to `value`."""
    def edit(rec):
        *parents, last = path.replace("[", ".[").split(".")
        node = rec
        for key in parents:
            node = node[int(key[1:-1])] if key.startswith("[") else node[key]
        if last.startswith("["):
            node[int(last[1:-1])] = value
        else:
            node[last] = value
    return edit


def _drop(path: str):
    def edit(rec):
        *parents, last = path.split(".")
        node = rec
        for key in parents:
            node = node[key]
        del node[last]
    return edit


NAN, INF = float("nan"), float("inf")

BAD_FIELDS = [
    ("img_per_s", NAN), ("img_per_s", INF), ("img_per_s", -INF), ("img_per_s", None), ("img_per_s", 0),
    ("img_per_s", -5.0), ("img_per_s", "fast"), ("img_per_s", [900.0]), ("img_per_s", True),
    ("step_ms", {"median": 1.0}), ("step_iqr_ms", -0.1), ("step_iqr_ms", None),
    ("peak_mem_bytes", 10**30), ("peak_mem_bytes", 1.5e9), ("peak_mem_bytes", "13 GiB"), ("peak_mem_bytes", None),
    ("stage_index", "two"), ("stage_index", True), ("stage_index", -1), ("stage_index", 10**6), ("stage_index", 1.0),
    ("run_id", 5), ("run_id", ""), ("run_id", "a\nb"), ("model", ["swin"]), ("batch", 0), ("batch", 64.0),
    ("seed", -1), ("status", "done"), ("mode", "eval"), ("error", 3), ("extends", 1), ("notes", "one note"),
    ("notes", [1]), ("chain", {"name": "amp"}), ("stage_passes", [None]), ("activation_dtypes", ["bf16"]),
    ("compile_s", NAN), ("compile_s", 0.0), ("first_step_s", "1 s"),
    ("timing", None), ("timing", [71.0]), ("timing.samples_ms", []), ("timing.samples_ms[1]", NAN),
    ("timing.samples_ms[0]", "71"), ("timing.repeats", 3), ("timing.median_ms", 0.0), ("timing.iqr_ms", INF),
    ("timing.clock", "wall"), ("timing.warmup", -1),
    ("env", "cuda"), ("env.device_type", "tpu"), ("env.gpu", None), ("env.gpu", 200), ("env.torch", 2.5),
    ("env.gpu_count", "one"), ("env.swinbench_env", {"SWINBENCH_X": 1}), ("env.extra_thing", {"nested": 1}),
    ("gate", None), ("gate.status", "MAYBE"), ("gate.tolerance.logits_rel", INF), ("gate.tolerance.logits_rel", "5%"),
    ("gate.metrics.logits.rel_l2", NAN), ("gate.metrics.logits.rel_l2", "small"), ("gate.reason", ["x"]),
    ("gate.metrics.grads", [1.0]),
    ("profile.category_share_pct.gemm", NAN), ("profile.category_share_pct.gemm", 150.0),
    ("profile.category_share_pct.gemm", -1.0), ("profile.category_share_pct", [60.0]),
    ("profile.kernel_ms_per_step", 0.0), ("profile.api_calls_per_step", {"launch": "many"}),
    ("profile.kernels_per_step", [{"kernel": "gemm", "ms_per_step": INF, "per_step": 1.0}]),
    ("profile.kernels_per_step", [{"kernel": 7, "ms_per_step": 1.0, "per_step": 1.0}]),
    ("profile.backend", None),
    ("passes[0].available", "yes"), ("passes[0].name", None), ("passes[0].params", [1]),
    ("interleaved", {"rounds": 2}),
    ("img_per_sec", 900.0),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r}"[:60] for f, v in BAD_FIELDS])
def test_a_field_that_is_not_as_the_schema_says_is_refused(tmp_path, field, value):
    rec = record(1, "amp", "baseline", 50.0, shares={"gemm": 60.0, "other": 40.0})
    rec["profile"]["kernels_per_step"] = [{"kernel": "gemm", "ms_per_step": 1.0, "per_step": 4.0}]
    _set(field, value)(rec)
    path = _stored(tmp_path, rec)
    with pytest.raises(UserError) as info:
        read_records([path])
    text = str(info.value)
    assert info.value.exit_code == 2 and "\n" not in text
    assert str(path) in text and "(stage 'amp')" in text
    top = field.split(".")[0].split("[")[0]
    assert top in text, text


@pytest.mark.parametrize("field", ["run_id", "stage_index", "status", "model", "env", "gate", "img_per_s",
                                   "timing", "env.gpu", "env.torch", "gate.status", "timing.samples_ms"])
def test_a_missing_required_field_is_named(tmp_path, field):
    rec = record(1, "amp", "baseline", 50.0)
    _drop(field)(rec)
    with pytest.raises(UserError, match=f"lacks required field '{field}'"):
        read_records([_stored(tmp_path, rec)])


def test_a_stage_that_did_not_run_may_leave_its_measurements_null(tmp_path):
    for status in ("not available", "error"):
        (rec,) = as_records([record(2, "fmha", "amp", 10.0, status=status)])
        assert rec.img_per_s is None and rec.timing is None and rec.error
    with pytest.raises(UserError, match="'error' must say why"):
        as_records([dict(record(2, "fmha", "amp", 10.0, status="error"), error=None)])


def test_peak_memory_is_null_on_the_cpu_only():
    cpu = dict(record(0, "baseline", None, 10.0), env={**ENV, "device_type": "cpu", "gpu": None},
               peak_mem_bytes=None)
    assert as_records([cpu])[0].peak_mem_bytes is None and as_records([cpu])[0].env.device_name == "CPU"
    with pytest.raises(UserError, match="'peak_mem_bytes'"):
        as_records([dict(record(0, "baseline", None, 10.0), peak_mem_bytes=None)])


def test_gate_metrics_may_be_nan_only_where_the_gate_did_not_pass():
    failed = record(1, "amp", "baseline", 50.0, gate="FAIL")
    failed["gate"]["metrics"]["logits"]["rel_l2"] = NAN
    assert math.isnan(as_records([failed])[0].gate.metrics.logits.rel_l2)
    with pytest.raises(UserError, match="gate.metrics.logits.rel_l2"):
        as_records([dict(failed, gate={**failed["gate"], "status": "PASS"})])


@pytest.mark.parametrize("content,needle", [
    (b"{not json", "not valid JSON"),
    (b'{"schema": "swinbench.stage/1", "stage": "\xff"}', "not UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (b'{"schema": "swinbench.stage/1", "stage": "amp", "batch": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b"[1, 2]", "not a swinbench stage record"),
    (b'{"schema": "swinbench.stage/9", "stage": "amp"}', "not a swinbench stage record"),
])
def test_unreadable_files_are_one_line_errors(tmp_path, content, needle):
    path = tmp_path / "01-amp.json"
    path.write_bytes(content)
    with pytest.raises(UserError, match=needle) as info:
        read_record(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_a_record_file_over_the_size_bound_is_not_read(tmp_path):
    rec = record(1, "amp", "baseline", 50.0)
    rec["notes"] = ["x" * (MAX_RECORD_BYTES + 10)]
    path = _stored(tmp_path, rec)
    with pytest.raises(UserError, match="larger than"):
        read_records([path])


def test_stage_names_cannot_leave_the_records_folder(tmp_path):
    with pytest.raises(UserError, match="'stage' must be a name without '/'"):
        write_record(dict(record(1, "amp", "baseline", 50.0), stage="../../elsewhere"), tmp_path / "records")


def test_ancestors_follow_the_stored_chain():
    chain = [{"name": n, "source": None, "passes": []} for n in ("baseline", "amp", "apex", "window", "fmha")]
    (rec,) = as_records([dict(record(4, "fmha", "window", 10.0), chain=chain)])
    assert rec.ancestors() == ["window", "apex", "amp", "baseline"]
    assert as_records([record(4, "fmha", "window", 10.0)])[0].ancestors() == ["window"]
    assert as_records([record(0, "baseline", None, 10.0)])[0].ancestors() == []
