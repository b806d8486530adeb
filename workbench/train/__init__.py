"""`swinbench train`: a Swin trained on real data with a recipe, through the public API (`workbench.api`).

    data.py      the data: the shipped handwritten digits, or an ImageFolder; fixed split, same order per seed
    parity.py    the parity rule: does a recipe's loss curve and accuracy stay with the baseline's?
    loop.py      one training run (records as JSON lines) and `run_train`, the command's function
    report.py    report.md and curves.png, rendered from the records alone
    progress.py  a rich bar on a terminal, plain lines in a log
"""
