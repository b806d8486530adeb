"""Kernels against their memory floor: the launch log (every eager Triton launch with the bytes of its
arguments), the match of a trace's instances to the logged launches, and the table `analyze` and
`profile` show and write."""
import json
import os

import pandas as pd
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.analysis.floors import COLUMNS, kernel_floors, peak_gbps  # noqa: E402
from workbench.kernels._common import argument_bytes, launch_log  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_log_holds_every_launch_of_a_forward_and_its_backward_with_their_argument_bytes():
    from workbench.kernels.layer_norm import layer_norm

    x = torch.randn(37, 96, device=DEVICE, requires_grad=True)
    w = torch.randn(96, device=DEVICE, requires_grad=True)
    b = torch.randn(96, device=DEVICE, requires_grad=True)
    with launch_log() as log:
        layer_norm(x, w, b, 1e-5).sum().backward()      # the backward launches from autograd's thread
    names = [e["kernel"] for e in log]
    assert names[0] == "_layer_norm_fwd_kernel" and "_layer_norm_bwd_kernel" in names
    fwd = log[0]
    assert [37, 96] in [t[0] for t in fwd["tensors"]]
    assert fwd["bytes"] >= 2 * 37 * 96 * 4 + 2 * 96 * 4       # reads x, w, b and writes y at least
    with launch_log() as quiet:
        pass
    assert quiet == []
    layer_norm(x, w, b, 1e-5)       # outside the block: nothing is logged anywhere
    assert len(log) == len(names)


def test_argument_bytes_counts_each_tensor_once_and_views_by_their_extent():
    qkv = torch.zeros(4, 10, 3 * 8)
    q, k, v = qkv.split(8, dim=-1)
    total, tensors = argument_bytes((q, k, v, q, 3, 1.5), {"out": torch.zeros(2, dtype=torch.bfloat16)})
    assert total == 3 * 4 * 10 * 8 * 4 + 2 * 2
    assert tensors[-1] == [[2], "bfloat16"] and len(tensors) == 4


@pytest.mark.parametrize("name, peak", [("NVIDIA H200", 4800.0), ("NVIDIA H100 PCIe", 2000.0),
                                        ("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA A100-SXM4-80GB", 2039.0),
                                        ("NVIDIA A100-SXM4-40GB", 1555.0), ("Some Future GPU", None), (None, None)])
def test_peak_bandwidth_by_gpu_name(name, peak):
    assert peak_gbps(name) == peak


def _kernels(rows):
    """A kernels frame as the trace layer gives it: (name, start_ns, duration_ns) rows."""
    return pd.DataFrame({"name": [r[0] for r in rows], "short_name": [r[0] for r in rows],
                         "start_ns": [r[1] for r in rows], "duration_ns": [r[2] for r in rows]})


def _launches(entries, device="NVIDIA H200"):
    return {"schema": "swinbench.launches/1", "device_name": device, "step": 0,
            "launches": [{"kernel": k, "bytes": b, "largest": [shape, "bfloat16"]} for k, b, shape in entries]}


