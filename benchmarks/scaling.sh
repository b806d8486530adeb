#!/usr/bin/env bash
# Multi-GPU scaling on one machine: for each model and each process count N, the amp stage, the fused
# stage and the strongest PyTorch-alone peer under `swinbench apply --nproc N` (img/s, efficiency against
# N x the one-GPU figure, the gate on every rank), and the fused stage under `swinbench profile --nproc N`
# (every rank captured: exposed communication per step, slowest rank, skew).
#
#   NPROCS="1 2" benchmarks/scaling.sh                 # a 2-GPU machine (1: the same path at world size 1)
#   NPROCS="1 2 4 8" benchmarks/scaling.sh             # an 8-GPU machine
#   MODELS=swin_base_patch4_window7_224 NPROCS=1 benchmarks/scaling.sh   # a dry run on one GPU
#
# Output: reports/runs/scaling/<model>-n<N>/ (apply) and reports/runs/scaling/<model>-n<N>-profile/.
# A rerun continues where the last one stopped: apply --resume keeps the finished stages and their
# data-parallel figures, and a finished profile (its ranks.csv written) is skipped; move a folder away to
# measure it again. PYTHON (default python3) is the interpreter that counts the GPUs. A command that
# fails (a stage that errors, a capture that cannot run) does not stop the others: the script names each
# failed one at the end and exits 1.
set -uo pipefail
NPROCS=${NPROCS:-"1 2"}
MODELS=${MODELS:-"swin_base_patch4_window7_224 swin_large_patch4_window7_224"}
BATCH=${BATCH:-64}          # per GPU: the batch of the one-GPU table
FUSED=${FUSED:-fmha-compile-graph}   # the fused stack's fastest training form: one CUDA graph, DDP's all-reduce in it
PEER=${PEER:-torch-compile-graph}     # the strongest PyTorch-alone step, captured the same way
OUT=${OUT:-reports/runs/scaling}
SWINBENCH=${SWINBENCH:-swinbench}   # e.g. "python3 cli.py" where the installed script is another interpreter's
PYTHON=${PYTHON:-python3}           # the interpreter with swinbench's torch, to count the GPUs
have=$($PYTHON -c "import torch; print(torch.cuda.device_count())") || { echo "error: $PYTHON cannot count the GPUs"; exit 2; }
failed=()
for model in $MODELS; do
  for n in $NPROCS; do
    if [ "$n" -gt "$have" ]; then echo "skip N=$n: $have GPU(s) here"; continue; fi
    $SWINBENCH apply --stages "baseline,amp,$FUSED,$PEER" --model "$model" --batch "$BATCH" \
      --nproc "$n" --out "$OUT/$model-n$n" --resume || failed+=("apply $model N=$n (exit $?)")
    if [ -f "$OUT/$model-n$n-profile/ranks.csv" ]; then echo "kept $OUT/$model-n$n-profile: captured already"; continue; fi
    $SWINBENCH profile --nproc "$n" --recipe "$FUSED" --model "$model" --batch "$BATCH" --steps 4 --warmup 5 \
      --out "$OUT/$model-n$n-profile" --overwrite || failed+=("profile $model N=$n (exit $?)")
  done
done
echo "apply reports: $OUT/*-n*/report.md; ranks tables: $OUT/*-profile/ranks.csv"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${failed[@]}"
  exit 1
fi
