"""Kineto parser: a real CPU torch.profiler trace (ranges only) and a schema-faithful GPU trace (hand-checked).

kineto_cpu_tiny_train.json: torch 2.14.1 CPU, a 2-layer MLP trained 2 steps under torch.profiler with
record_function ranges step{i} > forward / backward / optimizer, export_chrome_trace.
kineto_synthetic_gpu.json: written by hand in the shape torch.profiler exports on CUDA (kernel /
cuda_runtime / cuda_driver / user_annotation / gpu_user_annotation / gpu_memcpy events, args.correlation,
ac2g flows). Main thread 1000 launches forward + optimizer kernels; thread 1001 (autograd) launches the
backward ones; one kernel (correlation 99) has no runtime record. Times in the file are µs.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from workbench.analysis import frames as A
from workbench.analysis.analyze import analyze_trace
from workbench.errors import UserError
from workbench.trace import KERNEL_COLUMNS, RANGE_COLUMNS, load_trace
from workbench.trace.kineto import op_kernel_name, parse_kineto, short_kernel_name

DATA = Path(__file__).parent / "data"
SYNTH = DATA / "kineto_synthetic_gpu.json"


def test_real_cpu_trace_ranges():
    data = json.loads((DATA / "kineto_cpu_tiny_train.json").read_text())
    trace = parse_kineto(data, "cpu")
    assert trace.kernels.empty and list(trace.kernels.columns) == KERNEL_COLUMNS
    r = trace.ranges
    assert list(r.columns) == RANGE_COLUMNS
    phases = ["forward", "backward", "optimizer", "Optimizer.step#AdamW.step", "Optimizer.zero_grad#AdamW.zero_grad"]
    assert r["name"].tolist() == ["step0", *phases, "step1", *phases]  # torch's own optimizer annotations too
    depth = r.groupby("name")["depth"].unique()
    assert list(depth["step0"]) == [0] and list(depth["forward"]) == [1] and list(depth["optimizer"]) == [1]
    assert list(depth["Optimizer.step#AdamW.step"]) == [2]  # inside our `optimizer` range
    expected = [e for e in data["traceEvents"] if e.get("cat") == "user_annotation"]
    assert len(r) == len(expected)
    step0 = next(e for e in expected if e["name"] == "step0")
    row = r[r["name"] == "step0"].iloc[0]
    assert row["end_ns"] - row["start_ns"] == round(step0["dur"] * 1000) and row["tid"] == step0["tid"]


def test_real_cpu_trace_falls_back_to_cpu_ops_self_time():
    """No GPU kernels: load_trace keeps every CPU operator with its self time (exclusive time): together
    they cover the time inside operators exactly once, which is the union of the operators' intervals."""
    data = json.loads((DATA / "kineto_cpu_tiny_train.json").read_text())
    trace = load_trace(DATA / "kineto_cpu_tiny_train.json")
    assert trace.meta["device"] == "cpu" and any("CPU operators" in n for n in trace.meta["notes"])
    ops = sorted(((e["tid"], round(e["ts"] * 1000), round(e["ts"] * 1000) + round(e["dur"] * 1000), e["name"])
                  for e in data["traceEvents"] if e.get("cat") == "cpu_op"), key=lambda o: (o[0], o[1], -o[2]))
    inside = 0
    for tid in {o[0] for o in ops}:      # union of the thread's operator intervals
        reach = None
        for _, s, e, _ in (o for o in ops if o[0] == tid):
            if reach is None or s >= reach:
                inside += e - s
                reach = e
            elif e > reach:
                inside += e - reach
                reach = e
    k = trace.kernels
    assert int(k["duration_ns"].sum()) == inside
    # aten::addmm computes its product itself: its self time is most of it (a leaf view dropped it whole)
    addmm = k[k["name"] == "aten::addmm"]
    whole = sum(e - s for _, s, e, n in ops if n == "aten::addmm")
    assert len(addmm) and 0.5 * whole < int(addmm["duration_ns"].sum()) <= whole
    assert A.range_table(trace).set_index("range").loc["backward", "gpu_ns"] > 0  # autograd thread, same pid


def test_a_collective_is_one_cpu_leaf_with_its_whole_time(tmp_path):
    """A c10d collective with operators inside it (FSDP's all-gather allocates and copies) counts as one
    leaf over its whole time, the communication; an ordinary operator keeps its self time."""
    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": [
        op("aten::linear", 0.0, 10.0), op("aten::addmm", 1.0, 8.0),
        op("c10d::_allgather_base_", 20.0, 30.0), op("aten::empty", 21.0, 1.0), op("aten::copy_", 23.0, 5.0),
        op("aten::copy_", 60.0, 2.0), op("c10d::_allgather_base_", 60.5, 1.0, tid=2)]}))
    k = load_trace(path).kernels
    ops = k.groupby("correlation_id").agg(name=("name", "first"), ns=("duration_ns", "sum"))
    assert sorted(zip(ops["name"], ops["ns"])) == [
        ("aten::addmm", 8000), ("aten::copy_", 2000), ("aten::linear", 2000), ("c10d::_allgather_base_", 1000),
        ("c10d::_allgather_base_", 30000)]
    # aten::linear's self time is two stretches around its addmm; the table counts it once
    assert sorted(zip(k["name"], k["start_ns"] - int(k["start_ns"].min()), k["duration_ns"]))[:3] == [
        ("aten::addmm", 1000, 8000), ("aten::copy_", 60000, 2000), ("aten::linear", 0, 1000)]
    table = A.kernel_share_table(k).set_index("kernel")
    assert table.loc["aten::linear", "instances"] == 1 and table.loc["aten::linear", "total_ns"] == 2000


