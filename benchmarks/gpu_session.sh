#!/usr/bin/env bash
# One device call's worth of GPU work: correctness on the GPU, kernel benchmarks, profile, apply.
# Usage (on the GPU machine, from the repo root): benchmarks/gpu_session.sh PART...   PART in
#   s9-tests | s9-fails | s9-eager | s9-graphs | s9-table-compile | s8-tests | s8-tests-v | s8-retest | s8-ab | s8-prof | s8-eager | tests | tests2 | next-tests | next-tests2 | next-tests3 | attn-table | table-ab | next-graphs | next-prof | zero-sums | interleave-eager | paired-compile2 | paired-eager2 | paired-compile | paired-eager | colsums | compile-static | compile-cpp | attn-tests | inplace | fastlaunch-ab | fastlaunch-host | fastlaunch-quick | compile-pair | maxnreg | prof-graphs-ab | fastlaunch | graphs-ab | master-ab | traced | compile-diag | compile-variants | compile-apply | prof-compile | wbench | linear | threads | sweep | sweepb | norms | dense-apply | scale | infer-quick | prof-api | prof-block | block | host | chain | graphs | dense | infer | prof-fmha | window | kernels | attn | diag | benches | graph | last | quick | profile | apply-apex | apply-fmha
# Results go to $OUT (or ./gpu-out), packed into one tarball so they come back in one file.
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out/r"
export PYTHONUNBUFFERED=1
source .gpu/setup-gpu.sh >/dev/null 2>&1 || echo "setup-gpu.sh failed: no nsys/nvtx"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for part in "$@"; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    tests)   timeout 300 python3 -m pytest -q -p no:cacheprovider --durations=8 tests/test_window_kernels.py tests/test_window_attention.py \
               tests/test_kernel_ops.py tests/test_pass_fused_linear.py tests/test_layer_norm.py tests/test_pass_fused_window.py tests/test_pass_fused_attention.py \
               tests/test_pass_fused_layernorm.py 2>&1 | tail -30 ;;
    tests2)  timeout 300 python3 -m pytest -q -p no:cacheprovider --durations=8 tests/test_column_sums.py tests/test_pass_fused_block.py \
               tests/test_pass_master_weights.py tests/test_compile_fused_passes.py 2>&1 | tail -30 ;;
    attn-tests) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_window_attention.py tests/test_pass_fused_attention.py \
               tests/test_compile_fused_passes.py 2>&1 | tail -12 ;;
    inplace) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_compile_fused_passes.py \
               -k in_place --tb=line 2>&1 | grep -vE "^\s*$|warn" | cut -c1-900 | tail -8 ;;
    fastlaunch-quick) timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cached_launcher.py 2>&1 | tail -3
             SWINBENCH_FAST_LAUNCH=1 timeout 60 python3 benchmarks/bench_host.py --parts launch 2>&1 | head -16 ;;
    paired-compile) timeout 420 python3 benchmarks/bench_host.py --parts paired --batch 64 --steps 10 \
               --stages torch-compile,fmha-compile,benchmarks/recipes/fmha-compile-static.yaml \
               --out "$out/r/bench_host_paired_compile.json" 2>&1 | grep -E "step|Error|error" | tail -8 ;;
    paired-eager) timeout 300 python3 benchmarks/bench_host.py --parts paired --batch 64 --steps 10 \
               --stages amp,fmha+plainlaunch,fmha+fastlaunch,block+plainlaunch,block+fastlaunch \
               --out "$out/r/bench_host_paired_eager.json" 2>&1 | grep -E "step|Error|error" | tail -8 ;;
    s9-tests) timeout 540 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_layer_norm.py tests/test_pass_fused_layernorm.py \
               tests/test_pass_fused_window.py tests/test_pass_fused_attention.py tests/test_pass_fused_block.py \
               tests/test_window_kernels.py tests/test_compile_fused_passes.py -k "not test_roll and not test_merge" 2>&1 | tail -12 ;;
    s9-fails) timeout 90 python3 -m pytest -q -p no:cacheprovider -rf --tb=long tests/test_pass_fused_window.py tests/test_pass_fused_attention.py \
               -k "cast_path or rel_pos_bias_matches" > "$out/r/s9_fails.log" 2>&1
             grep -nE "^E |Error|assert|passed|failed|^tests/.*:[0-9]+:" "$out/r/s9_fails.log" | head -40 ;;
    s9-eager) timeout 330 swinbench apply --recipe fmha --stages amp,fmha,benchmarks/recipes/fmha-table.yaml --profile \
               --model swin_base_patch4_window7_224 --batch 64 --steps 10 --warmup 3 --interleave 20 \
               --out "$out/r/apply_s9_eager" 2>&1 | tail -14 ;;
    s9-graphs) timeout 530 swinbench apply --recipe fmha --stages amp,fmha-graph,torch-compile-graphs,fmha-compile-graphs,block-graph \
               --model swin_base_patch4_window7_224 --batch 64 --out "$out/r/apply_s9_graphs" 2>&1 | tail -24 ;;
    s9-table-compile) timeout 440 swinbench apply --recipe fmha-compile \
               --stages torch-compile,fmha-compile,benchmarks/recipes/fmha-table-compile.yaml \
               --model swin_base_patch4_window7_224 --batch 64 --interleave 8 --out "$out/r/apply_s9_table_compile" 2>&1 | tail -20 ;;
    s8-tests) swinbench env 2>&1 | tail -14
             timeout 430 python3 -m pytest -q -p no:cacheprovider --durations=10 tests/test_window_kernels.py tests/test_layer_norm.py \
               tests/test_cached_launcher.py tests/test_column_sums.py tests/test_kernel_ops.py tests/test_window_attention.py \
               tests/test_pass_fused_window.py tests/test_pass_fused_layernorm.py tests/test_pass_fused_attention.py \
               tests/test_pass_fused_block.py tests/test_compile_fused_passes.py 2>&1 | tail -24 ;;
    s8-tests-v) for grp in "tests/test_window_kernels.py tests/test_layer_norm.py tests/test_cached_launcher.py tests/test_column_sums.py tests/test_kernel_ops.py tests/test_window_attention.py" \
                "tests/test_pass_fused_window.py tests/test_pass_fused_layernorm.py tests/test_pass_fused_attention.py tests/test_pass_fused_block.py" \
                "tests/test_compile_fused_passes.py"; do
               log="$out/r/tests_$(echo $grp | md5sum | cut -c1-6).log"
               timeout 170 python3 -m pytest -v -p no:cacheprovider --tb=short -rf --durations=5 $grp > "$log" 2>&1
               echo "rc=$? $grp"; grep -E "FAILED|Error|assert|passed|failed" "$log" | grep -v PASSED | head -40
             done ;;
    s8-retest) timeout 120 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_window_kernels.py tests/test_pass_fused_window.py \
               tests/test_pass_fused_attention.py -k "autocast or rel_pos" 2>&1 | tail -12 ;;
    s8-prof) timeout 480 swinbench apply --recipe fmha --stages amp,fmha,benchmarks/recipes/fmha-table.yaml --profile \
               --model swin_base_patch4_window7_224 --batch 64 --steps 10 --warmup 3 --interleave 12 \
               --out "$out/r/apply_s8_prof" 2>&1 | tail -14 ;;
    s8-eager) timeout 240 swinbench apply --recipe fmha --stages amp,fmha,benchmarks/recipes/fmha-table.yaml --model swin_base_patch4_window7_224 \
               --batch 64 --steps 10 --warmup 3 --interleave 20 --out "$out/r/apply_s8_eager" 2>&1 | tail -9 ;;
    s8-ab)   timeout 480 swinbench apply --recipe fmha \
               --stages amp,fmha,benchmarks/recipes/fmha-table.yaml,fmha-graph,benchmarks/recipes/fmha-table-graph.yaml \
               --model swin_base_patch4_window7_224 --batch 64 --interleave 12 --out "$out/r/apply_s8_ab" 2>&1 | tail -30 ;;
    next-tests) swinbench env 2>&1 | tail -30
             timeout 400 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_window_kernels.py tests/test_layer_norm.py \
               tests/test_cached_launcher.py tests/test_pass_fused_window.py tests/test_pass_fused_layernorm.py \
               tests/test_kernel_ops.py 2>&1 | tail -9 ;;
    next-tests2) timeout 540 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_pass_fused_attention.py \
               tests/test_compile_fused_passes.py 2>&1 | tail -9 ;;
    next-tests3) timeout 540 python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_window_attention.py 2>&1 | tail -9 ;;
    next-graphs) timeout 540 swinbench apply --recipe fmha --stages amp,fmha,fmha-graph,torch-compile-graphs,fmha-compile-graphs \
               --model swin_base_patch4_window7_224 --batch 64 --out "$out/r/apply_next_graphs" 2>&1 | tail -24 ;;
    next-prof) timeout 300 swinbench apply --recipe fmha --stages amp,fmha --profile --interleave 10 \
               --model swin_base_patch4_window7_224 --batch 64 --steps 10 --warmup 3 --out "$out/r/apply_next_prof" 2>&1 | tail -14 ;;
    attn-table) timeout 300 python3 benchmarks/bench_window_attention.py --check --methods eager,sdpa_efficient \
               --out "$out/r/bench_window_attention.json" 2>&1 | tail -12 ;;
    table-ab) timeout 540 swinbench apply --recipe fmha \
               --stages fmha-graph,benchmarks/recipes/fmha-table-graph.yaml,fmha,benchmarks/recipes/fmha-table.yaml \
               --model swin_base_patch4_window7_224 --batch 64 --interleave 10 --out "$out/r/apply_table_ab" 2>&1 | tail -14 ;;
    zero-sums) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_window_kernels.py tests/test_layer_norm.py \
               tests/test_cached_launcher.py tests/test_column_sums.py 2>&1 | tail -3
             timeout 70 python3 benchmarks/bench_window.py --check --out "$out/r/bench_window.json" 2>&1 | grep -E "norm_shift|check|copy" ;;
    interleave-eager) timeout 250 swinbench apply --recipe fmha --stages amp,fmha --model swin_base_patch4_window7_224 \
               --batch 64 --steps 10 --warmup 3 --interleave 10 --out "$out/r/apply_interleave" 2>&1 | tail -9 ;;
    paired-compile2) timeout 400 python3 benchmarks/bench_host.py --parts paired --batch 64 --steps 30 \
               --stages torch-compile,fmha-compile --out "$out/r/bench_host_paired_compile2.json" 2>&1 | grep -E "step|Error|error" | tail -4 ;;
    paired-eager2) timeout 200 python3 benchmarks/bench_host.py --parts paired --batch 64 --steps 20 \
               --stages amp,fmha+plainlaunch,fmha+fastlaunch --out "$out/r/bench_host_paired_eager2.json" 2>&1 | grep -E "step|Error|error" | tail -4 ;;
    compile-pair) timeout 320 swinbench apply --recipe fmha-compile --stages torch-compile,fmha-compile \
               --model swin_base_patch4_window7_224 --batch 64 --out "$out/r/apply_compile" 2>&1 | tail -16 ;;
    fastlaunch-ab) for fl in 0 1; do
               SWINBENCH_FAST_LAUNCH=$fl timeout 200 swinbench apply --recipe block --stages fmha,block \
                 --model swin_base_patch4_window7_224 --batch 64 --out "$out/r/apply_fastlaunch$fl" 2>&1 | grep -E "^│ [a-z]|Error" | head -6
             done ;;
    fastlaunch-host) timeout 200 python3 benchmarks/bench_host.py --parts fastlaunch --stages fmha,block --steps 20 \
               --out "$out/r/bench_host_fastlaunch.json" 2>&1 | grep -E "host enqueue|Error" ;;
    compile-static) timeout 540 swinbench apply --recipe fmha-compile \
               --stages torch-compile,fmha-compile,benchmarks/recipes/fmha-compile-static.yaml \
               --model swin_base_patch4_window7_224 --batch 64 --out "$out/r/apply_compile_static" 2>&1 | tail -18 ;;
    compile-cpp) timeout 540 swinbench apply --recipe fmha-compile \
               --stages benchmarks/recipes/torch-compile-cpp.yaml,benchmarks/recipes/fmha-compile-cpp.yaml \
               --model swin_base_patch4_window7_224 --batch 64 --out "$out/r/apply_compile_cpp" 2>&1 | tail -16 ;;
    colsums) timeout 90 python3 benchmarks/diag_column_sums.py 2>&1 | tail -12 ;;
    maxnreg) timeout 90 python3 benchmarks/diag_maxnreg.py 2>&1 | tail -16 ;;
    prof-graphs-ab) for op in 1 0; do
               SWINBENCH_TRITON_OP=$op timeout 270 swinbench apply --recipe fmha --stages fmha-compile-graphs --profile \
                 --model swin_base_patch4_window7_224 --batch 64 --steps 10 --warmup 3 --out "$out/r/apply_prof_graphs_op$op" 2>&1 | tail -6
               grep -A12 "kernel time by category" "$out/r/apply_prof_graphs_op$op/report.md" | head -14
             done ;;
    compile-diag) timeout 450 python3 benchmarks/bench_host.py --parts compile --batch 64 --steps 8 \
               --compile-stages torch-compile,fmha-compile --out "$out/r/bench_host_compile.json" 2>&1 | grep -v "^\s*$" | tail -90 ;;
    traced)  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_window_attention.py tests/test_kernel_ops.py 2>&1 | grep -E "Error|passed|failed" | tail -6
             timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_compile_fused_passes.py -k inductor 2>&1 | grep -E "Error|passed|failed" | tail -8
             timeout 300 python3 benchmarks/bench_host.py --parts compile --batch 64 --steps 8 \
               --compile-stages fmha-compile --out "$out/r/bench_host_compile_traced.json" 2>&1 | grep -v "^\s*$" | tail -40 ;;
    master-ab) timeout 540 swinbench apply --recipe block --stages amp,benchmarks/recipes/fmha-o1.yaml,fmha,block,block-graph \
               --model swin_base_patch4_window7_224 --batch 64 --out "$out/r/apply_master_ab" 2>&1 | tail -22 ;;
    fastlaunch) timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cached_launcher.py 2>&1 | tail -3
             SWINBENCH_FAST_LAUNCH=1 timeout 120 python3 benchmarks/bench_host.py --parts launch 2>&1 | head -16
             SWINBENCH_FAST_LAUNCH=1 timeout 400 swinbench apply --recipe block --stages amp,fmha,block,block-graph \
               --model swin_base_patch4_window7_224 --batch 64 --out "$out/r/apply_fastlaunch" 2>&1 | tail -22 ;;
    graphs-ab) SWINBENCH_TRITON_OP=0 timeout 280 swinbench apply --recipe fmha --stages fmha-compile-graphs \
               --model swin_base_patch4_window7_224 --batch 64 --steps 20 --warmup 5 --out "$out/r/apply_graphs_opaque" 2>&1 | tail -8 ;;
    compile-apply) timeout 540 swinbench apply --recipe fmha-compile --stages amp,torch-compile,fmha-compile \
               --model swin_base_patch4_window7_224 --batch 64 --out "$out/r/apply_compile" 2>&1 | tail -20 ;;
    prof-compile) timeout 540 swinbench apply --recipe fmha-compile --stages torch-compile,fmha-compile --profile \
               --model swin_base_patch4_window7_224 --batch 64 --steps 6 --warmup 3 --out "$out/r/apply_prof_compile" 2>&1 | tail -12
             grep -A8 "kernel time by category" "$out"/r/apply_prof_compile/report.md | head -12 ;;
    compile-variants) timeout 540 python3 benchmarks/bench_host.py --parts compile --batch 64 --steps 8 \
               --compile-stages torch-compile,fmha-compile,benchmarks/recipes/attn-compile.yaml \
               --out "$out/r/bench_host_compile_variants.json" 2>&1 | grep -E "host enqueue|Error" | tail -12 ;;
    wbench)  timeout 90 python3 benchmarks/bench_window.py --check --out "$out/r/bench_window.json" 2>&1 | tail -22 ;;
    host)    timeout 240 python3 benchmarks/bench_host.py --out "$out/r/bench_host.json" 2>&1 | tail -75 ;;
    kernels) python3 benchmarks/bench_window.py --check --out "$out/r/bench_window.json" 2>&1 | tail -25
             python3 benchmarks/bench_window_attention.py --check --out "$out/r/bench_window_attention.json" 2>&1 | tail -25
             python3 benchmarks/bench_layer_norm.py --check --out "$out/r/bench_layer_norm.json" 2>&1 | tail -25 ;;
    profile) swinbench profile --model swin_tiny_patch4_window7_224 --mode train --batch 32 --precision bf16 \
               --steps 4 --warmup 3 --out "$out/r/profile_swin_tiny_train_bf16" --top 12 2>&1 | tail -60 ;;
    attn)    python3 -m pytest -q tests/test_window_attention.py tests/test_pass_fused_attention.py 2>&1 | tail -8
             python3 benchmarks/bench_window_attention.py --check --out "$out/r/bench_window_attention.json" 2>&1 | tail -25 ;;
    diag)    SWINBENCH_AUTOTUNE=0 timeout 60 python3 benchmarks/diag_window_attention.py 2>&1 | tail -20 ;;
    benches) timeout 50 python3 benchmarks/bench_window.py --check --out "$out/r/bench_window.json" 2>&1 | tail -22
             timeout 80 python3 benchmarks/bench_window_attention.py --check --methods eager,sdpa_efficient,fused \
               --out "$out/r/bench_window_attention.json" 2>&1 | tail -14
             timeout 45 python3 benchmarks/bench_layer_norm.py --check --out "$out/r/bench_layer_norm.json" 2>&1 | tail -22 ;;
    graph)   timeout 150 swinbench apply --recipe fmha --stages amp,fmha,fmha-graph --model swin_base_patch4_window7_224 \
               --batch 64 --steps 10 --warmup 3 --out "$out/r/apply_graph" 2>&1 | tail -14 ;;
    last)    timeout 70 python3 benchmarks/bench_window_attention.py --methods eager,sdpa_efficient,fused \
               --out "$out/r/bench_window_attention_graph.json" 2>&1 | tail -9
             timeout 100 swinbench apply --recipe fmha --stages amp,fmha-graph --model swin_base_patch4_window7_224 \
               --batch 64 --steps 8 --warmup 2 --out "$out/r/apply_graph" 2>&1 | tail -12
             cp "$out"/r/apply_graph/records/*.json "$out/r/" 2>/dev/null; tail -n 3 "$out"/r/apply_graph/logs/*.log ;;
    quick)   swinbench apply --recipe fmha --stages amp,fmha,fmha-graph,fmha-compile --model swin_base_patch4_window7_224 \
               --batch 64 --steps 10 --warmup 3 --out "$out/r/apply_quick" 2>&1 | tail -30
             tail -n 5 "$out"/r/apply_quick/logs/*.log ;;
    chain)   timeout 540 swinbench apply --recipe fmha --model swin_base_patch4_window7_224 --batch 64 \
               --out "$out/r/apply_fmha" 2>&1 | tail -45
             tail -n 3 "$out"/r/apply_fmha/logs/*.log 2>/dev/null | tail -30 ;;
    prof-fmha) timeout 330 swinbench apply --recipe fmha --stages amp,window,fmha,fmha-graph --profile \
               --model swin_base_patch4_window7_224 --batch 64 --steps 10 --warmup 3 --out "$out/r/apply_fmha_profile" 2>&1 | tail -30 ;;
    window)  timeout 120 python3 benchmarks/bench_window.py --check --out "$out/r/bench_window.json" 2>&1 | tail -31 ;;
    graphs)  timeout 270 swinbench apply --recipe fmha --stages torch-compile-graphs,fmha-compile-graphs \
               --model swin_base_patch4_window7_224 --batch 64 --steps 20 --warmup 5 --out "$out/r/apply_graphs" 2>&1 | tail -22
             tail -n 4 "$out"/r/apply_graphs/logs/*.log ;;
    dense)   timeout 120 python3 benchmarks/bench_linear.py --check --out "$out/r/bench_linear.json" 2>&1 | tail -20
             timeout 300 swinbench apply --recipe dense --stages amp,fmha,dense,fmha-graph,dense-graph \
               --model swin_base_patch4_window7_224 --batch 64 --out "$out/r/apply_dense" 2>&1 | tail -20 ;;
    linear)  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_pass_fused_linear.py tests/test_kernel_ops.py 2>&1 | tail -8
             timeout 120 python3 benchmarks/bench_linear.py --check --out "$out/r/bench_linear.json" 2>&1 | tail -20 ;;
    threads) timeout 200 python3 benchmarks/bench_host.py --parts threads,stages --stages amp,fmha --out "$out/r/bench_host_threads.json" 2>&1 | tail -70 ;;
    norms)   timeout 70 python3 benchmarks/bench_window.py --check --out "$out/r/bench_window.json" 2>&1 | tail -22
             timeout 60 python3 benchmarks/bench_layer_norm.py --check --out "$out/r/bench_layer_norm.json" 2>&1 | tail -22
             timeout 100 python3 benchmarks/bench_linear.py --check --out "$out/r/bench_linear.json" 2>&1 | tail -20 ;;
    sweep)   timeout 420 python3 benchmarks/sweep_norm_window.py --out "$out/r/sweep_norm_window.json" 2>&1 | tail -12 ;;
    sweepb)  timeout 420 python3 benchmarks/sweep_norm_window.py --dirs bwd --stages s2,s3,s4 --out "$out/r/sweep_norm_window_bwd.json" 2>&1 | tail -12 ;;
    dense-apply) timeout 420 swinbench apply --recipe dense --stages amp,fmha,dense,fmha-graph,dense-graph \
               --model swin_base_patch4_window7_224 --batch 64 --out "$out/r/apply_dense" 2>&1 | tail -24
             tail -n 3 "$out"/r/apply_dense/logs/*.log 2>/dev/null | tail -12 ;;
    scale)   timeout 300 swinbench apply --recipe fmha --stages amp,fmha --model swin_base_patch4_window7_224 --batch 192 \
               --steps 10 --warmup 3 --out "$out/r/apply_b192" 2>&1 | tail -16 ;;
    infer-quick) timeout 240 swinbench apply --recipe fmha --mode infer --stages amp,fmha,fmha-graph \
               --model swin_base_patch4_window7_224 --batch 64 --steps 10 --warmup 3 --out "$out/r/apply_infer" 2>&1 | tail -22
             tail -n 4 "$out"/r/apply_infer/logs/*.log 2>/dev/null | tail -12 ;;
    prof-block) timeout 300 swinbench apply --recipe block --stages amp,dense,block --profile --model swin_base_patch4_window7_224 \
               --batch 64 --steps 6 --warmup 3 --out "$out/r/apply_prof_block" 2>&1 | tail -12
             grep -A8 "kernel time by category" "$out"/r/apply_prof_block/report.md | head -12 ;;
    prof-api) timeout 200 swinbench apply --recipe fmha --stages amp,fmha --profile --model swin_base_patch4_window7_224 \
               --batch 64 --steps 6 --warmup 3 --out "$out/r/apply_prof_api" 2>&1 | tail -12
             grep -A8 "kernel time by category" "$out"/r/apply_prof_api/report.md | head -12
             find "$out/r" -name 'api.csv' | head -3 ;;
    block)   timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_pass_fused_block.py tests/test_column_sums.py 2>&1 | tail -4
             timeout 330 swinbench apply --recipe block --stages amp,dense,block,dense-graph,block-graph \
               --model swin_base_patch4_window7_224 --batch 64 --out "$out/r/apply_block" 2>&1 | tail -20 ;;
    infer)   timeout 540 swinbench apply --recipe fmha --mode infer --model swin_base_patch4_window7_224 --batch 64 \
               --out "$out/r/apply_fmha_infer" 2>&1 | tail -30 ;;
    apply-apex) swinbench apply --recipe apex --model swin_base_patch4_window7_224 --batch 64 --profile \
               --out "$out/r/apply_apex" 2>&1 | tail -40 ;;
    apply-fmha) swinbench apply --recipe fmha-compile --model swin_base_patch4_window7_224 --batch 64 \
               --out "$out/r/apply_fmha" 2>&1 | tail -40 ;;
    *) echo "unknown part $part" ;;
  esac
done
find "$out/r" -name '*.nsys-rep' -size +20M -delete
tar -C "$out/r" -cJf "$out/results.tar.xz" . && ls -la "$out"
