"""--img-size: a Swin at a resolution its name does not say, where the feature maps are no multiple of the
window (timm pads inside the blocks, and so do the fused window kernels): the fused stage passes the gate
there, the records and the report say the resolution, a checkpoint brings its own, bad sizes are one line."""
import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from cli import app
from workbench.errors import UserError
from workbench.ladder.apply import run_apply
from workbench.models import TINY_MODEL, build_model, input_size, own_img_size, parse_img_size
from workbench.results.record import read_records

runner = CliRunner()


def test_sizes_parse_and_the_model_default_is_no_size():
    assert parse_img_size("384") == (384, 384) and parse_img_size("256x320") == (256, 320)
    assert parse_img_size(" 60 X 68 ") == (60, 68) and parse_img_size((60, 68)) == (60, 68)
    assert parse_img_size(None) is None
    assert own_img_size(TINY_MODEL, "56") is None and own_img_size(TINY_MODEL, "60x68") == (60, 68)
    assert own_img_size("swin_base_patch4_window12_384", "384x384") is None
    for bad in ("big", "0", "224x", "1x2x3", "8", "99999"):
        with pytest.raises(UserError, match="--img-size"):
            parse_img_size(bad)
    assert input_size(build_model(TINY_MODEL, img_size=(60, 68))) == (3, 60, 68)


def test_the_fused_stage_passes_its_gate_with_padding_inside_windows(tmp_path):
    run_apply("fmha", model=TINY_MODEL, batch=1, steps=1, warmup=0, device="cpu", progress=False, interleave=0,
              stages=["baseline", "fmha"], out_dir=tmp_path / "run", console=Console(file=io.StringIO()),
              img_size="60x68")
    records = {r.stage: r for r in read_records(tmp_path / "run" / "records")}
    assert records["fmha"].status == "ok" and records["fmha"].gate.status == "PASS", records["fmha"].gate.reason
    assert records["fmha"].img_size == (60, 68)
    assert "swinbench_tiny_cpu at 60x68 px" in (tmp_path / "run" / "report.md").read_text()


def test_train_and_apply_carry_the_resolution_through_a_checkpoint(tmp_path):
    result = runner.invoke(app, ["train", "--steps", "2", "--batch", "8", "--device", "cpu", "--img-size", "60x68",
                                 "--save-checkpoints", "--out", str(tmp_path / "train")])
    assert result.exit_code == 0, result.output
    header = json.loads(next((tmp_path / "train" / "records").glob("*.jsonl")).read_text().splitlines()[0])
    assert header["input_size"] == [3, 60, 68]
    checkpoint = next((tmp_path / "train" / "checkpoints").glob("*.pt"))
    run_apply("baseline", model=None, batch=8, steps=1, warmup=0, device="cpu", progress=False, interleave=0,
              mode="infer", stages=["baseline"], out_dir=tmp_path / "run", console=Console(file=io.StringIO()),
              checkpoint=checkpoint)
    (record,) = read_records(tmp_path / "run" / "records")
    assert record.img_size == (60, 68) and record.gate.metrics.heldout["images"] == 597


def test_a_bad_size_is_one_line(tmp_path):
    result = runner.invoke(app, ["apply", "--device", "cpu", "--img-size", "huge", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "--img-size takes a size in pixels" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("fused_attn", [False, True])
def test_build_model_leaves_timms_attention_setting_as_it_found_it(fused_attn):
    """timm reads its fused-attention switch when a block is built: build_model sets it for its own model,
    then puts timm's back, so a model the user builds with timm afterwards keeps timm's default path."""
    from timm.layers import config as timm_config
    from timm.models.swin_transformer import SwinTransformer

    before = timm_config._USE_FUSED_ATTN
    model = build_model(TINY_MODEL, fused_attn=fused_attn)
    assert model.layers[0].blocks[0].attn.fused_attn is fused_attn
    assert timm_config._USE_FUSED_ATTN == before
    theirs = SwinTransformer(img_size=56, window_size=7, embed_dim=32, depths=(1,), num_heads=(2,))
    assert theirs.layers[0].blocks[0].attn.fused_attn == timm_config.use_fused_attn(experimental=True)


def test_a_rectangular_image_fuses_its_square_blocks_and_computes_timms_function():
    """A 32x64 image at window 8: timm makes the windows of the smaller maps non-square; those blocks keep
    timm's forward, the others run the kernels, and the whole is timm's function."""
    import copy

    import torch
    from timm.models.swin_transformer import SwinTransformer

    from pass_helpers import assert_timms_function
    from workbench.api import patch_swin

    torch.manual_seed(0)
    model = SwinTransformer(img_size=(32, 64), patch_size=4, window_size=8, embed_dim=32, depths=(2, 2),
                            num_heads=(2, 4), num_classes=10, drop_path_rate=0.0)
    plain = copy.deepcopy(model)
    patch = patch_swin(model, "dense", dtype="fp32")
    details = next(r for r in patch.applied if r.name == "fused_window").details
    assert 0 < details["blocks_non_square"] < details["blocks_total"] and details["blocks_patched"] > 0
    x = torch.randn(2, 3, 32, 64, generator=torch.Generator().manual_seed(1))
    assert_timms_function(model, plain, x)
