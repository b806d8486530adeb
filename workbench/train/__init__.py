"""`swinbench train`: a Swin trained on real data with a recipe, through the public API (`workbench.api`).

    data.py      the data: the shipped handwritten digits, or an ImageFolder; fixed split, same order per seed
    loop.py      one training run (records as JSON lines) and `run_train`, the command's function
    report.py    report.md and curves.png, rendered from the records alone (parsed and held to the parity
                 rule by workbench.results.train_runs and .parity)
    progress.py  a rich bar on a terminal, plain lines in a log
"""