def test_an_operator_its_children_cover_is_still_counted(tmp_path):
    """aten::to -> _to_copy -> copy_ at the same times: two of them have no self time, all three count."""
    def op(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur}

    path = tmp_path / "to.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": [
        op("aten::to", 0.0, 5.0), op("aten::_to_copy", 0.0, 5.0), op("aten::copy_", 0.0, 5.0),
        op("aten::empty", 6.0, 0.0)]}))
    trace = load_trace(path)
    table = A.kernel_share_table(trace.kernels).set_index("kernel")
    assert set(table.index) == {"aten::to", "aten::_to_copy", "aten::copy_", "aten::empty"}
    assert table["instances"].sum() == 4 and table["total_ns"].sum() == 5000
    from workbench.analysis.timeline import step_view

    assert step_view(trace).kernel_count == 4


def test_kineto_without_kernels_or_ops_is_an_error(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "step0", "pid": 1, "tid": 1, "ts": 1.0, "dur": 2.0}]}))
    with pytest.raises(UserError, match="empty trace: no GPU kernels and no CPU operators"):
        load_trace(path)


def test_synthetic_gpu_kernels():
    t = load_trace(SYNTH)
    k = t.kernels
    assert t.meta["source"] == "kineto" and t.meta["gpus"] == ["NVIDIA H200"]
    assert k["duration_ns"].tolist() == [2000, 5500, 10250, 3000, 12125, 4000, 1000]
    assert k["correlation_id"].tolist() == [6, 1, 2, 3, 4, 5, 99]
    assert k["launch_tid"].tolist() == [1000, 1000, 1000, 1001, 1001, 1000, -1]
    assert k["launch_ns"].tolist() == [95000, 102000, 125000, 150000, 160000, 193000, -1]
    assert k["pid"].tolist() == [1000] * 6 + [-1]
    assert set(k["stream_id"]) == {7} and set(k["device_id"]) == {0}
    assert k["short_name"].tolist() == [
        "_window_attention_fwd", "vectorized_layer_norm_kernel", "nvjet_sm90_tst_192x96_64x5_1x2_h_bz_NNT",
        "vectorized_elementwise_kernel", "nvjet_sm90_tst_192x96_64x5_1x2_h_bz_NNT", "multi_tensor_apply_kernel",
        "reduce_kernel"]
    assert (t.meta["span_start_ns"], t.meta["span_end_ns"]) == (96000, 200000)
    assert any("no matching runtime launch" in n for n in t.meta["notes"])
    assert t.memops[["kind", "bytes", "duration_ns"]].values.tolist() == [["memcpy", 4096, 1500]]
    assert t.ranges["name"].tolist() == ["step0", "forward", "stage0.block0", "backward", "optimizer"]  # gpu_user_annotation skipped
    assert t.ranges["depth"].tolist() == [0, 1, 2, 1, 1]


def test_synthetic_gpu_range_attribution():
    t = load_trace(SYNTH)
    table = A.range_table(t).set_index("range")
    assert table["gpu_ns"].to_dict() == {
        "step0": 5500 + 10250 + 3000 + 12125 + 4000, "forward": 5500 + 10250, "backward": 3000 + 12125,
        "stage0.block0": 5500, "optimizer": 4000}
    assert table.loc["backward", "kernels"] == 2  # both launched by thread 1001
    assert table.loc["step0", "share_pct"] == pytest.approx(34875 * 100 / 37875)
    busy = A.busy_idle(t.kernels).set_index("metric")["ns"].to_dict()
    assert busy == {"span": 104000, "busy": 37875, "idle": 66125, "kernel_sum": 37875}


def test_synthetic_gpu_analyze_and_gzip(tmp_path):
    gz = tmp_path / "trace.json.gz"
    gz.write_bytes(gzip.compress(SYNTH.read_bytes()))
    analysis = analyze_trace(gz, name_style="short")
    assert analysis.backend == "torch.profiler"
    assert analysis.kernels.iloc[0][["kernel", "instances", "total_ns"]].tolist() == [
        "nvjet_sm90_tst_192x96_64x5_1x2_h_bz_NNT", 2, 22375]
    cats = analysis.categories.set_index("category")["total_ns"].to_dict()
    assert cats == {"GEMM": 22375, "normalization": 5500, "optimizer": 4000, "elementwise": 3000,
                    "attention": 2000, "reduction": 1000}


