"""optimize_swin's `ema`: an exponential moving average of the fp32 weights (the masters under master
weights), moved after every optimizer step, read by ema_state_dict() and predict(ema=True). On the CPU
with the tiny Swin (the CUDA-graph form is in test_api_gpu.py)."""
import io
import re
import sys
from pathlib import Path

import pytest
import torch

from workbench.api import optimize_swin
from workbench.errors import UserError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_api import batches, master_recipe, tiny, weights  # noqa: E402,F401


def floating(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items() if v.is_floating_point()}


def follow(swin, data, decay: float) -> dict:
    """Step through data, keeping the average by hand from each step's state_dict (the fp32 weights)."""
    ref = floating(swin.state_dict())
    for x, y in data:
        swin.train_step(x, y)
        if swin.updated:
            now = swin.state_dict()
            ref = {k: decay * ref[k] + (1 - decay) * now[k].float() for k in ref}
    return ref


def assert_close(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert set(b) <= set(a)
    for k in b:
        assert a[k].dtype == torch.float32 and torch.allclose(a[k], b[k], rtol=0, atol=atol), k


@pytest.mark.parametrize("recipe", ["baseline", "master"])
def test_the_average_follows_the_fp32_weights_step_by_step(recipe, master_recipe):
    swin = optimize_swin(tiny(), master_recipe if recipe == "master" else "baseline", optimizer={"lr": 1e-2},
                         ema=0.75)
    assert (swin.ctx.master_weights is not None) == (recipe == "master")
    ref = follow(swin, batches(4), 0.75)
    averaged = swin.ema_state_dict()
    assert averaged.keys() == swin.state_dict().keys()
    assert_close(averaged, ref)
    assert "EMA of the weights (decay 0.75)" in swin.describe()


def test_accumulation_moves_the_average_once_per_optimizer_step():
    swin = optimize_swin(tiny(), "baseline", optimizer={"lr": 1e-2}, accumulate=2, ema=0.5)
    start = floating(swin.state_dict())
    x, y = batches(1)[0]
    swin.train_step(x, y)
    assert not swin.updated
    assert_close(swin.ema_state_dict(), start, atol=0)
    ref = follow(swin, batches(3, seed=2), 0.5)      # its first call ends the first optimizer step
    assert swin.optimizer_steps == 2
    # the hand-kept average started after the first micro-step: the same weights as the start
    assert_close(swin.ema_state_dict(), ref)


def trained_with_average(recipe: str, master_recipe: str):
    """An OptimizedSwin with ema=0.5 after three steps (master: the recipe with master weights)."""
    swin = optimize_swin(tiny(), master_recipe if recipe == "master" else "baseline", optimizer={"lr": 1e-2},
                         ema=0.5)
    for x, y in batches(3):
        swin.train_step(x, y)
    return swin


@pytest.mark.parametrize("recipe", ["baseline", "master"])
def test_predict_with_the_average_is_timm_with_the_averaged_weights(recipe, master_recipe):
    swin = trained_with_average(recipe, master_recipe)
    trained = weights(swin.model)
    x = batches(1, seed=9)[0][0]
    before = swin.predict(x)
    averaged = swin.predict(x, ema=True)
    assert torch.equal(swin.predict(x), before)            # the trained weights are back, bit for bit
    assert all(torch.equal(v, trained[k]) for k, v in weights(swin.model).items())
    plain = tiny(seed=4)
    plain.load_state_dict(swin.ema_state_dict())
    plain.eval()
    with torch.no_grad(), swin.ctx.precision.autocast("cpu"):
        expected = plain(x).float()
    tol = 1e-5 if recipe == "baseline" else 2e-2              # bf16 GEMMs: the same rounding of the same weights
    assert torch.allclose(averaged, expected, rtol=tol, atol=tol)
    assert not torch.allclose(averaged, before, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("recipe", ["baseline", "master"])
def test_averaged_weights_holds_the_averages_for_a_whole_evaluation(recipe, master_recipe):
    swin = trained_with_average(recipe, master_recipe)
    trained = weights(swin.model)
    state = floating(swin.state_dict())
    images = [x for x, _ in batches(2, seed=9)]
    one_by_one = [swin.predict(x, ema=True) for x in images]
    with swin.averaged_weights() as same:
        assert same is swin
        assert not all(torch.equal(v, trained[k]) for k, v in weights(swin.model).items())
        held = [swin.predict(x) for x in images]
        assert torch.equal(swin.predict(images[0], ema=True), held[0])     # already in place: not swapped twice
        for call, what in ((lambda: swin.train_step(*batches(1)[0]), "train_step"),
                           (swin.state_dict, "state_dict()"),
                           (lambda: swin.load_state_dict(state), "load_state_dict"),
                           (lambda: swin.load_ema_state_dict(state), "load_ema_state_dict")):
            with pytest.raises(UserError, match=re.escape(f"{what} inside averaged_weights")):
                call()
        with pytest.raises(UserError, match="already inside"):
            with swin.averaged_weights():
                pass
        assert swin.ema_state_dict().keys() == state.keys()
    assert all(torch.equal(a, b) for a, b in zip(held, one_by_one))
    assert all(torch.equal(v, trained[k]) for k, v in weights(swin.model).items())   # back, bit for bit
    assert_close(floating(swin.state_dict()), state, atol=0)
    swin.train_step(*batches(1)[0])                                    # and training goes on after it


def test_averaged_weights_puts_the_trained_weights_back_when_the_block_raises():
    swin = optimize_swin(tiny(), "baseline", optimizer={"lr": 1e-2}, ema=0.5)
    for x, y in batches(2):
        swin.train_step(x, y)
    trained = weights(swin.model)
    with pytest.raises(KeyError):
        with swin.averaged_weights():
            raise KeyError("the user's evaluation failed")
    assert all(torch.equal(v, trained[k]) for k, v in weights(swin.model).items())
    with pytest.raises(UserError, match="keeps no EMA"):
        with optimize_swin(tiny(), "baseline").averaged_weights():
            pass


def test_the_average_saves_and_loads_to_resume(master_recipe):
    data = batches(4)
    swin = optimize_swin(tiny(), master_recipe, optimizer={"lr": 1e-2}, ema=0.5)
    for x, y in data[:2]:
        swin.train_step(x, y)
    buffer = io.BytesIO()      # a state_dict shares the live weights' memory: save it, as a checkpoint does
    torch.save({"model": swin.state_dict(), "optimizer": swin.optimizer_state_dict(), "ema": swin.ema_state_dict()},
               buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()))
    for x, y in data[2:]:
        swin.train_step(x, y)
    resumed = optimize_swin(tiny(seed=3), master_recipe, optimizer={"lr": 1e-2}, ema=0.5)
    resumed.load_state_dict(saved["model"])
    resumed.load_optimizer_state_dict(saved["optimizer"])
    resumed.load_ema_state_dict(saved["ema"])
    for x, y in data[2:]:
        resumed.train_step(x, y)
    assert_close(resumed.ema_state_dict(), floating(swin.ema_state_dict()), atol=0)


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.1, True, "0.99", float("nan")])
def test_a_decay_outside_zero_to_one_is_one_line(value):
    with pytest.raises(UserError, match="ema must be a decay between 0 and 1"):
        optimize_swin(tiny(), "baseline", ema=value)


