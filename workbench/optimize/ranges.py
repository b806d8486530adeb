"""NVTX ranges in domain `swinbench`, and the same names as torch.profiler ranges for the torch backend.

Ranges: `step{i}` > `forward` / `backward` / `optimizer`; inside forward, per-module ranges pushed by
hooks: `patch_embed`, `stage{s}.block{b}` (and inside a block `norm1`, `attention`, `norm2`, `mlp`;
what a block spends outside those is its window shift/partition/merge and residual adds),
`stage{s}.downsample`, `head`.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

DOMAIN = "swinbench"


class RangeMarker:
    """Pushes and pops named ranges to NVTX (for nsys) and/or torch.profiler (for the torch backend).

    `kind`: 'nvtx' (the `nvtx` package, domain swinbench; falls back to torch.cuda.nvtx, which has
    no domain, and says so in `note`), 'torch' (torch.profiler record_function) or 'none'.
    """

    def __init__(self, kind: str = "none"):
        self.kind = kind
        self.note: str | None = None
        self._stack: list = []
        self._nvtx = None
        self._cache: dict = {}
        if kind == "nvtx":
            try:
                import nvtx  # type: ignore

                self._domain = nvtx.get_domain(DOMAIN)
                self._nvtx = nvtx
            except Exception:
                self.note = "the `nvtx` package is missing: ranges use torch.cuda.nvtx (default domain)"

    def _attributes(self, name: str):
        # Event attributes are cached per name: the hooks push the same few hundred names every step.
        attrs = self._cache.get(name)
        if attrs is None:
            attrs = self._cache[name] = self._domain.get_event_attributes(message=name)
        return attrs

    def push(self, name: str) -> None:
        if self.kind == "nvtx":
            if self._nvtx is not None:
                self._domain.push_range(self._attributes(name))
            else:
                torch.cuda.nvtx.range_push(name)
        elif self.kind == "torch":
            rf = torch.autograd.profiler.record_function(name)
            rf.__enter__()
            self._stack.append(rf)

    def pop(self) -> None:
        if self.kind == "nvtx":
            if self._nvtx is not None:
                self._domain.pop_range()
            else:
                torch.cuda.nvtx.range_pop()
        elif self.kind == "torch":
            self._stack.pop().__exit__(None, None, None)

    @contextmanager
    def range(self, name: str):
        self.push(name)
        try:
            yield
        finally:
            self.pop()


def _hook_pair(marker: RangeMarker, label: str):
    # no-ops while torch.compile traces: Dynamo cannot trace a range push or pop, so it would split the
    # compiled step at every one, and the capture would time another program than apply does
    def pre(module, args):
        if not torch.compiler.is_compiling():
            marker.push(label)

    def post(module, args, output):
        if not torch.compiler.is_compiling():
            marker.pop()

    return pre, post


def annotate_modules(model: torch.nn.Module, marker: RangeMarker) -> list:
    """Register forward hooks that push a range around each stage's blocks and their parts (not inside a
    compiled forward: Inductor runs it as its own kernels, without the modules' ranges).
    Returns the hook handles (call .remove() on each to undo)."""
    if marker.kind == "none":
        return []
    handles = []

    def add(module, label):
        pre, post = _hook_pair(marker, label)
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))

    if hasattr(model, "patch_embed"):
        add(model.patch_embed, "patch_embed")
    from workbench.optimize.passes._swin import swin_stages

    for s, stage in enumerate(swin_stages(model)[1]):
        if getattr(stage, "downsample", None) is not None and not isinstance(stage.downsample, torch.nn.Identity):
            add(stage.downsample, f"stage{s}.downsample")
        for b, blk in enumerate(getattr(stage, "blocks", [])):
            add(blk, f"stage{s}.block{b}")
            for attr, label in (("norm1", "norm1"), ("attn", "attention"), ("norm2", "norm2"), ("mlp", "mlp")):
                sub = getattr(blk, attr, None)
                if isinstance(sub, torch.nn.Module):
                    add(sub, label)
    if hasattr(model, "head"):
        add(model.head, "head")
    return handles
