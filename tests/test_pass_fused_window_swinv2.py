"""The fused_window pass on a tiny SwinV2: each block's roll + pad + partition and reverse + crop + roll run
as roll_partition / merge_roll, with the same logits and the same gradient for every parameter as the
unpatched timm model in fp32 (shifted and unshifted blocks, windows padded at the map's edge), alone and
with fused_attention on top; blocks the kernels cannot take keep timm's _attn with their reason."""
import copy
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from workbench.optimize.passes import apply_pass  # noqa: E402
from workbench.optimize.passes.fused_attention import v2_attention_forward  # noqa: E402
from workbench.optimize.passes.fused_window import v2_window_attn  # noqa: E402
from pass_helpers import assert_step_close, pass_ctx  # noqa: E402
from test_pass_fused_attention_swinv2 import DEVICE, batch, grad_tol, tiny_v2, v2_attentions  # noqa: E402



def _timm_pads_swinv2() -> bool:
    """Whether this timm builds a SwinV2 whose map is not a multiple of the window (older releases cannot)."""
    try:
        tiny_v2(40)
    except RuntimeError:
        return False
    return True


TIMM_PADS = _timm_pads_swinv2()
# 10x10 then 5x5 tokens, window 4: both stages pad their maps to whole windows (12x12, 8x8); a timm that
# cannot pad gets 16x16 then 8x8 tokens, shifted in both stages, no padding
IMG = 40 if TIMM_PADS else 64


def v2_blocks(model):
    from timm.models.swin_transformer_v2 import SwinTransformerV2Block

    return [m for m in model.modules() if isinstance(m, SwinTransformerV2Block)]


def bound(blk) -> bool:
    return getattr(vars(blk).get("_attn"), "__func__", None) is v2_window_attn


@pytest.mark.skipif(not TIMM_PADS, reason="this timm cannot build a SwinV2 that pads its windows")
def test_the_tiny_model_pads_and_shifts():
    blocks = v2_blocks(tiny_v2(IMG))
    assert [b.input_resolution for b in blocks] == [(10, 10), (10, 10), (5, 5), (5, 5)]
    assert [b.window_size for b in blocks] == [(4, 4)] * 4
    assert [b.shift_size for b in blocks] == [(0, 0), (2, 2), (0, 0), (2, 2)]


@pytest.mark.parametrize("with_attention", [False, True], ids=["fused_window", "fused_window+fused_attention"])
def test_fused_window_matches_timm_in_fp32(with_attention):
    plain = tiny_v2(IMG)
    patched, result = apply_pass("fused_window", copy.deepcopy(plain), pass_ctx(DEVICE))
    assert result.available and "applied" not in result.details
    assert result.details["swinv2_patched_blocks"] == 4 and result.details["swinv2_left_on_timm"] == {}
    assert result.details["swinv2_blocks_shifted"] == 2 and result.details["swinv2_blocks_padded"] == (4 if TIMM_PADS else 0)
    assert all(bound(b) for b in v2_blocks(patched))
    if with_attention:
        patched, att = apply_pass("fused_attention", patched, pass_ctx(DEVICE))
        assert att.details["swinv2_patched_modules"] == 4
        assert all(getattr(m.forward, "__func__", None) is v2_attention_forward for m in v2_attentions(patched))
        assert all(bound(b) for b in v2_blocks(patched))
    assert patched.state_dict().keys() == plain.state_dict().keys()
    # fused_attention adds the relative-position index's inverse, non-persistent (state_dict is unchanged)
    added = [n for n, _ in patched.named_buffers() if n not in dict(plain.named_buffers())]
    assert all(n.endswith(".attn.relative_position_inverse") for n in added)
    assert len(added) == (len(v2_attentions(patched)) if with_attention else 0)
    for seed in (1, 2):  # fresh inputs each step
        assert_step_close(plain, patched, *batch(IMG, seed), grad_tol=grad_tol if with_attention else 1e-5)