def test_reading_an_average_that_was_not_kept_and_fsdp_are_one_line():
    swin = optimize_swin(tiny(), "baseline")
    for call in (swin.ema_state_dict, lambda: swin.predict(batches(1)[0][0], ema=True),
                 lambda: swin.load_ema_state_dict({})):
        with pytest.raises(UserError, match="keeps no EMA of its weights"):
            call()
    with pytest.raises(UserError, match="ema: an average of FSDP's sharded weights"):
        optimize_swin(tiny(), "baseline", distributed="fsdp", ema=0.99)
    kept = optimize_swin(tiny(), "baseline", ema=0.9)
    with pytest.raises(UserError, match="lacks 1 parameter"):
        kept.load_ema_state_dict({k: v for k, v in kept.ema_state_dict().items() if k != "head.fc.weight"})
    for bad in (None, [1.0, 2.0], kept.ema_state_dict()["head.fc.weight"].numpy()):
        with pytest.raises(UserError, match="load_ema_state_dict: head.fc.weight is .*, not a tensor") as info:
            kept.load_ema_state_dict({**kept.ema_state_dict(), "head.fc.weight": bad})
        assert "\n" not in str(info.value)


def test_a_tied_parameter_has_one_average_under_both_names_and_loading_weights_reseeds_it():
    model = tiny()
    model.layers[0].blocks[1].norm1.weight = model.layers[0].blocks[0].norm1.weight
    swin = optimize_swin(model, "baseline", optimizer={"lr": 1e-1}, ema=0.5)
    for x, y in batches(3):
        swin.train_step(x, y)
    averaged = swin.ema_state_dict()
    assert torch.equal(averaged["layers.0.blocks.1.norm1.weight"], averaged["layers.0.blocks.0.norm1.weight"])
    assert not torch.equal(averaged["layers.0.blocks.0.norm1.weight"],
                           swin.state_dict()["layers.0.blocks.0.norm1.weight"])
    pretrained = weights(tiny(seed=9))
    swin.load_state_dict(pretrained)        # e.g. pretrained weights loaded after optimize_swin
    assert_close(swin.ema_state_dict(), floating(pretrained), atol=0)


def test_frozen_gemm_weights_stay_as_they_are_under_master_weights(master_recipe):
    """A frozen patch embedding (requires_grad False) is not put among the masters: AdamW's weight decay
    must not shrink it (nor the average follow it)."""
    model = tiny()
    model.patch_embed.proj.weight.requires_grad_(False)
    frozen = model.patch_embed.proj.weight.detach().clone()
    swin = optimize_swin(model, master_recipe, optimizer={"lr": 1e-2}, ema=0.5)
    assert swin.ctx.master_weights is not None
    assert all(p is not model.patch_embed.proj.weight for p in swin.ctx.master_weights.params)
    for x, y in batches(3):
        swin.train_step(x, y)
    assert torch.equal(swin.state_dict()["patch_embed.proj.weight"], frozen)
    assert torch.equal(swin.ema_state_dict()["patch_embed.proj.weight"], frozen)