def test_instances_take_their_launch_bytes_in_order_step_after_step():
    # a step launches attn twice (stage 1, then stage 2) and norm once; the trace holds two steps
    launches = _launches([("attn", 4_800_000, [64, 49, 96]), ("norm", 9_600_000, [64, 3136]),
                          ("attn", 2_400_000, [16, 49, 192])])
    kernels = _kernels([("attn", 0, 4_000), ("norm", 10_000, 4_000), ("attn", 20_000, 1_000),
                        ("attn", 100_000, 2_000), ("norm", 110_000, 2_000), ("attn", 120_000, 1_000),
                        ("gemm", 130_000, 50_000)])
    table, summary = kernel_floors(kernels, launches)
    assert list(table.columns) == COLUMNS and summary["steps"] == [2] and summary["note"] is None
    rows = {(r.kernel, r.largest_argument): r for r in table.itertuples()}
    big = rows[("attn", "64x49x96 bfloat16")]
    # 4.8 MB at 4,800 GB/s: 1 µs; measured 4 and 2 µs, median 3
    assert big.calls_per_step == 1 and big.median_us == pytest.approx(3.0) and big.floor_us == pytest.approx(1.0)
    assert big.floor_pct == pytest.approx(100 / 3) and big.achieved_gbps == pytest.approx(1600.0)
    small = rows[("attn", "16x49x192 bfloat16")]
    assert small.median_us == pytest.approx(1.0) and small.floor_pct == pytest.approx(50.0)
    assert rows[("norm", "64x3136 bfloat16")].floor_us == pytest.approx(2.0)
    assert table.iloc[0]["us_per_step"] == table["us_per_step"].max()       # most time per step first
    assert summary["kernel_us_per_step"] == pytest.approx(3 + 1 + 3)
    assert summary["floor_us_per_step"] == pytest.approx(1 + 0.5 + 2)
    assert "gemm" not in set(table["kernel"])       # not ours: no floor, not reported as unmatched either


def test_launches_of_one_shape_that_differ_in_a_small_argument_share_a_row():
    # the shifted block's attention also reads its mask: a few more bytes, the same largest argument
    launches = _launches([("attn", 4_800_000, [64, 49, 96]), ("attn", 5_280_000, [64, 49, 96])])
    kernels = _kernels([("attn", 0, 2_000), ("attn", 10_000, 4_000), ("attn", 20_000, 2_000), ("attn", 30_000, 4_000)])
    table, summary = kernel_floors(kernels, launches)
    assert len(table) == 1 and table.loc[0, "calls_per_step"] == 2 and summary["steps"] == [2]
    assert table.loc[0, "median_us"] == pytest.approx(3.0) and table.loc[0, "floor_us"] == pytest.approx(1.05)
    assert summary["floor_us_per_step"] == pytest.approx(2.1)


def test_each_row_names_the_configuration_its_autotuner_chose():
    launches = _launches([("attn", 4_800_000, [64, 49, 96]), ("norm", 9_600_000, [64, 3136])])
    launches["launches"][0]["config"] = "G=8 BLOCK_M=16 warps=4 stages=2"
    kernels = _kernels([("attn", 0, 2_000), ("norm", 10_000, 4_000)])
    table, _ = kernel_floors(kernels, launches)
    configs = dict(zip(table["kernel"], table["config"]))
    assert configs == {"attn": "G=8 BLOCK_M=16 warps=4 stages=2", "norm": ""}   # norm: no autotuner


def test_a_logged_launch_takes_the_config_its_autotuner_ran():
    import triton

    from workbench.kernels._common import _LoggedLaunch, config_label

    class Tuned:   # an autotuner as the log sees it: best_config is set by the run
        fn = None
        best_config = None

    tuned, log = Tuned(), []
    config = triton.Config({"G": 8, "TILE_FASTEST": True}, num_warps=4, num_stages=2)

    def run(*args):
        tuned.best_config = config
    _LoggedLaunch({(1,): run}, tuned, log)[(1,)](torch.zeros(4))
    assert log[0]["config"] == config_label(tuned) == "G=8 TILE_FASTEST=True warps=4 stages=2"
    assert config_label(object()) is None


def test_what_cannot_be_matched_is_named_and_left_out():
    launches = _launches([("attn", 1000, [4]), ("attn", 1000, [4]), ("merge", 10, [1]), ("gone", 10, [1])])
    kernels = _kernels([("attn", 0, 10), ("attn", 10, 10), ("attn", 20, 10), ("merge", 30, 5)])
    table, summary = kernel_floors(kernels, launches)
    assert set(table["kernel"]) == {"merge"}
    assert summary["unmatched"] == {"attn": "3 instances in the trace, 2 launches per step", "gone": "not in the trace"}


@pytest.mark.parametrize("device, says", [("Some Future GPU", "peak bandwidth of Some Future GPU is not known"),
                                          (None, "ran on the CPU")])
