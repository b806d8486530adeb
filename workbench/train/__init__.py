"""`swinbench train`: a Swin trained on real data with a recipe, through the public API (`workbench.api`).

    loop.py      one training run (records as JSON lines) and `run_train`, the command's function
    report.py    report.md and curves.png, rendered from the records alone (parsed and held to the parity
                 rule by workbench.results.train_runs and .parity)
    progress.py  a rich bar on a terminal, plain lines in a log
    launch.py    --nproc: the same runs, data parallel, one process per GPU under torchrun
    rank.py      one of those processes

The data (the shipped handwritten digits, or an ImageFolder; a fixed split, the same order per seed) comes
from workbench.datasets.
"""
