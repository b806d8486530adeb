#!/usr/bin/env bash
# The inference ladder past bf16 on one GPU: for each model and batch, one `swinbench apply --mode infer`
# with bf16 eager (amp), the fused stage (dense; its graph column is the fused CUDA-graph form), FP8 and
# INT8 (eager, and compiled with the quantization fused into its producers), and the PyTorch-alone peers
# in the same run: torch-compile (graph-replayed: what reduce-overhead gives) and torchao's FP8 and INT8,
# compiled. Each cell keeps its records; --resume continues a cell cut short.
#
#   benchmarks/quant_ladder.sh                                        # Swin-T and Swin-B, batches 1, 8, 64
#   MODELS=swin_base_patch4_window7_224 BATCHES=64 benchmarks/quant_ladder.sh
#
# Output: reports/runs/quant/<model>-b<batch>/report.md. torchao must be installed (pip install torchao);
# without it, or on a GPU older than sm_89 for FP8, those stages say "not available" and the rest run.
set -euo pipefail
MODELS=${MODELS:-"swin_tiny_patch4_window7_224 swin_base_patch4_window7_224"}
BATCHES=${BATCHES:-"1 8 64"}
STAGES=${STAGES:-"baseline,amp,dense,fp8,int8,fp8-compile,int8-compile,torch-compile,torchao-fp8,torchao-int8"}
OUT=${OUT:-reports/runs/quant}
SWINBENCH=${SWINBENCH:-swinbench}
for model in $MODELS; do
  for batch in $BATCHES; do
    $SWINBENCH apply --mode infer --stages "$STAGES" --model "$model" --batch "$batch" \
      --out "$OUT/$model-b$batch" --resume
  done
done
echo "reports: $OUT/*/report.md"
