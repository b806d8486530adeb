"""swinbench: where a Swin Transformer's GPU time goes, and how to make it faster, stage by stage.

Layers, each importing only those below it (tests/test_layers.py keeps it so):
    train/     `swinbench train`: real data, recipes compared, the parity rule
    api        the public Python API (`from workbench.api import optimize_swin`)
    ladder/    the staged ladder, `swinbench apply`
    capture/   Nsight Systems / torch.profiler capture, `swinbench profile`, `swinbench env`
    optimize/  passes, recipes, workload, trainer, correctness gate, timing
    kernels/   Triton kernels, each with its autograd Function
    results/   the typed stage record, report, check, the README's table
    analysis/  pure frame analyses, `swinbench analyze`, `swinbench diff`
    trace/     trace files -> frames
and the shared base: errors, files, run_folder, env, labels, precision, models.
"""
from pathlib import Path

__version__ = "0.1.0"

SOURCE_ROOT = Path(__file__).resolve().parent.parent   # the folder that holds the workbench package