def test_no_floors_without_a_known_gpu(device, says):
    table, summary = kernel_floors(_kernels([("attn", 0, 10)]), _launches([("attn", 10, [1])], device))
    assert table.empty and says in summary["note"]


def _kineto_trace(folder, kernels):
    ev = []
    for i, (name, ts, dur) in enumerate(kernels):
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 2, "ts": ts - 1,
                   "dur": 0.5, "args": {"correlation": i + 1}})
        ev.append({"ph": "X", "cat": "kernel", "name": name, "pid": 1, "tid": 2, "ts": ts, "dur": dur,
                   "args": {"device": 0, "stream": 7, "correlation": i + 1}})
    path = folder / "trace.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": ev}))
    return path


def test_analyze_shows_and_writes_the_floors_of_a_trace_with_its_launches_beside_it(tmp_path):
    from typer.testing import CliRunner

    from cli import app

    trace = _kineto_trace(tmp_path, [("_attn_kernel", 100.0, 4.0), ("gemm", 110.0, 20.0),
                                     ("_attn_kernel", 200.0, 2.0), ("gemm", 210.0, 20.0)])
    (tmp_path / "launches.json").write_text(json.dumps(_launches([("_attn_kernel", 9_600_000, [64, 49, 96])])))
    out = tmp_path / "tables"
    result = CliRunner().invoke(app, ["analyze", str(trace), "--format", "csv", "--out", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "against their memory floor" in result.output and "64x49x96 bfloat16" in result.output
    floors = pd.read_csv(out / "floors.csv")
    assert floors.loc[0, "kernel"] == "_attn_kernel" and floors.loc[0, "floor_pct"] == pytest.approx(200 / 3)
    # a broken launches file: one warning line, the rest of the analysis as before
    (tmp_path / "launches.json").write_text("{not json")
    result = CliRunner().invoke(app, ["analyze", str(trace)], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "launches.json beside the trace is not a swinbench.launches/1 file" in result.output
    assert "against their memory floor" not in result.output


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU capture path: on a GPU machine the worker's "
                    "kernels are compiled for the GPU, not interpreted for CPU tensors")
def test_profile_logs_the_warm_up_launches_beside_the_trace(tmp_path):
    from typer.testing import CliRunner

    from cli import app

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["profile", "--device", "cpu", "--batch", "1", "--steps", "1", "--warmup", "1",
                                      "--recipe", "fmha", "--out", str(out)],
                                 env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "launches.json").read_text())
    assert doc["schema"] == "swinbench.launches/1" and doc["device_name"] is None and doc["step"] == 0
    kernels = {e["kernel"] for e in doc["launches"]}
    assert {"_window_attention_fwd_kernel", "_window_attention_bwd_kernel"} <= kernels
    assert all(e["bytes"] > 0 and len(e["largest"]) == 2 for e in doc["launches"])
    assert "no memory floors: the kernels ran on the CPU" in result.output


def test_a_profiled_stage_keeps_its_floors_in_the_record_and_the_report_shows_them(tmp_path):
    from record_helpers import record

    from workbench.results.record import StageRecord
    from workbench.results.report import render_report
    from workbench.errors import UserError

    floor = {"kernel": "_window_attention_bwd_kernel", "largest_argument": "4096x49x384 bfloat16",
             "calls_per_step": 2.0, "median_us": 71.3, "floor_us": 12.5, "floor_pct": 17.5}
    profile = {"backend": "nsys", "category_share_pct": {"attention": 20.0}, "floors": [floor],
               "floor_peak_gbps": 4800.0}
    rec = StageRecord.from_dict({**record(0, "fmha", None, 25.0), "profile": profile})
    assert rec.profile.floors[0].floor_pct == 17.5 and rec.profile.floor_peak_gbps == 4800.0
    again = StageRecord.from_dict(rec.to_dict())
    assert again.profile.floors == rec.profile.floors
    tuned = StageRecord.from_dict({**record(0, "fmha", None, 25.0),
                                   "profile": {**profile, "floors": [{**floor, "config": "G=8 warps=4"}]}})
    assert tuned.profile.floors[0].config == "G=8 warps=4"
    assert StageRecord.from_dict(tuned.to_dict()).profile.floors == tuned.profile.floors
    assert "config" not in again.to_dict()["profile"]["floors"][0]      # none recorded: none written
    plain = StageRecord.from_dict({**record(0, "amp", None, 25.0), "profile": {"backend": "nsys"}})
    assert "floors" not in plain.to_dict()["profile"]      # a profile without floors writes as before
    text = render_report([rec], tmp_path / "r.md").read_text()
    assert "## swinbench's kernels against their memory floor" in text and "4,800 GB/s" in text
    assert "| fmha | _window_attention_bwd_kernel | 4096x49x384 bfloat16 | 2 | 71.3 | 12.5 | 18% | 0.143 |" in text
    with pytest.raises(UserError, match="profile.floors"):
        StageRecord.from_dict({**record(0, "fmha", None, 25.0), "profile": {**profile, "floors": [{**floor, "x": 1}]}})