@pytest.mark.parametrize("name,short", [
    ("void at::native::reduce_kernel<(int)128, (int)4, at::native::ReduceOp<float, X<Y>>>(T3)", "reduce_kernel"),
    ("void <unnamed>::softmax_warp_forward<float, float, float, (int)6, (bool)0, (bool)0>(T2 *, const T1 *, int)", "softmax_warp_forward"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nt_align1>(T1::Params)", "Kernel2"),
    ("nvjet_sm90_tst_192x96_64x5_1x2_h_bz_NNT", "nvjet_sm90_tst_192x96_64x5_1x2_h_bz_NNT"),
    ("triton_poi_fused_add_0", "triton_poi_fused_add_0"),
])
def test_short_kernel_name_matches_nsys_short_names(name, short):
    assert short_kernel_name(name) == short


@pytest.mark.parametrize("name,op", [
    ("void at::native::vectorized_elementwise_kernel<(int)8, at::native::CUDAFunctor_add<c10::BFloat16>, "
     "std::array<char *, (unsigned long)3>>(int, T2, T3)", "vectorized_elementwise_kernel[add bf16]"),
    ("void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, std::array<char *, "
     "(unsigned long)3>, (int)4>(int, T1, T2)", "unrolled_elementwise_kernel[add fp32]"),
    ("void at::native::reduce_kernel<(int)128, (int)4, at::native::ReduceOp<c10::BFloat16, at::native::"
     "func_wrapper_t<c10::BFloat16, at::native::sum_functor<c10::BFloat16, float, c10::BFloat16>>>>(T3)",
     "reduce_kernel[sum bf16]"),
    ("void at::native::reduce_kernel<(int)128, (int)4, at::native::ReduceOp<float, at::native::MeanOps<float, "
     "float, float, float>, unsigned int, float, (int)4>>(T3)", "reduce_kernel[Mean fp32]"),
    ("void at::native::vectorized_elementwise_kernel<(int)8, at::native::GeluBackwardCUDAKernelImpl("
     "at::TensorIteratorBase &, at::native::GeluType)::[lambda() (instance 2)]>(int, T2, T3)",
     "vectorized_elementwise_kernel[GeluBackward]"),
    ("void at::native::elementwise_kernel<(int)128, (int)4, void at::native::gpu_kernel_impl_nocast<at::native::"
     "direct_copy_kernel_cuda(at::TensorIteratorBase &)::[lambda() (instance 3)]>(int, T3)",
     "elementwise_kernel[direct_copy]"),
    ("void at::native::elementwise_kernel<(int)128, (int)4, void at::native::gpu_kernel_impl_nocast<at::native::"
     "AUnaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float>>>"
     "(at::TensorIteratorBase &, const T1 &)::[lambda(int) (instance 1)]>(int, T3)", "elementwise_kernel[Mul fp32]"),
    ("void at::native::<unnamed>::multi_tensor_apply_kernel<at::native::<unnamed>::FusedOptimizerTensorListMetadata"
     "<(int)4>, at::native::<unnamed>::FusedAdamMathFunctor<float, (int)4, (at::native::ADAM_MODE)1, (bool)0>>"
     "(T1, T2, T3...)", "multi_tensor_apply_kernel[FusedAdamMath fp32]"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x64_8x5_nt_align1>(T1::Params)", "cutlass_80_simt_sgemm_128x64_8x5_nt_align1"),
    ("void <unnamed>::softmax_warp_forward<float, float, float, (int)6, (bool)0, (bool)0>(T2 *, const T1 *, int)",
     "softmax_warp_forward"),
    ("void at::native::roll_cuda_kernel<float>(const T1 *, T1 *, long, long)", "roll_cuda_kernel"),
    ("nvjet_sm90_tst_192x96_64x5_1x2_h_bz_NNT", "nvjet_sm90_tst_192x96_64x5_1x2_h_bz_NNT"),
    ("_window_attention_fwd_kernel", "_window_attention_fwd_kernel"),
])
def test_op_kernel_name_says_what_a_generic_kernel_runs(name, op):
    assert op_kernel_name(name) == op


def test_analyze_prints_op_names_with_their_brackets(tmp_path):
    """`analyze --name op` groups by op name (the same kernel time in all), and the table shows the names'
    brackets as they are (not as rich markup)."""
    from typer.testing import CliRunner
    from cli import app

    fixture = Path(__file__).resolve().parents[1] / "profiles/examples/swin_tiny_train_bf16/trace.sqlite.xz"
    short, op = (analyze_trace(fixture, name_style=s).kernels for s in ("short", "op"))
    assert short["total_ns"].sum() == op["total_ns"].sum() and len(op) > len(short)
    assert "reduce_kernel[sum bf16]" in set(op["kernel"])
    result = CliRunner().invoke(app, ["analyze", str(fixture), "--name", "op", "--top", "3"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "elementwise_kernel[direct_copy]" in result.output
