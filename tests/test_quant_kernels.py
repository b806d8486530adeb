"""kernels/quant.py's Triton kernels against the torch ops they replace, bit for bit: quantize_rows vs
absmax_scale(x, fmt, dim=-1, check=False) + quantize(x, scale, fmt), int8_dequant vs int8_linear's fp32
epilogue, and QuantLinear's GEMM routes with the kernels vs with the torch ops.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported);
the e4m3 cast and the int8 rounding then take the kernels' by-hand paths, the GPU's take the hardware's
(tests/aot_compile_kernels.py compiles those for sm_90)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from workbench.kernels import quant  # noqa: E402
from workbench.kernels.quant import (QuantLinear, int8_dequant, int8_dequant_torch, quantize_rows,  # noqa: E402
                                     quantize_rows_torch)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ("fp8", "int8")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of t (an fp8 NaN or -0 compares by its encoding, not by value)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(x2, fmt):
    q, s = quantize_rows(x2, fmt)
    rq, rs = quantize_rows_torch(x2, fmt)
    assert q.dtype == rq.dtype and q.shape == rq.shape and s.shape == rs.shape == (x2.shape[0], 1)
    assert torch.equal(bits(s), bits(rs))
    assert torch.equal(bits(q), bits(rq))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 3, 37])
@pytest.mark.parametrize("K", [8, 40, 136, 1000])
def test_quantize_rows_is_bit_identical(fmt, dtype, M, K):
    g = torch.Generator().manual_seed(M * 10007 + K * 31 + (fmt == "int8") + 2 * (dtype == torch.float32))
    x = (torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 10).to(dtype)
    if M > 1:
        x[1] = 0                                   # a row of zeros: scale 1, zeros out
    x[0, K // 2] = 3e4                             # a huge value: the rest of its row rounds to (near) zero
    x[-1, -1] = -x[-1].abs().max() * 1.5           # the row's amax negative
    assert_same(x.to(DEVICE), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_rounding_boundary(fmt):
    """A row whose scale is exactly 1 (amax = qmax) and whose other values sit on every midpoint between
    neighbouring representable values (ties: to even) and just beside them, e4m3 subnormals included."""
    if fmt == "fp8":
        grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        grid = grid[grid.isfinite()].unique()
    else:
        grid = torch.arange(-127, 128, dtype=torch.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mids, mids.nextafter(torch.tensor(float("inf"))),
                      mids.nextafter(torch.tensor(-float("inf"))), torch.tensor([1e-40, -1e-40, -0.0])])
    qmax = quant.QMAX[fmt]
    x = torch.cat([torch.tensor([qmax]), vals.clamp(-qmax, qmax)]).reshape(1, -1)
    assert_same(x.to(DEVICE), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_denormal_and_non_finite_rows(fmt):
    x = torch.randn(4, 24)
    x[0] = 1e-39                                 # a denormal amax: the scale floors at MIN_SCALE
    x[1, 3] = float("inf")
    x[2, 5] = float("nan")
    q, s = quantize_rows(x.to(DEVICE), fmt)
    rq, rs = quantize_rows_torch(x.to(DEVICE), fmt)
    assert torch.equal(bits(s), bits(rs))       # inf and NaN scales where torch's amax gives them
    if fmt == "fp8":                             # int8 from NaN is undefined in both
        assert torch.equal(q.float().isnan(), rq.float().isnan())
        torch.testing.assert_close(q.float().nan_to_num(), rq.float().nan_to_num(), rtol=0, atol=0)
    assert torch.equal(bits(q[0]), bits(rq[0]))
    assert torch.equal(bits(q[3]), bits(rq[3]))


@pytest.mark.parametrize("row_scale", [True, False])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("M,N", [(1, 8), (37, 40), (3, 1000)])
def test_int8_dequant_is_bit_identical(row_scale, has_bias, M, N):
    g = torch.Generator().manual_seed(M * 101 + N + 2 * row_scale + has_bias)
    acc = torch.randint(-2 ** 26, 2 ** 26, (M, N), generator=g, dtype=torch.int32)   # past 2^24: rounds to fp32
    x_scale = torch.rand(M, 1, generator=g) / 127 if row_scale else torch.tensor(0.0123)
    w_scale = torch.rand(1, N, generator=g) / 127
    bias = torch.randn(N, generator=g) * 100 if has_bias else None
    ref = acc.float() * x_scale * w_scale
    ref = (ref if bias is None else ref + bias.float()).to(torch.bfloat16)   # int8_linear's torch epilogue
    assert torch.equal(bits(int8_dequant_torch(acc, x_scale, w_scale, bias)), bits(ref))
    args = [t.to(DEVICE) if t is not None else None for t in (acc, x_scale, w_scale, bias)]
    out = int8_dequant(*args)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert torch.equal(bits(out.cpu()), bits(ref))


def _torch_route(monkeypatch):
    """QuantLinear and int8_linear on the torch ops (as where no kernels run)."""
    monkeypatch.setattr(quant, "kernels_run", lambda device: False)


@pytest.mark.parametrize("fmt,route", [("fp8", "scaled_mm"), ("int8", "int_mm")])
@pytest.mark.parametrize("M", [3, 37])      # int_mm pads M <= 16 to 17 rows
def test_quant_linear_kernels_match_torch_ops(monkeypatch, fmt, route, M):
    """The same module, the same input: the Triton path and the torch path give the same bits (the GEMMs
    themselves, torch._scaled_mm and torch._int_mm, run on the CPU too)."""
    torch.manual_seed(M)
    lin = torch.nn.Linear(48, 32)     # torch._scaled_mm on a GPU takes K and N in multiples of 16
    x = torch.randn(M, 48)
    x[0] *= 50
    ql = QuantLinear(lin, fmt, route).to(DEVICE)
    assert ql.fused_quantize(torch.device(DEVICE))
    assert "Triton launch (quantize_rows)" in repr(ql)
    with torch.inference_mode(), torch.autocast(DEVICE, torch.bfloat16):
        fused = ql(x.to(DEVICE))
        _torch_route(monkeypatch)
        assert "quantized by torch ops" in repr(ql)
        plain = ql(x.to(DEVICE))
    assert fused.dtype == plain.dtype == torch.bfloat16
    assert torch.equal(bits(fused), bits(plain))


def test_static_scale_keeps_torch_quantize():
    lin = torch.nn.Linear(16, 8)
    ql = QuantLinear(lin, "int8", "int_mm", input_scale=torch.tensor(0.05))
    assert not ql.fused_quantize(torch.device(DEVICE))
    assert "quantized by torch ops" in repr(ql)


def test_quantize_rows_takes_no_host_sync():
    """A graph-capturable op: nothing reads tensor data on the host (a fake tensor would refuse)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 24, dtype=torch.bfloat16)
        q, s = quant.quantize_rows.opaque(x, "fp8")
        out = quant.int8_dequant.opaque(torch.empty(5, 8, dtype=torch.int32), torch.empty(5, 1), torch.empty(1, 8), None)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 1) and out.dtype == torch.bfloat16


