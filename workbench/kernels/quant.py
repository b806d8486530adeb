"""Symmetric quantization for inference GEMMs: scales, quantize / dequantize, calibration observers, and
the two quantized matmuls (FP8 through torch._scaled_mm, INT8 through torch._int_mm).

    absmax_scale(x, fmt, dim=None)      -> fp32 scale: amax(|x|) / qmax, per tensor (dim None, shape ())
                                           or per row (dim=-1 over a 2-D x: shape (rows, 1))
    quantize(x, scale, fmt)             -> x / scale rounded to the format (fp8 e4m3fn or int8), saturated
    dequantize(q, scale)                -> q * scale in fp32
    fake_quantize(x, scale, fmt)        -> dequantize(quantize(x, scale, fmt), scale): the error the format adds
    AbsMaxObserver, PercentileObserver  -> per-tensor activation amax over calibration batches
    fp8_linear(x_q, x_scale, w_q, w_scale, bias)   (M, K) e4m3 @ (N, K)^T -> (M, N) bf16, torch._scaled_mm
    int8_linear(x_q, x_scale, w_q, w_scale, bias)  (M, K) int8 @ (N, K)^T -> (M, N) bf16, torch._int_mm

Formats (`fmt`): "fp8" is float8 e4m3fn (largest finite 448, no inf: a value past 448 would become NaN,
so quantize saturates first); "int8" is symmetric int8, [-127, 127] (-128 unused so that the range is
symmetric and a negated weight quantizes to the negated integer).

Scale guards: an all-zero row or tensor has amax 0; its scale is 1 (any scale gives back zeros). A
scale never falls below the smallest normal fp32 (a denormal amax would give a zero scale and inf
quotients). A non-finite amax (an inf or NaN in x) is refused with ValueError where `check` is on
(weights and calibration, once); the dynamic per-row path of a forward passes check=False, since the
check is a host sync (and CUDA graphs cannot capture one): a NaN activation stays NaN, as it would in bf16.

Weights are quantized per output channel (per row of the (N, K) weight): one scale per output feature,
applied after the GEMM. Activations are quantized per row (per token, dynamic: computed each forward)
or per tensor (static: calibrated once). Both GEMMs accumulate exactly (fp8 products in fp32, int8 in
int32), so a matmul of the dequantized operands in fp32 computes what they compute, up to the order of
the sums: that is the simulate mode's matmul (`fake_quantize` both operands, then F.linear).
"""
from __future__ import annotations

import torch

FORMATS = ("fp8", "int8")
QMAX = {"fp8": 448.0, "int8": 127.0}
QDTYPE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
# the smallest scale: the smallest normal fp32, so x / scale stays finite for every finite x that is
# itself at most qmax * scale
MIN_SCALE = torch.finfo(torch.float32).tiny


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}: choose {' or '.join(FORMATS)}")


def scale_from_amax(amax: torch.Tensor, fmt: str, check: bool = True) -> torch.Tensor:
    """fp32 scale amax / qmax (same shape as amax); 1 where amax is 0; at least MIN_SCALE.
    ValueError for a non-finite amax when `check` (a host sync)."""
    _check_format(fmt)
    amax = amax.float()
    if check and not bool(torch.isfinite(amax).all()):
        raise ValueError("cannot quantize a tensor that holds inf or NaN")
    scale = (amax / QMAX[fmt]).clamp_min(MIN_SCALE)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def absmax_scale(x: torch.Tensor, fmt: str, dim: int | None = None, check: bool = True) -> torch.Tensor:
    """The scale that maps amax(|x|) to the format's largest value. dim None: one scale, shape ();
    dim=-1 on a 2-D (rows, K) x: one per row, shape (rows, 1). Any float dtype in; fp32 out."""
    if dim is None:
        amax = x.detach().abs().amax().float()
    else:
        amax = x.detach().abs().amax(dim=dim, keepdim=True).float()
    return scale_from_amax(amax, fmt, check=check)


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """x / scale in the format: fp8 e4m3fn (round to nearest even, saturated to +-448) or int8 (rounded half
    to even, clamped to +-127). scale broadcasts against x (shape () or (rows, 1)). The quotient is fp32."""
    _check_format(fmt)
    q = x.float() / scale
    if fmt == "int8":
        return q.round_().clamp_(-127, 127).to(torch.int8)
    return q.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q * scale in fp32."""
    return q.float() * scale


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """dequantize(quantize(x)): x with the format's rounding and saturation, fp32."""
    return dequantize(quantize(x, scale, fmt), scale)


