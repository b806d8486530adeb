"""Kernel categories: an ordered list of regex rules over the demangled kernel name, first match wins.

The rules are written against the names real Swin-T training traces contain (tests/data fixtures, nsys
2025.3, torch 2.11, H200) plus the names of our own Triton kernels. Matching is case-insensitive and runs
once per distinct name, so a million-kernel trace costs a few hundred regex calls.

Rule order matters because a demangled name carries its template arguments: `elementwise_kernel<...
direct_copy_kernel_cuda ...>` names both "elementwise" and "copy", and `cutlass::Kernel2<...gemm...>` could
look like a generic kernel. Specific rules come first:

0. communication: collectives between processes: NCCL kernels (`ncclDevKernel_AllReduce_*`,
   `ncclKernel_*`), and on the CPU gloo's and c10d's operators (`c10d::allreduce_`, `gloo:all_reduce`):
   what data-parallel training spends on the gradient all-reduce. First: a collective's name can hold
   "reduce" and "copy".
1. attention: fused attention kernels (flash / fmha / cuDNN sdpa / PyTorch mem-efficient `AttentionKernel`,
   our Triton `_window_attention*`). First, because fmha kernels are often CUTLASS templates.
2. optimizer: `multi_tensor_apply_kernel` (torch's foreach / fused AdamW), `fused_adam`, adam kernels.
   Before elementwise: their functors are pointwise math.
3. window gather/scatter: `roll_cuda_kernel` (torch.roll, the shifted-window shift), our Triton
   `_roll_partition*` / `_merge_*` / window partition-reverse kernels. `\\broll` so `unrolled_` does not match.
4. normalization: layer_norm / LayerNorm kernels, `GammaBetaBackward` (LayerNorm's weight/bias gradient),
   rms/batch/group norm, our Triton `_layer_norm*` / `_norm_shift*`. Before reduction: they reduce.
5. softmax: any name with `softmax` (softmax_warp_forward/backward, cunn_SoftMax*).
6. GEMM: cuBLAS/cuBLASLt/CUTLASS matrix multiplies: `gemm` (incl. sgemm, implicit_gemm), `nvjet` (cuBLAS's
   Hopper GEMMs), `xmma`, `cutlass`, `cublas` (incl. `cublasLt::splitKreduce_kernel`, the second half of a
   split-K GEMM), and convolutions (`convolve`, `wgrad`, `dgrad`, `fprop`): Swin's patch embedding conv
   runs as an implicit GEMM.
7. copy/memory: data movement without arithmetic: `direct_copy_kernel` and `*_copy_kernel` (Tensor.copy_,
   .contiguous(), dtype casts), CatArrayBatchedCopy (torch.cat), index / gather / scatter kernels,
   layout transforms (nchwToNhwc), `FillFunctor` (zero_/fill_, a memset done as a kernel), memcpy/memset.
   `elementwise_kernel<... direct_copy_kernel_cuda ...>` lands here, not in elementwise: it is launched
   through the elementwise template but moves bytes without computing anything, and the question a reader
   asks of this bucket is "how much time goes to layout and dtype traffic that a fusion would remove".
8. reduction: `reduce_kernel` (sum/mean, bias gradients), other `reduce`/`reduction` names, nll_loss /
   cross_entropy, Triton `triton_red_*` / `triton_per_*`.
9. elementwise: `elementwise` (vectorized_/unrolled_elementwise_kernel), pointwise functors, GELU, dropout
   and drop-path random kernels (`distribution_elementwise`), Triton `triton_poi_*`.
10. other: everything else (e.g. cub radix sort used by index backward, cuDNN index precomputation).

On the CPU (torch.profiler traces, where each operator's self time stands for a kernel) the operators are
named `aten::<op>`: matrix products and convolutions are GEMM, `copy_` / `_to_copy` / `clone` / `cat` /
`fill_` and allocations copy/memory, `sum` / `mean` / `amax` reductions, arithmetic and activations
elementwise, `roll` window gather/scatter, `_foreach_*` the optimizer; LayerNorm, softmax and attention
operators fall under the rules above by name. Views (`view`, `reshape`, `permute`, `as_strided`, `slice`)
move nothing and stay in other.
"""
from __future__ import annotations

