"""Building the Swin models swinbench works on: any timm Swin by name, or a tiny one for the CPU."""
from __future__ import annotations

import torch

from workbench.errors import UserError

DEFAULT_MODEL = "swin_tiny_patch4_window7_224"
# A Swin small enough for a CPU demo and for tests: two stages, a shifted 14x14 stage
# (four 7x7 windows) and an unshifted 7x7 stage, head width 16. It is timm's own
# SwinTransformer class, so every pass that patches timm's blocks applies to it unchanged.
TINY_MODEL = "swinbench_tiny_cpu"
TINY_KWARGS = dict(
    img_size=56, patch_size=4, window_size=7, embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=10,
)


def swin_model_names() -> list[str]:
    import timm

    return [TINY_MODEL] + timm.list_models("swin*")


def check_model_name(name: str) -> None:
    """UserError unless `name` is the tiny CPU Swin or a Swin that timm knows."""
    import timm

    if name == TINY_MODEL:
        return
    if not name.startswith("swin") or name not in timm.list_models(name):
        close = [m for m in timm.list_models("swin*") if name.split("_")[0] in m][:3]
        hint = f" (timm has e.g. {', '.join(close)})" if close else ""
        raise UserError(f"unknown model {name!r}: not a timm Swin model{hint}; `swinbench models` lists them")


def input_size(model: torch.nn.Module) -> tuple[int, int, int]:
    """(C, H, W) of the images the model expects (timm's PatchEmbed knows its image size)."""
    h, w = model.patch_embed.img_size
    return (model.patch_embed.proj.in_channels, int(h), int(w))


SWIN_BLOCK_CLASSES = ("SwinTransformerBlock", "SwinTransformerV2Block", "SwinTransformerV2CrBlock")


def swin_roots(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The Swins inside `model` whose forward takes images of their input_size: each outermost module
    (`model` itself first) whose `patch_embed` knows its image size and that holds timm Swin blocks (a
    classifier, or timm's features_only wrapper of one), in module order; not a ViT's embedding, nor a
    module inside another one found. [] when there is none (the Swin's blocks alone, say)."""
    roots: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        embed = getattr(module, "patch_embed", None)
        if (getattr(embed, "img_size", None) is not None and hasattr(embed, "proj")
                and any(type(m).__name__ in SWIN_BLOCK_CLASSES for m in module.modules())):
            roots.append(module)
            inside.update(id(m) for m in module.modules())
    return roots


def parse_img_size(text) -> tuple[int, int] | None:
    """--img-size: '384' (square) or '256x320' (H x W) -> (H, W); None stays None. UserError otherwise."""
    if text is None:
        return None
    if isinstance(text, (list, tuple)) and len(text) == 2:
        parts = [str(v) for v in text]
    else:
        parts = str(text).lower().replace(" ", "").split("x")
        parts = parts * 2 if len(parts) == 1 else parts
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise UserError(f"--img-size takes a size in pixels, 384 or HxW like 256x320, not {text!r}")
    h, w = (int(p) for p in parts)
    if not (MIN_IMG <= h <= MAX_IMG and MIN_IMG <= w <= MAX_IMG):
        raise UserError(f"--img-size {h}x{w}: each side must be from {MIN_IMG} to {MAX_IMG} pixels")
    return h, w


MIN_IMG, MAX_IMG = 16, 4096


def default_img_size(name: str) -> tuple[int, int] | None:
    """(H, W) a model is built at by its name (timm's pretrained config; the tiny Swin's 56); None unknown."""
    if name == TINY_MODEL:
        return TINY_KWARGS["img_size"], TINY_KWARGS["img_size"]
    import timm

    size = timm.models.get_pretrained_cfg_value(name, "input_size")
    return (int(size[1]), int(size[2])) if size else None


def own_img_size(name: str, img_size) -> tuple[int, int] | None:
    """`img_size` (parsed), or None where it is the model's own resolution anyway (so records and run
    names mention a resolution only where it differs)."""
    size = parse_img_size(img_size)
    return None if size is None or size == default_img_size(name) else size


def build_model(name: str, *, fused_attn: bool = False, num_classes: int | None = None,
                drop_path_rate: float | None = None, img_size: tuple[int, int] | None = None) -> torch.nn.Module:
    """A timm Swin on the CPU in fp32 (move it yourself). `fused_attn` turns on timm's SDPA path,
    which timm reads when each block is built, so it is set here, before `create_model`, and timm's own
    setting is put back after (models built later with timm keep their attention path). `img_size`
    (H, W): the model at another resolution than its name's (timm pads feature maps that are not a
    multiple of the window inside the blocks; the fused window kernels do the same)."""
    import timm
    from timm.layers import set_fused_attn

    extra = {}
    if num_classes is not None:
        extra["num_classes"] = num_classes
    if drop_path_rate is not None:
        extra["drop_path_rate"] = drop_path_rate
    if img_size is not None:
        extra["img_size"] = tuple(int(v) for v in img_size)
    from timm.layers import config as timm_config

    before = getattr(timm_config, "_USE_FUSED_ATTN", None)    # timm's own setting, restored after the build
    set_fused_attn(fused_attn, experimental=fused_attn)
    try:
        if name == TINY_MODEL:
            from timm.models.swin_transformer import SwinTransformer

            kwargs = dict(TINY_KWARGS)
            kwargs.update(extra)
            return SwinTransformer(**kwargs)
        check_model_name(name)
        return timm.create_model(name, pretrained=False, **extra)
    finally:
        if before is None:
            set_fused_attn(False)
        else:
            timm_config._USE_FUSED_ATTN = before


def default_model_for(device: str) -> str:
    """The model a bare command uses: Swin-T on a GPU, the tiny Swin on the CPU."""
    return DEFAULT_MODEL if torch.device(device).type == "cuda" else TINY_MODEL
