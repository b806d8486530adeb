"""Fused Triton kernels for Swin, each in one file with its autograd Function.

Exports (usable without the CLI):
  roll_partition, merge_roll, norm_shift_partition, add_norm_shift_partition, merge_unshift_add,
  merge_add_norm                                                         (window.py)
  fused_window_attention                                                 (window_attention.py)
  layer_norm, add_layer_norm                                             (layer_norm.py)
  linear, bias_grad                                                      (linear.py)
  scale_samples (stochastic depth's per-sample multiply)                 (drop_path.py)
  absmax_scale, quantize, dequantize, fake_quantize, QuantLinear         (quant.py; quantize_rows and
                                                                          int8_dequant in Triton)
Kernels run on the GPU, and on the CPU under TRITON_INTERPRET=1 (slow: for tests).
"""
from __future__ import annotations

__all__: list[str] = []

try:
    from workbench.kernels.window import (add_norm_shift_partition, merge_add_norm, merge_roll, merge_unshift_add, norm_shift_partition,
                         roll_partition)

    __all__ += ["roll_partition", "merge_roll", "norm_shift_partition", "add_norm_shift_partition", "merge_unshift_add",
                "merge_add_norm"]
except ImportError:  # pragma: no cover - kernel file not present yet
    pass
try:
    from workbench.kernels.window_attention import fused_window_attention

    __all__ += ["fused_window_attention"]
except ImportError:  # pragma: no cover
    pass
try:
    from workbench.kernels.layer_norm import add_layer_norm, layer_norm

    __all__ += ["layer_norm", "add_layer_norm"]
except ImportError:  # pragma: no cover
    pass
try:
    from workbench.kernels.linear import bias_grad, linear

    __all__ += ["linear", "bias_grad"]
except ImportError:  # pragma: no cover
    pass

from workbench.kernels.drop_path import scale_samples  # noqa: E402

__all__ += ["scale_samples"]

from workbench.kernels.quant import QuantLinear, absmax_scale, dequantize, fake_quantize, quantize  # noqa: E402

__all__ += ["absmax_scale", "quantize", "dequantize", "fake_quantize", "QuantLinear"]