import re

import pandas as pd

CATEGORIES = [
    "GEMM", "attention", "softmax", "elementwise", "reduction", "normalization", "copy/memory", "optimizer",
    "window gather/scatter", "communication", "other",
]

# (category, pattern): evaluated in this order, first match wins. Case-insensitive.
RULES: list[tuple[str, str]] = [
    ("communication", r"nccl|gloo|c10d::|all_?reduce|reduce_?scatter|all_?gather|allgather"),
    ("attention", r"fmha|flash_?(?:fwd|bwd|attn)|flash::|attention|sdpa|\b_window_attention"),
    ("optimizer", r"multi_tensor_apply|fused_?adam|(?<![a-z])adamw?(?![a-z])|\b_adamw?_|sgd_kernel|aten::_foreach_"),
    ("window gather/scatter", r"\broll_|\broll_cuda|aten::roll\b|\b_roll_partition|\b_merge_|window_(?:partition|reverse)"),
    ("normalization", r"layer_?norm|gammabetabackward|\b_norm_shift|rms_?norm|batch_?norm|group_?norm"),
    ("softmax", r"softmax"),
    ("GEMM", r"gemm|nvjet|xmma|cutlass|cublas|convolve|wgrad|dgrad|fprop"
             r"|aten::(?:mm|addmm_?|bmm|baddbmm|matmul|linear|_addmm_activation|_?convolution\w*|conv2d"
             r"|mkldnn_\w*convolution\w*)\b"),
    (
        "copy/memory",
        r"direct_copy|_copy_kernel|copy_kernel|catarray|\bcat_|memcpy|memset|\bindex|indexing|gather|scatter"
        r"|nchwtonhwc|nhwctonchw|transpose|fillfunctor"
        r"|aten::(?:copy_|_to_copy|to|clone|contiguous|cat|stack|fill_|zero_|zeros\w*|ones\w*|empty\w*"
        r"|new_\w+|constant_pad_nd|pad|flip|_index\w*)\b",
    ),
    ("reduction", r"reduce|reduction|nll_loss|cross_entropy|triton_red_|triton_per_"
                  r"|aten::(?:sum|mean|amax|amin|max|min|norm|linalg_vector_norm|argmax|var_mean)\b"),
    ("elementwise", r"elementwise|pointwise|functor|gelu|dropout|triton_poi_"
                    r"|aten::(?:add|add_|sub|sub_|mul|mul_|div|div_|neg|exp|sqrt|rsqrt|pow|where|lerp_|addcmul_"
                    r"|addcdiv_|clamp\w*|masked_fill\w*|bernoulli_|rand\w*|silu\w*|relu\w*|sigmoid\w*|tanh\w*"
                    r"|threshold_backward|floor_divide|remainder|eq|ne|lt|gt|le|ge)\b"),
]
_COMPILED = [(cat, re.compile(pat, re.IGNORECASE)) for cat, pat in RULES]
assert all(cat in CATEGORIES for cat, _ in RULES)


def categorize_one(name: str) -> str:
    for cat, rx in _COMPILED:
        if rx.search(name):
            return cat
    return "other"


def categorize(names: pd.Series) -> pd.Series:
    """Category of each kernel name (str Series in, str Series out, same index).

    Runs the rules once per distinct name and maps back, so the cost is O(distinct names), not O(kernels).
    """
    names = pd.Series(names)
    codes, uniques = pd.factorize(names.fillna("").astype(str), sort=False)
    cats = pd.Series([categorize_one(u) for u in uniques], dtype=object)  # one call per distinct name
    return pd.Series(cats.to_numpy()[codes], index=names.index, dtype=object, name="category")