def test_the_result_says_what_runs_and_what_stays_timms():
    _, result = apply_pass("fused_window", tiny_v2(IMG), pass_ctx(DEVICE))
    assert result.changed == ("4/4 SwinV2 block: roll+pad+partition -> roll_partition, reverse+crop+roll -> "
                              "merge_roll (Triton, fwd+bwd); post-norm: norm1 and the residual add are "
                              "fused_layernorm's, the MLP fused_linear's")
    assert result.details["blocks_total"] == 4 and result.details["swinv2_blocks_dynamic_mask"] == 0
    assert result.params == {}


def test_a_dynamic_mask_matches_timm():
    plain = tiny_v2(IMG)
    for blk in v2_blocks(plain):
        blk.dynamic_mask = True
        blk.attn_mask = None
    patched, result = apply_pass("fused_window", copy.deepcopy(plain), pass_ctx(DEVICE))
    assert result.details["swinv2_blocks_dynamic_mask"] == 4
    assert_step_close(plain, patched, *batch(IMG, 3), grad_tol=1e-5)


def test_blocks_the_kernels_cannot_take_keep_timms_attn_with_their_reason():
    model = tiny_v2(IMG)
    blocks = v2_blocks(model)
    blocks[1].window_size, blocks[1].shift_size = (4, 5), (2, 2)   # timm builds square windows only here
    blocks[2].shift_size = (0, 2)
    blocks[3]._attn = types.MethodType(type(blocks[3])._attn, blocks[3])
    model, result = apply_pass("fused_window", model, pass_ctx(DEVICE))
    assert result.details["swinv2_patched_blocks"] == 1 and bound(blocks[0])
    assert result.details["swinv2_left_on_timm"] == {
        "non-square window_size/shift_size: the kernels take one window side and one shift": 2,
        "its _attn or forward was replaced elsewhere": 1}
    assert "; 2 left on timm's path (non-square window_size/shift_size: the kernels take one window side " \
           "and one shift)" in result.changed and "\n" not in result.changed
    assert not any(bound(b) for b in blocks[1:])


def test_a_block_made_non_square_later_runs_timms_attn_and_a_second_run_unbinds_it():
    plain = tiny_v2(IMG)
    patched, _ = apply_pass("fused_window", copy.deepcopy(plain), pass_ctx(DEVICE))
    blk = v2_blocks(patched)[1]
    for b in (blk, v2_blocks(plain)[1]):   # both keep the mask built for (2, 2)
        b.shift_size = (2, 0)
    assert_step_close(plain, patched, *batch(IMG, 4), grad_tol=1e-5)
    again, result = apply_pass("fused_window", patched, pass_ctx(DEVICE))
    assert result.details["swinv2_patched_blocks"] == 3 and not bound(blk)


def test_a_deep_copy_and_a_second_run_keep_the_bound_attn():
    model, _ = apply_pass("fused_window", tiny_v2(IMG), pass_ctx(DEVICE))
    copied = copy.deepcopy(model)
    assert all(b._attn.__self__ is b and bound(b) for b in v2_blocks(copied))
    _, result = apply_pass("fused_window", copied, pass_ctx(DEVICE))
    assert result.details["swinv2_patched_blocks"] == 4 and result.details["swinv2_left_on_timm"] == {}


# aot_eager on the CPU (the kernels are opaque custom ops there); on a GPU also Inductor, which traces into them.
@pytest.mark.parametrize("backend", ["aot_eager"] + (["inductor"] if DEVICE.type == "cuda" else []))
def test_compiled_fused_window_and_attention_match_timm_in_fp32(backend):
    torch._dynamo.reset()
    plain = tiny_v2(IMG)
    patched, _ = apply_pass("fused_window", copy.deepcopy(plain), pass_ctx(DEVICE))
    patched, _ = apply_pass("fused_attention", patched, pass_ctx(DEVICE))
    compiled = torch.compile(patched, backend=backend)
    for seed in (1, 2):
        assert_step_close(plain, compiled, *batch(IMG, seed), grad_tol=grad_tol)



