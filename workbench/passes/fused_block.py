"""Pass `fused_block`: each timm SwinTransformerBlock runs as one autograd Function, for the host.

After the kernel passes (fused_window, fused_attention, fused_layernorm's add+norm2, fused_linear) a
Swin-B training step does 2.5x less GPU work than AMP, yet in eager mode it is no faster: the step is
bound by the host issuing ~1,600 launches, each wrapped in an nn.Module call, autocast dispatch,
autograd graph recording or a Python autograd Function (`reports/h200-swin_base-b64-prof-api/`).
This pass keeps the same kernels and the same cuBLAS GEMMs but issues a block's forward and backward
from one `SwinBlockFunction`:

    forward   norm_shift_partition -> qkv GEMM -> window attention -> proj GEMM -> merge_roll
              -> add + norm2 (add_layer_norm) -> fc1 GEMM -> GELU -> fc2 GEMM -> + residual
    backward  the same in reverse, by hand: bias gradients and the GELU backward in the fused
              reduction (kernels.linear), LayerNorm backwards with the residual gradient folded in

so autograd records one node per block instead of 21 (eight of them Python autograd Functions, in the
dense stack under autocast), and the block's Python runs once per direction. Its backward zeroes one
buffer for all six column reductions of the block and scatters the relative-position table's gradient
with one index_add_. Numerics are those of the dense stage under autocast: GEMMs in the autocast dtype on
weights cast once per step, LayerNorm statistics and the residual stream in fp32, the attention in the
fused kernel, bias gradients summed in fp32. The LayerNorms write their outputs straight in the GEMMs'
dtype (one rounding, as autocast's cast would do).

A block is fused when it is timm's plain configuration: square window and shift, no stochastic depth
or dropout active, LayerNorms with weight and bias, qkv/proj/fc biases, timm's Mlp with exact GELU and
no hidden norm. Others keep the forward they had (counted in the details). Under torch.compile the
Function is not traced: the block runs its previous forward, whose kernels are custom ops there.
"""
from __future__ import annotations

import types

import torch

from . import PassContext, PassResult, PassUnavailable
from ._swin import gather_rel_pos_bias, inactive, scatter_rel_pos_grad, square, swin_blocks

NAME = "fused_block"


def _why_not(blk) -> str | None:
    """None when the block has the plain configuration the Function implements, else the reason."""
    attn, mlp = blk.attn, blk.mlp
    if square(blk.window_size) is None or square(blk.shift_size) is None:
        return "non-square window or shift"
    for name in ("norm1", "norm2"):
        norm = getattr(blk, name)
        if tuple(getattr(norm, "normalized_shape", ())) != (blk.dim,) or getattr(norm, "weight", None) is None \
                or getattr(norm, "bias", None) is None:
            return f"{name} is not a LayerNorm with weight and bias"
    if not hasattr(attn, "relative_position_bias_table") or not hasattr(attn, "relative_position_index"):
        return "attention without timm's relative position table"
    linears = (attn.qkv, attn.proj, getattr(mlp, "fc1", None), getattr(mlp, "fc2", None))
    if any(not isinstance(lin, torch.nn.Linear) or lin.bias is None for lin in linears):
        return "a Linear without bias, or an MLP that is not timm's Mlp"
    act = getattr(mlp, "act", None)
    if not isinstance(act, torch.nn.GELU) or act.approximate != "none":
        return "MLP activation is not exact GELU"
    if not isinstance(getattr(mlp, "norm", torch.nn.Identity()), torch.nn.Identity):
        return "MLP with a hidden norm"
    return None


def _dropouts_inactive(blk) -> bool:
    training = blk.training
    mods = (blk.drop_path1, blk.drop_path2, blk.attn.attn_drop, blk.attn.proj_drop,
            getattr(blk.mlp, "drop1", None), getattr(blk.mlp, "drop2", None))
    return all(inactive(m, training) for m in mods)


