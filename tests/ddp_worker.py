"""Run under torchrun by tests/test_distributed.py: each rank takes one SGD (lr 1) step of the tiny Swin on
its shard of a fixed global batch through `optimize_swin`, and saves its loss, its shard's size and the
weights before and after (so the test reads the averaged gradient as before - after).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/ddp_worker.py OUT RECIPE...
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from workbench.api import optimize_swin
from workbench.models import TINY_MODEL, build_model
from workbench.optimize.distributed import init_process_group_from_env

PER_RANK = 3


def global_batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(PER_RANK * world, 3, 56, 56, generator=g), torch.randint(0, 10, (PER_RANK * world,), generator=g)


def one_step(recipe: str, x: torch.Tensor, y: torch.Tensor, distributed) -> tuple[float, dict, dict, list]:
    """-> (loss, weights before, weights after, notes) of one SGD step on (x, y)."""
    torch.manual_seed(0)
    model = build_model(TINY_MODEL, drop_path_rate=0.0)
    swin = optimize_swin(model, recipe, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 1.0},
                         distributed=distributed)
    before = {k: v.clone() for k, v in swin.state_dict().items()}
    loss = swin.train_step(x, y).item()
    return loss, before, swin.state_dict(), swin.notes


def main(out: Path, recipes: list[str]) -> None:
    init_process_group_from_env("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = global_batch(world)
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for recipe in recipes:
        loss, before, after, notes = one_step(recipe, x[shard], y[shard], None)
        torch.save({"loss": loss, "shard": len(x[shard]), "before": before, "after": after, "notes": notes,
                    "world": world}, out / f"{recipe}-rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