# ------------------------------------------------------------------------------ calibration


class AbsMaxObserver:
    """The largest |x| over every observed tensor: the per-tensor amax of a static activation scale."""

    def __init__(self):
        self.amax: torch.Tensor | None = None
        self.batches = 0

    def observe(self, x: torch.Tensor) -> None:
        a = x.detach().abs().amax().float()
        self.amax = a if self.amax is None else torch.maximum(self.amax, a)
        self.batches += 1

    def scale(self, fmt: str) -> torch.Tensor:
        if self.amax is None:
            raise ValueError("no batch was observed")
        return scale_from_amax(self.amax, fmt)


class PercentileObserver:
    """The `percentile`-th percentile of |x| per observed tensor, averaged over the tensors: a static scale
    that clips the rarest outliers (0.01% of the values at 99.99) for a finer step on the rest. The
    percentile of n values is the k-th smallest, k = ceil(n * percentile / 100) (numpy's 'inverted_cdf')."""

    def __init__(self, percentile: float = 99.99):
        if not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile}")
        self.percentile = percentile
        self.values: list[torch.Tensor] = []

    @property
    def batches(self) -> int:
        return len(self.values)

    def observe(self, x: torch.Tensor) -> None:
        flat = x.detach().reshape(-1).abs().float()
        n = flat.numel()
        if n == 0:
            return
        k = min(n, max(1, -(-int(round(n * self.percentile * 1e4)) // int(1e6))))
        self.values.append(flat.kthvalue(k).values)

    @property
    def amax(self) -> torch.Tensor | None:
        return torch.stack(self.values).mean() if self.values else None

    def scale(self, fmt: str) -> torch.Tensor:
        if not self.values:
            raise ValueError("no batch was observed")
        return scale_from_amax(self.amax, fmt)


def make_observer(method: str, percentile: float = 99.99):
    """'max' -> AbsMaxObserver, 'percentile' -> PercentileObserver(percentile)."""
    if method == "max":
        return AbsMaxObserver()
    if method == "percentile":
        return PercentileObserver(percentile)
    raise ValueError(f"unknown calibration method {method!r}: choose max or percentile")


# ------------------------------------------------------------------------------ quantized GEMMs


def fp8_linear(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """(x_q * x_scale) @ (w_q * w_scale)^T + bias in one torch._scaled_mm, bf16 out.
    x_q (M, K) e4m3fn row-major; x_scale (M, 1) fp32 (rowwise); w_q (N, K) e4m3fn contiguous, so that
    w_q.t() is the column-major (K, N) second operand _scaled_mm requires; w_scale (1, N) fp32; bias (N,)
    bf16 or None. On CUDA, K and N must be multiples of 16 (the pass checks before choosing this route)."""
    return torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=torch.bfloat16)


INT8_MIN_ROWS = 17  # torch._int_mm on CUDA needs more than 16 rows in its first operand


def int8_linear(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """(x_q @ w_q^T) in int32 by torch._int_mm, then * x_scale * w_scale (+ bias) in fp32, bf16 out.
    x_q (M, K) int8; x_scale (M, 1) or () fp32; w_q (N, K) int8 contiguous (w_q.t() is the column-major
    second operand); w_scale (1, N) fp32; bias (N,) or None. On CUDA, K and N must be multiples of 8; a
    batch of at most 16 rows is padded with zero rows to 17 (its extra outputs dropped)."""
    M = x_q.shape[0]
    if M < INT8_MIN_ROWS:
        x_q = torch.nn.functional.pad(x_q, (0, 0, 0, INT8_MIN_ROWS - M))
    acc = torch._int_mm(x_q, w_q.t())[:M]
    out = acc.float() * x_scale * w_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16)


# ------------------------------------------------------------------------------ the module

ROUTES = ("scaled_mm", "int_mm", "simulate")


class QuantLinear(torch.nn.Module):
    """An inference-only nn.Linear with its weight quantized per output channel and its input quantized per
    row (dynamic: `input_scale` None) or per tensor (static: a calibrated () scale), run by one route:

        scaled_mm  FP8 e4m3 GEMM, torch._scaled_mm with rowwise scales (CUDA, capability >= 8.9)
        int_mm     INT8 GEMM, torch._int_mm in int32, the scales applied after (CUDA)
        simulate   the same quantize-dequantize math, then an fp32 F.linear (fake quantization, any device)

    x (..., in_features) in any float dtype -> (..., out_features) in the autocast dtype where autocast is
    on (what nn.Linear would give), else in x's dtype. The float weight is not kept (no `weight`
    attribute: code that would read it fails instead of computing in bf16 behind the quantization)."""

    def __init__(self, linear: torch.nn.Linear, fmt: str, route: str, input_scale: torch.Tensor | None = None):
        super().__init__()
        _check_format(fmt)
        if route not in ROUTES:
            raise ValueError(f"unknown route {route!r}: choose from {', '.join(ROUTES)}")
        self.fmt, self.route = fmt, route
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        w_scale = absmax_scale(w, fmt, dim=-1)                          # (N, 1), refuses inf/NaN weights
        w_q = quantize(w, w_scale, fmt).contiguous()
        if route == "simulate":
            self.register_buffer("weight_dq", dequantize(w_q, w_scale))   # fp32 (N, K)
        else:
            self.register_buffer("weight_q", w_q)
        self.register_buffer("weight_scale", w_scale.reshape(1, -1).contiguous())   # (1, N)
        bias = linear.bias.detach() if linear.bias is not None else None
        # _scaled_mm adds a bf16 bias in its epilogue, int8 adds it in fp32; simulate rounds it as its
        # format's GEMM route would
        self.register_buffer("bias", None if bias is None else
                             bias.to(torch.bfloat16 if fmt == "fp8" else torch.float32))
        self.register_buffer("input_scale", None if input_scale is None else input_scale.detach().float().reshape(()))

    def extra_repr(self) -> str:
        acts = "dynamic per-row" if self.input_scale is None else "static per-tensor"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}, route={self.route}, "
                f"activations {acts}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        M = x2.shape[0]
        x_scale = absmax_scale(x2, self.fmt, dim=-1, check=False) if self.input_scale is None else self.input_scale
        device_type = x.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        if self.route == "simulate":
            with torch.autocast(device_type, enabled=False):
                bias = None if self.bias is None else self.bias.float()
                out = torch.nn.functional.linear(fake_quantize(x2, x_scale, self.fmt), self.weight_dq, bias)
            # the GPU routes write bf16
            out = out.to(torch.bfloat16)
        else:
            x_q = quantize(x2, x_scale, self.fmt)
            if self.route == "scaled_mm":
                # rowwise scaling takes an (M, 1) scale for the first operand: a static one is repeated
                rows = x_scale if x_scale.dim() == 2 else x_scale.reshape(1, 1).expand(M, 1).contiguous()
                out = fp8_linear(x_q, rows, self.weight_q, self.weight_scale, self.bias)
            else:
                out = int8_linear(x_q, x_scale, self.weight_q, self.weight_scale, self.bias)
        return out.to(out_dtype).reshape(*lead, self.out_features)