def test_a_stage_not_profiled_keeps_the_floors_of_its_gpu_time_steps_and_the_report_shows_them(tmp_path):
    from record_helpers import record

    from workbench.errors import UserError
    from workbench.results.record import StageRecord
    from workbench.results.report import render_report

    floor = {"kernel": "_window_attention_bwd_kernel", "largest_argument": "4096x49x384 bfloat16",
             "calls_per_step": 2.0, "median_us": 71.3, "floor_us": 12.5, "floor_pct": 17.5}
    gpu = {"kernel_ms": 22.0, "busy_pct": 66.0, "steps": 3, "source": "torch.profiler (CUPTI)"}
    rec = StageRecord.from_dict({**record(0, "fmha", None, 25.0), "gpu_time": {**gpu, "floors": [floor],
                                                                               "floor_peak_gbps": 4800.0}})
    assert rec.kernel_floors == (rec.gpu_time.floors, 4800.0) and rec.gpu_time.floors[0].floor_pct == 17.5
    assert StageRecord.from_dict(rec.to_dict()) == rec
    plain = StageRecord.from_dict({**record(0, "amp", None, 25.0), "gpu_time": gpu})
    assert plain.to_dict()["gpu_time"] == gpu and plain.kernel_floors == ((), None)
    # an nsys capture's floors, where the stage has one, come first
    nsys = {"backend": "nsys", "floors": [{**floor, "median_us": 60.0}], "floor_peak_gbps": 4800.0}
    both = StageRecord.from_dict({**rec.to_dict(), "profile": nsys})
    assert both.kernel_floors[0][0].median_us == 60.0
    text = render_report([rec], tmp_path / "r.md").read_text()
    assert "| fmha | _window_attention_bwd_kernel | 4096x49x384 bfloat16 | 2 | 71.3 | 12.5 | 18% | 0.143 |" in text
    with pytest.raises(UserError, match="gpu_time.floors"):
        StageRecord.from_dict({**record(0, "fmha", None, 25.0), "gpu_time": {**gpu, "floors": [{**floor, "x": 1}]}})


def test_apply_holds_the_kernels_of_its_gpu_time_steps_against_their_floor(monkeypatch):
    """`_step_floors` matches the kernels torch.profiler saw in the GPU-time steps to the launch log; a
    compiled stage logs one step of its own, run with the compile forced eager."""
    from workbench.ladder import apply as A
    from workbench.ladder.interleave import build_stage_workload
    from workbench.models import TINY_MODEL
    from workbench.optimize.workload import WorkloadConfig

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    workload, _ = build_stage_workload(WorkloadConfig(model=TINY_MODEL, batch=1, device=DEVICE), "fmha-compile")
    with launch_log() as step:
        workload.eager_step()
    # what the profiler saw over two steps: each launch once a step, 2 µs each, and a GEMM of cuBLAS's
    events = [(e["kernel"], 10_000 * i, 2_000) for i, e in enumerate(step * 2)] + [("gemm", 10**9, 50_000)]
    got = A._step_floors(workload, [], events, 2, torch.device(DEVICE))
    assert got["floor_peak_gbps"] == 4800.0 and len(got["floors"]) <= A.FLOOR_ROWS
    assert "_window_attention_bwd_kernel" in {f["kernel"] for f in got["floors"]}
    assert all(f["median_us"] == 2.0 and f["floor_pct"] > 0 for f in got["floors"])
    assert A._step_floors(workload, [], [], 2, torch.device(DEVICE)) == {}     # no GPU activity seen: none


