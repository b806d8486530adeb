"""Run under torchrun by tests/test_fsdp.py: each rank trains the tiny Swin for STEPS SGD steps (gradient
clipping on) under FSDP through `optimize_swin`, each step on its shard of a fixed global batch, and saves
its losses, the state_dict() after, how much of the weights it holds, and the notes; then loads a plain
model's weights into the sharded one (load_state_dict) and saves predict's logits on a batch, in
OUT/<i>-rank<r>.pt for the i-th config (RESHARD: reshard or keep; with :accN each step accumulates N
micro-batches, the shard cut in N). The config `scaling` measures the
baseline stage as `apply --nproc --parallel fsdp` does (ladder.scaling) and saves its result.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/fsdp_worker.py OUT RECIPE:UNIT:RESHARD[:accN]...
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from workbench.api import FullyShard, optimize_swin
from workbench.models import TINY_MODEL, build_model
from workbench.optimize.distributed import init_process_group_from_env

PER_RANK = 3
STEPS = 3
LR = 0.5
CLIP = 1.0


def global_batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = PER_RANK * world
    return [(torch.randn(n, 3, 56, 56, generator=g), torch.randint(0, 10, (n,), generator=g)) for _ in range(STEPS)]


def predict_batch() -> torch.Tensor:
    return torch.randn(4, 3, 56, 56, generator=torch.Generator().manual_seed(2))


def train(recipe: str, batches, distributed, accumulate: int = 1):
    """-> (OptimizedSwin, losses: the mean of each step's micro-batch losses) after len(batches) SGD steps
    from the seed-0 tiny Swin, each batch cut in `accumulate` equal micro-batches."""
    torch.manual_seed(0)
    model = build_model(TINY_MODEL, drop_path_rate=0.0)
    swin = optimize_swin(model, recipe, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": LR}, grad_clip=CLIP,
                         accumulate=accumulate, distributed=distributed)
    losses = []
    for x, y in batches:
        micro = [swin.train_step(xm, ym).item() for xm, ym in zip(x.chunk(accumulate), y.chunk(accumulate))]
        losses.append(sum(micro) / accumulate)
    return swin, losses


def measure_scaling(rank: int, world: int) -> dict:
    """The baseline stage of the tiny Swin, batch 4 per process, as `apply --nproc --parallel fsdp` measures it."""
    from types import SimpleNamespace

    from workbench.ladder.scaling import _measure

    spec = SimpleNamespace(config={"model": TINY_MODEL, "mode": "train", "batch": 4, "precision": "fp32",
                                   "device": "cpu", "seed": 0, "num_classes": None},
                           stage_ref="baseline", warmup=1, steps=2)
    return _measure(spec, None, torch.device("cpu"), rank, world, "fsdp")[0]


def main(out: Path, configs: list[str]) -> None:
    init_process_group_from_env("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    batches = [(x[shard], y[shard]) for x, y in global_batches(world)]
    for i, config in enumerate(configs):
        if config == "scaling":
            torch.save(measure_scaling(rank, world), out / f"{i}-rank{rank}.pt")
            continue
        recipe, unit, reshard, *acc = config.split(":")
        swin, losses = train(recipe, batches, FullyShard(unit=unit, reshard_after_forward=reshard == "reshard"),
                             int(acc[0][3:]) if acc else 1)
        held = sum(p.to_local().numel() for p in swin.model.parameters())
        state = swin.state_dict()
        torch.manual_seed(5)
        plain = build_model(TINY_MODEL, drop_path_rate=0.0)
        swin.load_state_dict(plain.state_dict())
        logits = swin.predict(predict_batch())
        torch.save({"losses": losses, "state": state, "held": held, "notes": swin.notes, "world": world,
                    "logits": logits, "describe": swin.describe()}, out / f"{i}-rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