def test_quant_linear_compiles_whole():
    """torch.compile takes both kernels as operators in one graph (fullgraph: no break), same bits."""
    torch.manual_seed(5)
    ql = QuantLinear(torch.nn.Linear(40, 24), "int8", "int_mm").to(DEVICE)
    x = torch.randn(37, 40, device=DEVICE)
    with torch.inference_mode():
        eager = ql(x)
        compiled = torch.compile(ql, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(bits(eager), bits(compiled))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M, K", [(1, 8), (37, 136), (3, 1000)])
def test_gelu_quantize_rows_is_nn_gelu_then_quantize_rows(fmt, M, K):
    """One launch for an MLP's GELU and fc2's input quantization: the bits of nn.GELU (in the input's dtype)
    then quantize_rows, but 1 + erf(x/sqrt 2) cancels for x < -3, where erf's last bit (libdevice's against
    the one torch's CUDA kernel calls; numpy's under the interpreter) decides GELU's rounding, so a few
    values may land one quantization step apart."""
    from workbench.kernels.quant import gelu_quantize_rows, gelu_quantize_rows_torch

    g = torch.Generator().manual_seed(M * 7 + K + (fmt == "int8"))
    h = torch.randn(M, K, generator=g) * 4
    h[0, 0] = 60.0                                  # GELU(x) = x out there: the row's amax
    if M > 2:
        h[1] = -8.0                                 # GELU ~ -0: a row of (signed) zeros, scale 1
    for dtype in (torch.bfloat16, torch.float32):
        x = h.to(dtype).to(DEVICE)
        q, s = gelu_quantize_rows(x, fmt)
        rq, rs = gelu_quantize_rows_torch(x, fmt)
        assert q.dtype == rq.dtype and s.shape == rs.shape == (M, 1)
        assert torch.allclose(s, rs, rtol=1e-6, atol=0)
        differ = (q.float() != rq.float())
        assert differ.sum().item() <= max(2, q.numel() // 200)
        step = s.expand_as(q)[differ] * (1.0 if fmt == "int8" else 2.0 ** -6 * 448)
        assert ((q.float() - rq.float()).abs()[differ] * s.expand_as(q)[differ] <= step + 1e-12).all()


def test_gelu_quantize_rows_is_an_operator_without_host_sync():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, s = quant.gelu_quantize_rows.opaque(torch.empty(5, 24, dtype=torch.bfloat16), "int8")
    assert q.dtype == torch.int8 and s.shape == (5, 1)
    torch.library.opcheck(quant.gelu_quantize_rows.opaque,
                          (torch.randn(7, 24, device=DEVICE, dtype=torch.bfloat16), "fp8"),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def _operands(fmt: str, M: int, K: int, N: int, seed: int, row_scale: bool = True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    x[0] *= 40
    w = torch.randn(N, K, generator=g) * 0.1
    x_q, x_scale = quant.quantize_rows_torch(x, fmt)
    if not row_scale:
        x_scale = torch.tensor(0.021)
        x_q = quant.quantize(x, x_scale, fmt)
    w_scale = quant.absmax_scale(w, fmt, dim=-1)
    w_q = quant.quantize(w, w_scale, fmt).contiguous()
    return x_q, x_scale, w_q, w_scale.reshape(1, -1).contiguous()


@pytest.fixture(params=["pointer", "tma"])
def gemm_kernel(request, monkeypatch):
    """Each test of the quantized GEMMs runs on both kernels: the pointer one and the persistent TMA one
    (under the interpreter too, where the TMA kernel is otherwise off; on a GPU before Hopper it stays
    the pointer kernel)."""
    monkeypatch.setattr(quant, "USE_TMA", request.param == "tma")
    return request.param


def _tma_shape(K: int, N: int, out_bytes: int = 2) -> bool:
    """Whether the TMA kernel takes a GEMM of this K and N: rows 16-byte aligned (else the pointer kernel)."""
    return K % 16 == 0 and (N * out_bytes) % 16 == 0


@pytest.mark.parametrize("row_scale", [True, False])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("M,K,N", [(1, 8, 8), (37, 40, 24), (70, 136, 72), (5, 264, 40), (33, 272, 48)])
def test_quant_matmul_int8_is_int8_linear_bit_for_bit(row_scale, has_bias, M, K, N, gemm_kernel):
    """The same exact int32 sums and the same fp32 epilogue: int8_linear's bits (K not a multiple of the
    tile: the masked tail, or TMA's zero-filled blocks; M and N not multiples of it: the edge tiles; rows
    not 16-byte aligned: the pointer kernel where TMA was asked for)."""
    x_q, x_scale, w_q, w_scale = _operands("int8", M, K, N, seed=M + K + N, row_scale=row_scale)
    bias = torch.randn(N) * 3 if has_bias else None
    ref = quant.int8_dequant_torch(torch._int_mm(torch.nn.functional.pad(x_q, (0, 0, 0, max(0, 17 - M))),
                                                 w_q.t())[:M], x_scale, w_scale, bias)
    args = [t.to(DEVICE) if t is not None else None for t in (x_q, x_scale, w_q, w_scale, bias)]
    out = quant.quant_matmul(*args)
    assert out.dtype == torch.bfloat16 and out.shape == (M, N)
    assert torch.equal(bits(out.cpu()), bits(ref))


@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("M,K,N", [(1, 16, 16), (37, 48, 32), (70, 160, 80), (130, 1040, 48)])
def test_quant_matmul_fp8_against_float64(has_bias, M, K, N, gemm_kernel):
    """e4m3 products are exact in fp32 and the sums run in fp32: within a bf16 rounding of the float64
    result of the same quantized operands, plus, on a GPU, the tensor cores' narrower e4m3 accumulation
    (sm_90: about 13 bits, at most 4 steps of 128 products before the fp32 sum): 2^-12 of the sum of the
    products' magnitudes; and within that of _scaled_mm's result on a GPU."""
    x_q, x_scale, w_q, w_scale = _operands("fp8", M, K, N, seed=M * 3 + K)
    bias = (torch.randn(N) * 3).to(torch.bfloat16) if has_bias else None
    ref = (x_q.double() @ w_q.double().t()) * x_scale.double() * w_scale.double()
    size = (x_q.double().abs() @ w_q.double().abs().t()) * x_scale.double() * w_scale.double()
    if bias is not None:
        ref = ref + bias.double()
    args = [t.to(DEVICE) if t is not None else None for t in (x_q, x_scale, w_q, w_scale, bias)]
    out = quant.quant_matmul(*args).cpu().double()
    narrow = size * 2.0 ** -12 if DEVICE == "cuda" else 0.0
    assert ((out - ref).abs() <= ref.abs() * 2.0 ** -8 + narrow + 1e-6 * ref.abs().max()).all()
    if DEVICE == "cuda" and K >= 32:   # _scaled_mm takes K >= 32
        smm = quant.fp8_linear(*args).cpu().double()
        assert ((out - smm).abs() <= smm.abs() * 2.0 ** -7 + 2 * narrow + 1e-5 * smm.abs().max()).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("M,K,N", [(1, 16, 16), (37, 40, 24), (70, 136, 72), (45, 272, 96)])
def test_quant_matmul_act_is_the_linear_then_gelu_then_quantize(fmt, gelu, M, K, N, gemm_kernel):
    """The activation and the next Linear's static quantization in the GEMM's epilogue, against float64 of
    the same operands: the Linear (scales, bias), GELU's tanh form where asked, then one rounding to bf16,
    or quantization at the static scale. The kernel computes in fp32 (and on a GPU accumulates e4m3 as the
    tensor cores do, with the hardware's tanh: about 2^-12 |x| off GELU), so a value may round to the
    neighbouring bf16 or step of the format, never further."""
    x_q, x_scale, w_q, w_scale = _operands(fmt, M, K, N, seed=M * 5 + K + N)
    bias = torch.randn(N) * 2
    bias = bias.to(torch.bfloat16) if fmt == "fp8" else bias
    args = [t.to(DEVICE) for t in (x_q, x_scale, w_q, w_scale, bias)]
    y = (x_q.double() @ w_q.double().t()) * x_scale.double() * w_scale.double() + bias.double()
    size = (x_q.double().abs() @ w_q.double().abs().t()) * x_scale.double() * w_scale.double() + bias.double().abs()
    h = _gelu_tanh64(y) if gelu else y
    # what the kernel's fp32 may be off h before its last rounding
    slack = (2.0 ** -10 * y.abs() if gelu and DEVICE == "cuda" else 0) + size * (2.0 ** -12 if DEVICE == "cuda" else 2.0 ** -20)
    scale = (h.abs().amax() / 300).float().reshape(())       # some values saturate
    out = quant.quant_matmul_act(*args, gelu, scale.to(DEVICE)).cpu()
    wide = quant.quant_matmul_act(*args, gelu, None).cpu()
    assert out.dtype == quant.QDTYPE[fmt] and out.shape == (M, N) and wide.dtype == torch.bfloat16
    assert ((wide.double() - h).abs() <= h.abs() * 2.0 ** -8 + slack + 1e-30).all()
    q = (h / scale.double()).clamp(-quant.QMAX[fmt], quant.QMAX[fmt])
    step = 1.0 if fmt == "int8" else q.abs() * 2.0 ** -3 + 2.0 ** -9      # the format's step at q, at most
    assert ((out.double() - q).abs() <= step + slack / scale.double()).all()
    # most values land where rounding the float64 value would put them
    assert (out.double() == quant.quantize(q.float(), torch.tensor(1.0), fmt).double()).float().mean() > 0.97
    if not gelu:    # the bf16 result is quant_matmul's
        assert torch.equal(bits(wide), bits(quant.quant_matmul(*args).cpu()))


def _gelu_tanh64(y: torch.Tensor) -> torch.Tensor:
    """nn.GELU(approximate='tanh') of y in float64, as x / (1 + exp(-2u)) (torch's own 0.5 x (1 + tanh u)
    cancels where x is negative)."""
    x = y.double()
    return x / (1 + torch.exp(-2 * x * (0.7978845608028654 + 0.0356774081363001 * x * x)))


def test_quant_matmul_act_is_an_operator_without_host_sync():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = quant.quant_matmul_act.opaque(torch.empty(5, 32, dtype=torch.int8), torch.empty(5, 1),
                                            torch.empty(8, 32, dtype=torch.int8), torch.empty(1, 8), None, True,
                                            torch.empty(()))
    assert out.shape == (5, 8) and out.dtype == torch.int8
    x_q, x_scale, w_q, w_scale = _operands("int8", 7, 32, 16, seed=3)
    torch.library.opcheck(quant.quant_matmul_act.opaque,
                          tuple(t.to(DEVICE) for t in (x_q, x_scale, w_q, w_scale)) + (None, True,
                                                                                     torch.tensor(0.05, device=DEVICE)),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    with pytest.raises(ValueError, match="out_scale must be one fp32 value"):
        quant.quant_matmul_act(x_q.to(DEVICE), x_scale.to(DEVICE), w_q.to(DEVICE), w_scale.to(DEVICE), None, False,
                               torch.ones(2, device=DEVICE))


@pytest.mark.parametrize("fmt,torch_route", [("fp8", "scaled_mm"), ("int8", "int_mm")])
@pytest.mark.parametrize("static", [False, True])
def test_quant_linear_on_the_triton_route(fmt, torch_route, static, gemm_kernel):
    """QuantLinear(route='triton'): int8 gives the torch route's bits; e4m3 the float64 result of the same
    operands rounded once to bf16 (the bias added in fp32 before the rounding), dynamic and static scales."""
    torch.manual_seed(7)
    lin = torch.nn.Linear(48, 32)
    x = torch.randn(37, 48)
    scale = torch.tensor(0.03) if static else None
    tri = QuantLinear(lin, fmt, "triton", scale).to(DEVICE)
    ref = QuantLinear(lin, fmt, torch_route, scale).to(DEVICE)
    assert "one Triton launch (quant_matmul)" in repr(tri)
    with torch.inference_mode(), torch.autocast(DEVICE, torch.bfloat16):
        out, want = tri(x.to(DEVICE)), ref(x.to(DEVICE))
    assert out.dtype == want.dtype == torch.bfloat16
    if fmt == "int8":
        assert torch.equal(bits(out), bits(want))
    else:   # against float64 of the same operands: the bf16 rounding of the products' sum plus the bias
        x_q, x_scale = (quant.quantize_rows_torch(x, fmt) if scale is None else (quant.quantize(x, scale, fmt), scale))
        main = (x_q.double() @ tri.weight_q.cpu().double().t()) * x_scale.double() * tri.weight_scale.cpu().double()
        size = (x_q.double().abs() @ tri.weight_q.cpu().double().abs().t()) * x_scale.double() * tri.weight_scale.cpu().double()
        bias = tri.bias.cpu().double()
        err = (out.cpu().double() - (main + bias)).abs()
        narrow = size * 2.0 ** -12 if DEVICE == "cuda" else 0.0    # the tensor cores' e4m3 accumulation
        assert (err <= ((main + bias).abs() + 1e-30) * 2.0 ** -8 + narrow + 1e-6).all()


def test_quant_matmul_is_an_operator_without_host_sync():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = quant.quant_matmul.opaque(torch.empty(5, 32, dtype=torch.int8), torch.empty(5, 1),
                                        torch.empty(8, 32, dtype=torch.int8), torch.empty(1, 8), None)
    assert out.shape == (5, 8) and out.dtype == torch.bfloat16
    ql = QuantLinear(torch.nn.Linear(40, 24), "int8", "triton").to(DEVICE)
    x = torch.randn(37, 40, device=DEVICE)
    with torch.inference_mode():
        assert torch.equal(bits(ql(x)), bits(torch.compile(ql, backend="aot_eager", fullgraph=True)(x)))
