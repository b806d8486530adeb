"""Model checkpoints that travel between `swinbench train` and `swinbench apply --checkpoint`.

A swinbench checkpoint is one `torch.save` file: a plain timm state_dict (what `OptimizedSwin.state_dict()`
returns: it loads into `timm.create_model(model, num_classes=...)` as is; the CPU's tiny Swin,
`swinbench_tiny_cpu`, into `workbench.models.build_model`) and what was trained:

    {"format": FORMAT, "model": timm name, "num_classes": int, "input_size": [C, H, W],
     "data": the data's path (an ImageFolder) or None (the shipped digits), "recipe": str, "seed": int,
     "steps": int, "val_acc": float | None, "state_dict": {name: tensor}}

`load_checkpoint` also takes a plain state_dict file (a timm checkpoint of your own, or one saved with
`torch.save(model.state_dict(), path)`): the model name then comes from `--model` and the class count
from the head's weight. Anything else is one line of UserError.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.errors import UserError
from workbench.files import atomic_write_bytes

FORMAT = "swinbench-checkpoint/1"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: `model` and `data` are None where a plain state_dict does not say them."""

    path: Path
    state_dict: dict
    model: str | None
    num_classes: int
    data: str | None = None          # an ImageFolder path, or None: the shipped digits (swinbench checkpoints)
    meta: dict | None = None         # the rest of a swinbench checkpoint's header (recipe, seed, steps, val_acc)

    def describe(self) -> dict:
        return {"path": str(self.path), "model": self.model, "num_classes": self.num_classes,
                "format": FORMAT if self.meta is not None else "state_dict", "data": self.data, **(self.meta or {})}


def save_checkpoint(path: Path, state_dict: dict, *, model: str, num_classes: int, input_size, data: str | None,
                    recipe: str, seed: int, steps: int, val_acc: float | None) -> Path:
    """Write a swinbench checkpoint (tensors moved to the CPU) atomically -> its path."""
    import io

    payload = {"format": FORMAT, "model": model, "num_classes": int(num_classes), "input_size": list(input_size),
               "data": None if data is None else str(data), "recipe": recipe, "seed": int(seed), "steps": int(steps),
               "val_acc": val_acc, "state_dict": {k: v.detach().cpu() for k, v in state_dict.items()}}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return atomic_write_bytes(Path(path), buffer.getvalue())


def _head_classes(state: dict, path: Path) -> int:
    for key in ("head.fc.weight", "head.weight"):
        w = state.get(key)
        if isinstance(w, torch.Tensor) and w.dim() == 2:
            return int(w.shape[0])
    raise UserError(f"--checkpoint {path}: no head.fc.weight in it: not a timm Swin's state_dict")


def load_checkpoint(path: Path | str) -> Checkpoint:
    """Read a swinbench checkpoint or a plain state_dict file -> Checkpoint; UserError in one line for a
    missing, unreadable or foreign file. A file read before and unchanged since is not read again (a stage
    asks for it more than once; its tensors are only ever copied from)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--checkpoint {path}: no such file")
    st = path.stat()
    return _load(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _load(path: Path, size: int, mtime_ns: int) -> Checkpoint:
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:   # pickle, zip or torch errors: one line, the file is the user's
        text = str(exc).strip()
        if "weights_only" in text:      # torch's advice to unpickle anything is not one to pass on
            why = text.split("WeightsUnpickler error:", 1)[-1].strip().splitlines() if "WeightsUnpickler" in text else []
            first = (f"{why[0][:200]}; only tensors and plain containers are loaded" if why
                     else "only tensors and plain containers are loaded")
        else:
            first = text.splitlines()[0][:200] if text else type(exc).__name__
        raise UserError(f"--checkpoint {path}: cannot be read as a torch checkpoint, which torch.save writes (a "
                        f"file cut short or of another format?): {first}") from None
    if not isinstance(raw, dict):
        raise UserError(f"--checkpoint {path}: holds a {type(raw).__name__}, not a state_dict or swinbench checkpoint")
    if raw.get("format") == FORMAT:
        state = raw.get("state_dict")
        if not isinstance(state, dict) or not isinstance(raw.get("model"), str):
            raise UserError(f"--checkpoint {path}: a swinbench checkpoint without its state_dict or model name")
        meta = {k: raw.get(k) for k in ("recipe", "seed", "steps", "val_acc", "input_size")}
        return Checkpoint(path, state, raw["model"], int(raw.get("num_classes") or _head_classes(state, path)),
                          raw.get("data"), meta)
    if "state_dict" in raw and isinstance(raw["state_dict"], dict):     # {"state_dict": ...} as many trainers save
        raw = raw["state_dict"]
    if not raw or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in raw.items()):
        raise UserError(f"--checkpoint {path}: not a state_dict (names to tensors) nor a swinbench checkpoint")
    return Checkpoint(path, raw, None, _head_classes(raw, path))


def load_into(model: torch.nn.Module, checkpoint: Checkpoint) -> None:
    """Load the checkpoint's weights into a freshly built timm model (strict); UserError naming what differs."""
    try:
        model.load_state_dict(checkpoint.state_dict, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        detail = " ".join(line.strip() for line in first[1:3]) if len(first) > 1 else first[0]
        raise UserError(f"--checkpoint {checkpoint.path} does not fit the model: {detail[:300]}") from None