@pytest.mark.parametrize("attention", ["timm", "fused_attention"])
def test_under_autocast_the_windows_come_in_the_qkv_linear_s_dtype(monkeypatch, attention):
    """Under CUDA autocast the residual stream is fp32 and the qkv Linear casts its input: roll_partition
    writes that dtype itself. A block's _attn on an fp32 stream under autocast gives, bit for bit, the
    output and input gradient of timm's _attn around the same attention module; an attention whose
    forward was replaced elsewhere gets the stream's dtype."""
    import importlib

    from timm.models.swin_transformer_v2 import SwinTransformerV2Block

    from workbench.optimize.passes.block_forward import v2_attention_takes_linear_input

    win = importlib.import_module("workbench.kernels.window")
    seen = []
    real = win.roll_partition
    monkeypatch.setattr(win, "roll_partition",
                        lambda x, ws, shift, out_dtype=None: seen.append(out_dtype) or real(x, ws, shift, out_dtype))
    patched, _ = apply_pass("fused_window", tiny_v2(IMG), pass_ctx(DEVICE))
    if attention == "fused_attention":
        patched, _ = apply_pass("fused_attention", patched, pass_ctx(DEVICE))
    half = torch.bfloat16
    for blk in v2_blocks(patched):
        assert v2_attention_takes_linear_input(blk.attn)
        H, W = blk.input_resolution
        g = torch.Generator().manual_seed(H * 7 + int(any(blk.shift_size)))
        x = torch.randn((2, H, W, blk.attn.qkv.in_features), generator=g).to(DEVICE).requires_grad_(True)
        seen.clear()
        with torch.autocast(DEVICE.type, dtype=half):
            out = blk._attn(x)
            ref = SwinTransformerV2Block._attn(blk, x)    # timm's roll + pad + partition, the Linear's cast
        assert seen == [half]
        dout = torch.randn(out.shape, generator=g).to(DEVICE, out.dtype)
        (dx,) = torch.autograd.grad(out, x, dout)
        (dx_ref,) = torch.autograd.grad(ref, x, dout)
        assert dx.dtype == torch.float32
        assert torch.equal(out, ref) and torch.equal(dx, dx_ref)
    blk = v2_blocks(patched)[0]
    blk.attn.forward = lambda *a, **k: None
    assert not v2_attention_takes_linear_input(blk.attn)


def test_with_fused_layernorm_the_merge_norm1_and_add_are_one_kernel(monkeypatch):
    """fused_layernorm's post-norm forward over fused_window's _attn: each block's merge of the attention
    windows, norm1 and the residual add run as merge_norm_add (the merged branch never written), with
    timm's logits and gradients (shifted and padded windows); under an active drop path in training the
    add is timm's."""
    import importlib

    win = importlib.import_module("workbench.kernels.window")
    calls = []
    real = win.merge_norm_add
    monkeypatch.setattr(win, "merge_norm_add", lambda *a, **k: calls.append(1) or real(*a, **k))
    plain = tiny_v2(IMG)
    patched, _ = apply_pass("fused_layernorm", copy.deepcopy(plain), pass_ctx(DEVICE), {"impl": "triton"})
    patched, _ = apply_pass("fused_window", patched, pass_ctx(DEVICE))
    patched, _ = apply_pass("fused_attention", patched, pass_ctx(DEVICE))
    for seed in (1, 2):
        assert_step_close(plain, patched, *batch(IMG, seed), grad_tol=grad_tol)
    assert len(calls) == 2 * 4
    from timm.layers import DropPath

    for blk in v2_blocks(patched):
        blk.drop_path1 = DropPath(0.2)
    calls.clear()
    patched.train()(batch(IMG, 3)[0])
    assert calls == []
    with torch.no_grad():
        patched.eval()(batch(IMG, 3)[0])
    assert len(calls) == 4