def test_apply_holds_an_eager_stage_against_one_step_of_the_launches_it_logged(monkeypatch):
    """A stage as written launches its kernels from Python in the timed steps themselves: the log of the
    steps is cut to one step's launches, so that calls per step count one step."""
    from workbench.ladder import apply as A
    from workbench.ladder.interleave import build_stage_workload
    from workbench.models import TINY_MODEL
    from workbench.optimize.workload import WorkloadConfig

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(A, "FLOOR_ROWS", 1000)      # every row, not the costliest few
    workload, _ = build_stage_workload(WorkloadConfig(model=TINY_MODEL, batch=1, device=DEVICE), "fmha")
    workload.step(0)
    with launch_log() as log:
        workload.step(1)
        workload.step(2)
    one = len(log) // 2
    attn = sum(e["kernel"] == "_window_attention_fwd_kernel" for e in log[:one])
    events = [(e["kernel"], 10_000 * i, 2_000) for i, e in enumerate(log)]
    got = A._step_floors(workload, log, events, 2, torch.device(DEVICE))
    rows = [f for f in got["floors"] if f["kernel"] == "_window_attention_fwd_kernel"]
    assert sum(f["calls_per_step"] for f in rows) == attn
    assert A._step_floors(workload, log[:-1], events, 2, torch.device(DEVICE)) == {}   # uneven steps: none


def test_a_compiled_stage_logs_its_kernels_from_one_step_run_eagerly():
    """Under torch.compile on a GPU, Inductor launches swinbench's kernels itself and the launch log sees
    none; Workload.eager_step (which the capture runs before the warm-up of a compiled stage) launches the
    same kernels from Python with the compile forced eager, and compiles nothing."""
    from torch._dynamo.utils import counters

    from workbench.ladder.interleave import build_stage_workload
    from workbench.models import TINY_MODEL
    from workbench.optimize.workload import WorkloadConfig

    workload, _ = build_stage_workload(WorkloadConfig(model=TINY_MODEL, batch=1, device=DEVICE), "fmha-compile")
    assert workload.ctx.compile
    torch._dynamo.reset()
    counters.clear()
    with launch_log() as log:
        workload.eager_step()
    names = {e["kernel"] for e in log}
    assert {"_window_attention_fwd_kernel", "_window_attention_bwd_kernel"} <= names
    assert counters["stats"]["unique_graphs"] == 0


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_the_eager_step_launches_what_the_compiled_step_launches(mode):
    """The floors of a compiled stage take each launch's bytes from the eager step, matched to the trace's
    instances of the kernel in order: so the eager step takes the compiled step's branches (timm's stage
    forward, no deferred residual, torch's sums; `_common.as_compiled`) and launches every kernel with the
    same arguments in the same order. On the CPU the compiled graph calls the host functions back (opaque
    operators), so its launches are in the log too."""
    from workbench.ladder.interleave import build_stage_workload
    from workbench.models import TINY_MODEL
    from workbench.optimize.workload import WorkloadConfig

    workload, _ = build_stage_workload(WorkloadConfig(model=TINY_MODEL, batch=1, device=DEVICE, mode=mode),
                                       "fmha-compile")
    with launch_log() as eager:
        workload.eager_step()
    workload.step(0)
    with launch_log() as compiled:
        workload.step(1)
    assert compiled, "the compiled step's launches were not seen"
    assert [(e["kernel"], e["bytes"]) for e in eager] == [(e["kernel"], e["bytes"]) for e in compiled]
