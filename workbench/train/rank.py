"""One process of `swinbench train --nproc` under torchrun (see launch.py): `python -m workbench.train.rank SPEC`."""
from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path

from workbench.errors import UserError
from workbench.train.launch import ERROR_PREFIX


class _NoRecords:
    """The record file of a rank other than 0: writes nothing."""

    path = None

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


def rank_main(spec_path: Path) -> None:
    """One rank of `swinbench train --nproc`: train every run of the spec (see the module's docstring)."""
    import torch.distributed as dist
    from rich.console import Console

    from workbench.models import build_model, input_size
    from workbench.optimize.distributed import init_process_group_from_env
    from workbench.datasets import load_data
    from workbench.train.loop import RecordFile, TrainConfig, checkpoint_path, record_path, train_run
    from workbench.train.progress import TrainProgress

    spec = json.loads(Path(spec_path).read_text())
    names = {f.name for f in fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in spec["config"].items() if k in names})
    config.data = None if config.data is None else Path(config.data)
    out_dir = Path(spec["out_dir"])
    device = init_process_group_from_env(spec["device_type"])
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_data(config.data, input_size(build_model(spec["model"], img_size=config.img_size))[1:], config.workers)
    console = Console(file=sys.stdout, force_terminal=False, soft_wrap=True)
    runs = [(recipe, seed) for recipe, seed in spec["runs"]]
    with TrainProgress(console, rank == 0, len(runs)) as bar:
        for i, (recipe, seed) in enumerate(runs):
            records = RecordFile(record_path(out_dir, i, recipe, seed)) if rank == 0 else _NoRecords()
            try:
                train_run(config, recipe, seed, data, spec["model"], device, records, bar, i,
                          skip_unavailable=config.compare is not None, rank=rank, world=world,
                          checkpoint=checkpoint_path(out_dir, i, recipe, seed) if config.save_checkpoints else None)
            finally:
                records.close()
    # only on success: a rank that raised exits without waiting on its peers, and torchrun stops them
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    try:
        rank_main(Path(argv[0]))
    except UserError as exc:
        print(ERROR_PREFIX + str(exc).replace("\n", " "), file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
