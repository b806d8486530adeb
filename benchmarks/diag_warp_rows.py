"""Would the LayerNorm + shift + partition forward and backward be faster with each row of a tile on one warp?

The shipped forward (window._partition_fwd_kernel) holds a (tokens x C) tile; at C = 512-1024 Triton lays
each row across all the program's warps, so the row's mean and variance each take an exchange between warps
through shared memory (two barriers each). This diagnostic's forward holds the same tile as
(C / 256 chunks, tokens, 256): Triton gives the 256-wide dimension to one warp's 32 lanes (8 bf16 each) and
the warps to the tokens, so a row's sums are a warp's shuffles plus the chunks inside each thread, with no
exchange between warps. It walks the image tokens in order (contiguous loads) and stores each at its window
row (window._window_row_of_token), so it covers maps that are whole multiples of the window only. Its
backward takes the same tiles in bands (one evenly loaded wave of programs), a row's two sums a warp's, the
dweight/dbias partials summed over the band's tokens, across warps, once at the end, into 2 rows of sums;
timed with the launch that adds them up and casts them, as the shipped backward is.

    python benchmarks/diag_warp_rows.py              # GPU: check against the shipped kernels, then time them
    TRITON_INTERPRET=1 python benchmarks/diag_warp_rows.py --check   # CPU: the check alone (small shapes)

The timing is bench_window's: CUDA-graph replay over input sets that exceed the L2.

Measured (H200, 2026-12-01 18:00, benchmarks/results/diag_warp_rows_h200.json; µs): a warp per row pays
nowhere. Forward, shipped vs the best warp-rows tile: s2 16.5 vs 17.9, s3 9.5 vs 8.9, s4 5.2 vs 5.5.
Backward with its sum/cast launch: s2 31.0 vs 35.3, s3 14.0 vs 15.0, s4 10.2 vs 10.1. Not ported.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workbench.kernels.layer_norm import to_dtype  # noqa: E402

win = importlib.import_module("workbench.kernels.window")

CW = 256  # columns one warp covers in one pass: 32 lanes x 8 bf16 (16 bytes)


@triton.jit
def _warp_rows_fwd_kernel(x_ptr, out_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, n_tokens, eps,
                          C: tl.constexpr, H: tl.constexpr, W: tl.constexpr, n_win_h: tl.constexpr,
                          n_win_w: tl.constexpr, shift_h: tl.constexpr, shift_w: tl.constexpr, WS: tl.constexpr,
                          BLOCK_T: tl.constexpr, CHUNKS: tl.constexpr, CW: tl.constexpr, SOFT_RTNE: tl.constexpr):
    """LayerNorm of image tokens [pid * BLOCK_T, +BLOCK_T), each stored at its window row; tiles of
    (CHUNKS, BLOCK_T, CW): column c of token t sits at [c // CW, t, c % CW]."""
    s = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    s_mask = s < n_tokens
    row = win._window_row_of_token(s, H, W, n_win_h, n_win_w, shift_h, shift_w, WS)
    k = tl.arange(0, CHUNKS)[:, None, None] * CW + tl.arange(0, CW)[None, None, :]
    k_mask = k < C
    mask = s_mask[None, :, None] & k_mask
    x = tl.load(x_ptr + s.to(tl.int64)[None, :, None] * C + k, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(tl.sum(x, axis=2), axis=0) / C
    xc = tl.where(mask, x - mean[None, :, None], 0.0)
    var = tl.sum(tl.sum(xc * xc, axis=2), axis=0) / C
    rstd = 1.0 / tl.sqrt(var + eps)
    # the parameters loaded in the tile's own layout (each warp its copy, from L1): no layout conversion
    kt = k + tl.zeros((1, BLOCK_T, 1), dtype=tl.int32)
    w = tl.load(w_ptr + kt, mask=kt < C, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + kt, mask=kt < C, other=0.0).to(tl.float32)
    y = xc * rstd[None, :, None] * w + b
    tl.store(out_ptr + row.to(tl.int64)[None, :, None] * C + k, to_dtype(y, out_ptr.dtype.element_ty, SOFT_RTNE),
             mask=mask)
    tl.store(mean_ptr + s, mean, mask=s_mask)
    tl.store(rstd_ptr + s, rstd, mask=s_mask)


@triton.jit
def _warp_rows_bwd_kernel(g_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, sums_ptr, n_tokens, tiles_per_prog,
                          C: tl.constexpr, H: tl.constexpr, W: tl.constexpr, n_win_h: tl.constexpr,
                          n_win_w: tl.constexpr, shift_h: tl.constexpr, shift_w: tl.constexpr, WS: tl.constexpr,
                          BLOCK_T: tl.constexpr, CHUNKS: tl.constexpr, CW: tl.constexpr, SLOTS: tl.constexpr,
                          STAGES: tl.constexpr, SOFT_RTNE: tl.constexpr):
    """The LayerNorm + partition backward on the same (CHUNKS, BLOCK_T, CW) tiles: program p takes a band of
    tiles_per_prog tiles of image tokens; a row's two sums are a warp's, the band's dweight/dbias partials
    are (CHUNKS, BLOCK_T, CW) tiles summed over the tokens (across warps) once at the end and added into row
    p % SLOTS of sums (SLOTS, 2C)."""
    pid = tl.program_id(0)
    k = tl.arange(0, CHUNKS)[:, None, None] * CW + tl.arange(0, CW)[None, None, :]
    kt = k + tl.zeros((1, BLOCK_T, 1), dtype=tl.int32)
    w = tl.load(w_ptr + kt, mask=kt < C, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((CHUNKS, BLOCK_T, CW), dtype=tl.float32)
    db_acc = tl.zeros((CHUNKS, BLOCK_T, CW), dtype=tl.float32)
    tok0 = pid * tiles_per_prog * BLOCK_T
    for t in tl.range(0, tiles_per_prog, num_stages=STAGES):
        s = tok0 + t * BLOCK_T + tl.arange(0, BLOCK_T)
        s_mask = s < n_tokens
        row = win._window_row_of_token(s, H, W, n_win_h, n_win_w, shift_h, shift_w, WS)
        mask = s_mask[None, :, None] & (k < C)
        x_off = s.to(tl.int64)[None, :, None] * C + k
        g = tl.load(g_ptr + row.to(tl.int64)[None, :, None] * C + k, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + s, mask=s_mask, other=0.0)
        rstd = tl.load(rstd_ptr + s, mask=s_mask, other=0.0)
        xhat = tl.where(mask, (x - mean[None, :, None]) * rstd[None, :, None], 0.0)
        wg = g * w
        c1 = tl.sum(tl.sum(xhat * wg, axis=2), axis=0) / C
        c2 = tl.sum(tl.sum(wg, axis=2), axis=0) / C
        dx = (wg - (xhat * c1[None, :, None] + c2[None, :, None])) * rstd[None, :, None]
        tl.store(dx_ptr + x_off, to_dtype(dx, dx_ptr.dtype.element_ty, SOFT_RTNE), mask=mask)
        dw_acc += g * xhat
        db_acc += g
    kk = tl.arange(0, CHUNKS)[:, None] * CW + tl.arange(0, CW)[None, :]
    slot = sums_ptr + (pid % SLOTS) * 2 * C
    tl.atomic_add(slot + kk, tl.sum(dw_acc, axis=1), mask=kk < C, sem="relaxed")
    tl.atomic_add(slot + C + kk, tl.sum(db_acc, axis=1), mask=kk < C, sem="relaxed")


def warp_rows_fwd(x, weight, bias, eps, window_size, shift, block_t=4, num_warps=4):
    """-> (windows, mean, rstd) as window.norm_shift_partition_fwd gives them (maps of whole windows)."""
    B, H, W, C = x.shape
    Hp, Wp, nwh, nww, sh, sw = win._geometry(H, W, window_size, shift)
    if (Hp, Wp) != (H, W):
        raise ValueError("diag_warp_rows covers maps that are whole multiples of the window only")
    n_tok = B * H * W
    chunks = triton.next_power_of_2(-(-C // CW))
    out = torch.empty((B * nwh * nww, window_size * window_size, C), dtype=x.dtype, device=x.device)
    mean = torch.empty(n_tok, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    _warp_rows_fwd_kernel[(triton.cdiv(n_tok, block_t),)](
        x, out, weight, bias, mean, rstd, n_tok, float(eps), C=C, H=H, W=W, n_win_h=nwh, n_win_w=nww,
        shift_h=sh, shift_w=sw, WS=window_size, BLOCK_T=block_t, CHUNKS=chunks, CW=CW, SOFT_RTNE=win._SOFT_RTNE,
        num_warps=num_warps)
    return out, mean, rstd


def warp_rows_bwd(g, x, weight, mean, rstd, window_size, shift, sums, block_t=4, num_warps=4, per_sm=2, stages=3):
    """dx (x's shape and dtype) and the column sums added into sums (SLOTS, 2C) fp32 (zeroed by the caller),
    a band of tiles per program, per_sm programs per SM (one evenly loaded wave)."""
    B, H, W, C = x.shape
    Hp, Wp, nwh, nww, sh, sw = win._geometry(H, W, window_size, shift)
    if (Hp, Wp) != (H, W):
        raise ValueError("diag_warp_rows covers maps that are whole multiples of the window only")
    n_tok = B * H * W
    n_tiles = triton.cdiv(n_tok, block_t)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    tiles = triton.cdiv(n_tiles, min(n_tiles, per_sm * sms))
    dx = torch.empty_like(x)
    _warp_rows_bwd_kernel[(triton.cdiv(n_tiles, tiles),)](
        g, x, weight, mean, rstd, dx, sums, n_tok, tiles, C=C, H=H, W=W, n_win_h=nwh, n_win_w=nww,
        shift_h=sh, shift_w=sw, WS=window_size, BLOCK_T=block_t, CHUNKS=triton.next_power_of_2(-(-C // CW)), CW=CW,
        SLOTS=sums.shape[0], STAGES=stages, SOFT_RTNE=win._SOFT_RTNE, num_warps=num_warps)
    return dx


def check(shapes, device, dtype) -> bool:
    ok = True
    for B, H, W, C, shift in shapes:
        g = torch.Generator(device=device).manual_seed(C)
        x = (torch.randn(B, H, W, C, generator=g, device=device) * 2 + 0.5).to(dtype)
        w = (torch.randn(C, generator=g, device=device) * 0.5 + 1).to(dtype)
        b = (torch.randn(C, generator=g, device=device) * 0.5).to(dtype)
        want = win.norm_shift_partition_fwd(x, w, b, 1e-5, 7, shift)
        got = warp_rows_fwd(x, w, b, 1e-5, 7, shift)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        errs = [(a.float() - e.float()).abs().max().item() for a, e in zip(got, want)]
        good = all(err <= tol * max(1.0, e.float().abs().max().item()) for err, e in zip(errs, want))
        dwin = torch.randn(want[0].shape, generator=g, device=device).to(dtype)
        dx_want, sums_want = win.norm_shift_partition_bwd(dwin, x, w, want[1], want[2], 7, shift)
        sums = torch.zeros(2, 2 * C, device=device)
        dx = warp_rows_bwd(dwin, x, w, want[1], want[2], 7, shift, sums)
        dx_err = (dx.float() - dx_want.float()).abs().max().item()
        sums_err = ((sums.sum(0) - sums_want).abs().max() / sums_want.abs().max()).item()
        good &= dx_err <= tol * max(1.0, dx_want.float().abs().max().item()) and sums_err <= 1e-4
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {B}x{H}x{W}x{C} shift {shift} {dtype}: max |diff| windows {errs[0]:.2e}, "
              f"mean {errs[1]:.2e}, rstd {errs[2]:.2e}; dx {dx_err:.2e}, sums {sums_err:.1e} of their largest")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare with the shipped forward")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    small = [(2, 14, 14, 512, 3), (1, 7, 7, 1024, 0), (1, 14, 14, 300, 3)]
    if not check(small, device, torch.float32) or not check(small, device, torch.bfloat16):
        return 1
    if args.check or device == "cpu":
        return 0
    from bench_window import n_input_sets  # noqa: E402
    from workbench.env import environment_stamp  # noqa: E402
    from workbench.timing import cuda_graph_us  # noqa: E402

    records = []
    for stage, (B, H, W, C, shift) in {"s2": (64, 28, 28, 256, 3), "s3": (64, 14, 14, 512, 3),
                                        "s4": (64, 7, 7, 1024, 0)}.items():
        n_sets = n_input_sets(3 * B * H * W * C * 2)
        sets = []
        for _ in range(n_sets):
            x = (torch.randn(B, H, W, C, device=device) * 2 + 0.5).to(torch.bfloat16)
            w, b = (torch.randn(C, device=device).to(torch.bfloat16) for _ in range(2))
            _, mean, rstd = win.norm_shift_partition_fwd(x, w, b, 1e-5, 7, shift)
            g = torch.randn(B * H * W // 49, 49, C, device=device).to(torch.bfloat16)
            sets.append((x, w, b, mean, rstd, g, torch.zeros(4, 2 * C, device=device)))
        rec = {"stage": stage, "B": B, "H": H, "W": W, "C": C, "input_sets": n_sets}
        fwd = {"fwd shipped": win.norm_shift_partition_fwd, "fwd warp rows bt4 w4": warp_rows_fwd,
               "fwd warp rows bt8 w8": lambda *a: warp_rows_fwd(*a, block_t=8, num_warps=8),
               "fwd warp rows bt2 w2": lambda *a: warp_rows_fwd(*a, block_t=2, num_warps=2)}
        for name, fn in fwd.items():
            rec[name] = cuda_graph_us([lambda s=s, fn=fn: fn(s[0], s[1], s[2], 1e-5, 7, shift) for s in sets],
                                      replays=30)[0]

        def shipped_bwd(s):  # as the autograd backward of a bf16 model runs it: the kernel, then the sum/cast
            return win._norm_grads(win.norm_shift_partition_bwd(s[5], s[0], s[1], s[3], s[4], 7, shift,
                                                                raw_sums=True)[1], s[1], s[2])

        def warp_bwd(s, **kw):  # the same with the warp-per-row kernel (its rows of sums not re-zeroed)
            warp_rows_bwd(s[5], s[0], s[1], s[3], s[4], 7, shift, s[6][:2], **kw)
            return win._norm_grads(s[6][:2], s[1], s[2])

        bwd = {"bwd shipped": shipped_bwd, "bwd warp rows bt4 w4 2/SM": warp_bwd,
               "bwd warp rows bt4 w4 3/SM": lambda s: warp_bwd(s, per_sm=3),
               "bwd warp rows bt8 w8 1/SM": lambda s: warp_bwd(s, block_t=8, num_warps=8, per_sm=1),
               "bwd warp rows bt2 w2 4/SM": lambda s: warp_bwd(s, block_t=2, num_warps=2, per_sm=4)}
        for name, fn in bwd.items():
            rec[name] = cuda_graph_us([lambda s=s, fn=fn: fn(s) for s in sets], replays=30)[0]
        records.append(rec)
        print(stage, " | ".join(f"{k} {v:.2f}" for k, v in rec.items() if isinstance(v, float)), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"benchmark": "diag_warp_rows", "environment": environment_stamp("cuda"),
                                        "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
