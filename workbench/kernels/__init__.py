"""Fused Triton kernels for Swin, each in one file with its autograd Function.

Exports (usable without the CLI):
  roll_partition, merge_roll, norm_shift_partition, add_norm_shift_partition, merge_unshift_add,
  merge_add_norm                                                         (window.py)
  fused_window_attention                                                 (window_attention.py)
  cosine_qk (SwinV2's normalized q and k)                                (cosine.py)
  layer_norm, add_layer_norm, merging_layer_norm                         (layer_norm.py)
  linear, bias_grad                                                      (linear.py)
  scale_samples (stochastic depth's per-sample multiply)                 (drop_path.py)
  adamw_flat_step (AdamW on a flat fp32 master from bf16 gradients)      (adamw.py)
  fused_mlp, quantized_mlp (a narrow MLP in one kernel, inference)       (mlp.py)
  qkv_window_attention (qkv Linear + window attention, inference)        (qkv_attention.py)
  absmax_scale, quantize, dequantize, fake_quantize, QuantLinear         (quant.py; quantize_rows,
                                                                          gelu_quantize_rows, int8_dequant
                                                                          and quant_matmul in Triton)
Kernels run on the GPU, and on the CPU under TRITON_INTERPRET=1 (slow: for tests).
"""
from __future__ import annotations

from workbench.kernels.adamw import adamw_flat_step
from workbench.kernels.cosine import cosine_qk
from workbench.kernels.drop_path import scale_samples
from workbench.kernels.layer_norm import add_layer_norm, layer_norm, merging_layer_norm
from workbench.kernels.linear import bias_grad, linear
from workbench.kernels.mlp import fused_mlp, quantized_mlp
from workbench.kernels.qkv_attention import qkv_window_attention
from workbench.kernels.quant import QuantLinear, absmax_scale, dequantize, fake_quantize, quantize
from workbench.kernels.window import (add_norm_shift_partition, merge_add_norm, merge_roll, merge_unshift_add,
                                      norm_shift_partition, roll_partition)
from workbench.kernels.window_attention import fused_window_attention

__all__ = ["roll_partition", "merge_roll", "norm_shift_partition", "add_norm_shift_partition", "merge_unshift_add",
           "merge_add_norm", "fused_window_attention", "cosine_qk", "layer_norm", "add_layer_norm",
           "merging_layer_norm", "linear", "bias_grad", "scale_samples", "absmax_scale", "quantize", "dequantize",
           "fake_quantize", "QuantLinear", "adamw_flat_step", "fused_mlp", "quantized_mlp", "qkv_window_attention"]
