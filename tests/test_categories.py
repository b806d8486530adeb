"""Categorization rules, checked on kernel names taken from the real fixtures plus our Triton kernel names."""
from __future__ import annotations

import lzma
import sqlite3
from pathlib import Path

import pandas as pd
import pytest

from workbench.analysis.categories import CATEGORIES, RULES, categorize, categorize_one

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def real_names(tmp_path_factory) -> dict[str, list[str]]:
    """{short name: [demangled names]} over both fixtures."""
    names: dict[str, list[str]] = {}
    for precision in ("bf16", "fp32"):
        path = tmp_path_factory.mktemp("cat") / f"{precision}.sqlite"
        path.write_bytes(lzma.decompress((DATA / f"swin_tiny_train_{precision}.sqlite.xz").read_bytes()))
        with sqlite3.connect(path) as con:
            rows = con.execute(
                "SELECT DISTINCT s.value, d.value FROM CUPTI_ACTIVITY_KIND_KERNEL k "
                "JOIN StringIds s ON s.id = k.shortName JOIN StringIds d ON d.id = k.demangledName"
            ).fetchall()
        for short, demangled in rows:
            names.setdefault(short, []).append(demangled)
    return names


REAL = {
    "GEMM": ["nvjet_sm90_tst_192x96_64x5_1x2_h_bz_NNT", "Kernel2", "splitKreduce_kernel", "precomputed_convolve_sgemm",
             "wgrad_alg0_engine", "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4_execute_kernel__5x_cublas"],
    "softmax": ["softmax_warp_forward", "softmax_warp_backward"],
    "normalization": ["vectorized_layer_norm_kernel", "layer_norm_grad_input_kernel_vectorized", "GammaBetaBackwardCUDAKernelTemplate"],
    "window gather/scatter": ["roll_cuda_kernel"],
    "optimizer": ["multi_tensor_apply_kernel"],
    "reduction": ["reduce_kernel", "nll_loss_forward_reduce_cuda_kernel_2d", "nll_loss_backward_reduce_cuda_kernel_2d"],
    "copy/memory": ["CatArrayBatchedCopy", "indexing_backward_kernel_small_stride", "vectorized_gather_kernel",
                    "index_elementwise_kernel", "nchwToNhwcKernel"],
    "elementwise": ["distribution_elementwise_grid_stride_kernel", "elementwise_kernel_with_index"],
    "other": ["DeviceRadixSortOnesweepKernel", "DeviceRadixSortHistogramKernel"],
}


@pytest.mark.parametrize("category,shorts", REAL.items(), ids=list(REAL))
def test_real_kernel_names(real_names, category, shorts):
    for short in shorts:
        assert short in real_names, short
        for demangled in real_names[short]:
            assert categorize_one(demangled) == category, demangled[:160]


def test_copy_kernels_launched_through_elementwise_templates_are_copy(real_names):
    """`elementwise_kernel<... direct_copy_kernel_cuda ...>` and the bf16 cast kernels move bytes only."""
    wrapped = [n for short in ("elementwise_kernel", "vectorized_elementwise_kernel", "unrolled_elementwise_kernel")
               for n in real_names[short]]
    copies = [n for n in wrapped if "direct_copy_kernel" in n or "bfloat16_copy_kernel" in n]
    math = [n for n in wrapped if any(f in n for f in ("MulFunctor", "CUDAFunctor_add", "GeluCUDAKernelImpl", "GeluBackward"))]
    assert copies and math
    assert {categorize_one(n) for n in copies} == {"copy/memory"}
    assert {categorize_one(n) for n in math} == {"elementwise"}
    fill = [n for n in wrapped if "FillFunctor" in n]
    assert fill and {categorize_one(n) for n in fill} == {"copy/memory"}


@pytest.mark.parametrize("name,category", [
    ("_window_attention_fwd", "attention"),
    ("_window_attention_bwd_dq", "attention"),
    ("flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4>, true>", "attention"),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)", "attention"),
    ("_layer_norm_fwd_fused", "normalization"),
    ("_norm_shift_partition_kernel", "normalization"),
    ("_roll_partition_kernel", "window gather/scatter"),
    ("_merge_windows_reverse", "window gather/scatter"),
    ("void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>>(int, T2)", "elementwise"),
    ("void multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>(T1, T2)", "optimizer"),
    ("triton_poi_fused_add_gelu_0", "elementwise"),
    ("triton_red_fused_native_layer_norm_1", "normalization"),
    ("triton_per_fused_sum_2", "reduction"),
    ("[CUDA memcpy Device-to-Device]", "copy/memory"),
    ("some_unknown_kernel", "other"),
])
def test_rules_on_our_and_library_names(name, category):
    assert categorize_one(name) == category


def test_categorize_is_vectorized_and_keeps_index():
    names = pd.Series(["softmax_warp_forward", "nvjet_x", "softmax_warp_forward", "mystery"], index=[5, 6, 7, 8])
    got = categorize(names)
    assert got.index.tolist() == [5, 6, 7, 8]
    assert got.tolist() == ["softmax", "GEMM", "softmax", "other"]


def test_rule_categories_are_listed():
    assert {c for c, _ in RULES} | {"other"} == set(CATEGORIES)


@pytest.mark.parametrize("name", [
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWork)", "c10d::allreduce_", "gloo:all_reduce",
    "record_param_comms",
])
def test_collectives_are_communication(name):
    assert categorize_one(name) == ("communication" if name != "record_param_comms" else "other")


def test_ordinary_ops_with_collective_looking_words_are_not_communication():
    assert categorize_one("aten::broadcast_tensors") != "communication"
    assert categorize_one("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>") == "reduction"


@pytest.mark.parametrize("name, category", [
    ("aten::mm", "GEMM"), ("aten::addmm", "GEMM"), ("aten::bmm", "GEMM"), ("aten::convolution_backward", "GEMM"),
    ("aten::copy_", "copy/memory"), ("aten::_to_copy", "copy/memory"), ("aten::cat", "copy/memory"),
    ("aten::fill_", "copy/memory"), ("aten::add", "elementwise"), ("aten::mul_", "elementwise"),
    ("aten::gelu_backward", "elementwise"), ("aten::sum", "reduction"), ("aten::roll", "window gather/scatter"),
    ("aten::_foreach_addcdiv_", "optimizer"), ("aten::native_layer_norm_backward", "normalization"),
    ("aten::_softmax_backward_data", "softmax"), ("aten::view", "other"), ("aten::permute", "other"),
])
def test_cpu_operators_fall_in_their_categories(name, category):
    """On a CPU trace each operator's self time stands for a kernel: aten names are categorized too."""
    assert categorize_one(name) == category