class SwinBlockFunction(torch.autograd.Function):
    """One timm SwinTransformerBlock (x: (B, H, W, C) -> (B, H, W, C)), forward and backward by hand.

    apply(x, mask, index, geom, n1w, n1b, qkv_w, qkv_b, table, proj_w, proj_b, n2w, n2b,
          fc1_w, fc1_b, fc2_w, fc2_b)
    geom = (window, shift, heads, scale, eps1, eps2, compute dtype). mask: (nW, N, N) or None;
    index: the relative-position index (N*N,) into table (rows, heads)."""

    @staticmethod
    def forward(ctx, x, mask, index, geom, n1w, n1b, qkv_w, qkv_b, table, proj_w, proj_b, n2w, n2b,
                fc1_w, fc1_b, fc2_w, fc2_b):
        from ..kernels.layer_norm import layer_norm_fwd
        from ..kernels.window import merge_roll_fwd, norm_shift_partition_fwd
        from ..kernels.window_attention import window_attention_fwd

        ws, shift, heads, scale, eps1, eps2, dt = geom
        B, H, W, C = x.shape
        with torch.autocast(x.device.type, enabled=False):
            x = x.contiguous()
            w_qkv, w_proj, w_fc1, w_fc2 = (w.to(dt) for w in (qkv_w, proj_w, fc1_w, fc2_w))
            win, mean1, rstd1 = norm_shift_partition_fwd(x, n1w, n1b, eps1, ws, shift, out_dtype=dt)
            bnw, n, _ = win.shape
            win2 = win.view(-1, C)
            qkv = torch.addmm(qkv_b.to(dt), win2, w_qkv.t()).view(bnw, n, 3, heads, C // heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            rel = gather_rel_pos_bias(table, index, n)
            attn, lse = window_attention_fwd(q, k, v, rel, mask, scale)   # a (bnw, heads, n, d) view
            o = attn.transpose(1, 2).reshape(bnw * n, C)                  # of a (bnw, n, heads, d) buffer
            proj = torch.addmm(proj_b.to(dt), o, w_proj.t())
            branch = merge_roll_fwd(proj.view(bnw, n, C), ws, shift, H, W)
            s, h, mean2, rstd2 = layer_norm_fwd(x.view(-1, C), branch.view(-1, C), n2w, n2b, eps2,
                                                torch.promote_types(x.dtype, dt), y_dtype=dt)
            pre = torch.addmm(fc1_b.to(dt), h, w_fc1.t())
            act = torch.nn.functional.gelu(pre)
            out = s + torch.addmm(fc2_b.to(dt), act, w_fc2.t())
        ctx.save_for_backward(x, n1w, n1b, mean1, rstd1, win2, w_qkv, qkv, attn, lse, rel, o, w_proj, s,
                              n2w, n2b, mean2, rstd2, h, w_fc1, pre, act, w_fc2, mask, index, table)
        ctx.geom = geom
        ctx.dtypes = tuple(t.dtype for t in (qkv_w, qkv_b, proj_w, proj_b, fc1_w, fc1_b, fc2_w, fc2_b))
        return out.view(B, H, W, C)

    @staticmethod
    def backward(ctx, dout):
        from ..kernels._common import split_column_sums, split_norm_grads
        from ..kernels.layer_norm import layer_norm_bwd
        from ..kernels.linear import bias_grad_host
        from ..kernels.window import _norm_bwd_slots, norm_shift_partition_bwd, roll_partition_fwd
        from ..kernels.window_attention import window_attention_bwd

        (x, n1w, n1b, mean1, rstd1, win2, w_qkv, qkv, attn, lse, rel, o, w_proj, s, n2w, n2b, mean2, rstd2,
         h, w_fc1, pre, act, w_fc2, mask, index, table) = ctx.saved_tensors
        ws, shift, heads, scale, eps1, eps2, dt = ctx.geom
        t_qkv_w, t_qkv_b, t_proj_w, t_proj_b, t_fc1_w, t_fc1_b, t_fc2_w, t_fc2_b = ctx.dtypes
        B, H, W, C = x.shape
        bnw, n = qkv.shape[:2]
        with torch.autocast(dout.device.type, enabled=False):
            d = dout.reshape(-1, C).contiguous()
            # Every column reduction of the block (four bias gradients, two LayerNorms' dweight/dbias)
            # adds into one zeroed fp32 buffer: one memset for the block instead of six. The bias sums
            # come first, so that low-precision biases take their gradients in one cast (split_column_sums).
            # The table's gradient shares the memset when the table is fp32 (index_add_ adds into it).
            # norm1's backward spreads its sums over several rows where it has many programs (slots).
            n_table = table.numel() if table.dtype == torch.float32 else 0
            n_n1 = 2 * C * _norm_bwd_slots(x)
            sums = torch.zeros(11 * C + n_n1 + n_table, dtype=torch.float32, device=d.device)
            s_fc2, s_fc1, s_proj, s_qkv, s_n2, s_n1, s_table = sums.split(
                (C, 4 * C, C, 3 * C, 2 * C, n_n1, n_table))
            # MLP: fc2 (its bias gradient and dy = d in the compute dtype in one pass), GELU + fc1 bias (one
            # fused reduction), fc1
            dy, _ = bias_grad_host(d, None, torch.float32, sums_into=s_fc2, out_dtype=dt)
            d_act = dy @ w_fc2
            d_fc2_w = (dy.t() @ act).to(t_fc2_w)
            d_pre, _ = bias_grad_host(d_act, pre, torch.float32, sums_into=s_fc1)
            d_h = d_pre @ w_fc1
            d_fc1_w = (d_pre.t() @ h).to(t_fc1_w)
            # add + norm2: the residual gradient d joins the LayerNorm's dx in the same kernel
            d_s, sums2 = layer_norm_bwd(d_h, s, n2w, n2b, mean2, rstd2, d, s.dtype, sums_into=s_n2)
            d_n2w, d_n2b = split_norm_grads(sums2, n2w, n2b)
            # merge_roll's backward is roll_partition; then proj
            d_proj = roll_partition_fwd(d_s.view(B, H, W, C), ws, shift, out_dtype=dt).view(-1, C)
            d_o = d_proj @ w_proj
            d_proj_w = (d_proj.t() @ o).to(t_proj_w)
            bias_grad_host(d_proj, None, torch.float32, sums_into=s_proj)
            # attention, written straight into the packed qkv gradient
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            dqkv = torch.empty_like(qkv)
            d_attn = d_o.view(bnw, n, heads, C // heads).transpose(1, 2)
            _, _, _, d_rel = window_attention_bwd(q, k, v, attn, lse, d_attn, rel, mask, scale, True, dqkv=dqkv)
            # the table gather's backward: a memset and one index_add_ (_swin.scatter_rel_pos_grad)
            d_table = scatter_rel_pos_grad(d_rel, index, table.shape, table.dtype,
                                           into=s_table.view(table.shape) if n_table else None)
            dqkv2 = dqkv.view(-1, 3 * C)
            d_win = dqkv2 @ w_qkv
            d_qkv_w = (dqkv2.t() @ win2).to(t_qkv_w)
            bias_grad_host(dqkv2, None, torch.float32, sums_into=s_qkv)
            d_fc2_b, d_fc1_b, d_proj_b, d_qkv_b = split_column_sums(
                sums[:9 * C], (C, 4 * C, C, 3 * C), (t_fc2_b, t_fc1_b, t_proj_b, t_qkv_b))
            # norm1 + shift + partition
            # (the residual path's gradient d_s joins dx inside the same kernel)
            dx, sums1 = norm_shift_partition_bwd(d_win.view(bnw, n, C), x, n1w, mean1, rstd1, ws, shift,
                                                 sums_into=s_n1, ds=d_s.view(B, H, W, C))
            d_n1w, d_n1b = split_norm_grads(sums1, n1w, n1b)
        return (dx, None, None, None, d_n1w, d_n1b, d_qkv_w, d_qkv_b, d_table, d_proj_w, d_proj_b,
                d_n2w, d_n2b, d_fc1_w, d_fc1_b, d_fc2_w, d_fc2_b)


def swin_block_forward_fused_block(self, x: torch.Tensor) -> torch.Tensor:
    """timm SwinTransformerBlock.forward as one SwinBlockFunction. x: (B, H, W, C)."""
    from ..kernels.linear import compute_dtype

    if torch.compiler.is_compiling() or not _dropouts_inactive(self):
        return self._swinbench_forward_before_fused_block(x)
    ws, shift = square(self.window_size), square(self.shift_size)
    if ws is None or shift is None:  # made non-square after the pass (set_input_size)
        return self._swinbench_forward_before_fused_block(x)
    B, H, W, C = x.shape
    if getattr(self, "dynamic_mask", False):
        Hp, Wp = -(-H // ws) * ws, -(-W // ws) * ws
        mask = self.get_attn_mask(x.new_empty((1, Hp, Wp, 1)))
    else:
        mask = self.attn_mask
    attn, mlp = self.attn, self.mlp
    geom = (ws, shift, attn.num_heads, float(attn.scale), float(self.norm1.eps), float(self.norm2.eps),
            compute_dtype(x, attn.qkv.weight))
    return SwinBlockFunction.apply(
        x, mask.detach() if mask is not None else None, attn.relative_position_index, geom,
        self.norm1.weight, self.norm1.bias, attn.qkv.weight, attn.qkv.bias, attn.relative_position_bias_table,
        attn.proj.weight, attn.proj.bias, self.norm2.weight, self.norm2.bias,
        mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias)


def apply(model: torch.nn.Module, ctx: PassContext) -> tuple[torch.nn.Module, PassResult]:
    """Patch every plain timm SwinTransformerBlock in `model` in place -> (model, PassResult)."""
    blocks = swin_blocks(model, ctx, "workbench.kernels.window_attention", "fused block kernels")
    patched, skipped = 0, {}
    for blk in blocks:
        if getattr(blk, "_swinbench_fused_block", False):
            continue
        reason = _why_not(blk)
        if reason is not None:
            skipped[reason] = skipped.get(reason, 0) + 1
            continue
        blk._swinbench_forward_before_fused_block = blk.forward
        blk.forward = types.MethodType(swin_block_forward_fused_block, blk)
        blk._swinbench_fused_block = True
        patched += 1
    if patched == 0 and not any(getattr(b, "_swinbench_fused_block", False) for b in blocks):
        raise PassUnavailable("no SwinTransformerBlock has the plain configuration the fused block implements: "
                              + "; ".join(f"{n} {r}" for r, n in skipped.items()))
    changed = (f"{patched}/{len(blocks)} SwinTransformerBlock -> one autograd Function each (fused kernels, "
               "cuBLAS GEMMs, backward by hand)")
    if skipped:
        changed += "; left as they were: " + "; ".join(f"{n} ({r})" for r, n in skipped.items())
    details = {"blocks_patched": patched, "blocks_total": len(blocks), "blocks_skipped": skipped,
               "implementation": "workbench.passes.fused_block.SwinBlockFunction"}
    return model, PassResult(NAME, {}, changed, details)
