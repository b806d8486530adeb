#!/usr/bin/env bash
# One device call's worth of GPU work: correctness on the GPU, kernel benchmarks, profiles, apply runs.
# Usage (on the GPU machine, from the repo root): benchmarks/gpu_session.sh PART...
# Each part fits one 600-second call alone (the timeouts say how long it may take); put small parts
# together. Results go to $OUT (or ./gpu-out), packed into one tarball so they come back in one file.
#
#   env            swinbench env (GPU, versions, nsys, Triton launcher)
#   tests-kernels  the Triton kernels against PyTorch, fwd+bwd, on the GPU (~3 min)
#   tests-passes   the passes against timm on the GPU (~2 min)
#   tests-window   the window kernels, the cached launcher and the window/LayerNorm passes on the GPU
#   tests-rows     the token-row attention output and the window/attention passes against timm on the GPU
#   tests-pdl      the window kernels launched with programmatic dependent launch against plain launches
#   tests-launcher the cached launcher against plain launches, bit for bit, on the GPU
#   tests-compile  the fused passes under torch.compile, aot_eager and Inductor (~2.5 min)
#   window         bench_window: the window kernels against eager, % of copy bandwidth
#   window-timm    bench_window --timm-shifts: stage 4 unshifted, as timm's Swin runs it
#   window-inductor  bench_window --inductor: the same, and against the eager ops compiled by torch.compile
#   norm-bwd       diag_norm_backward: what the norm backward's column sums, stores and arithmetic cost
#   window-launch  diag_window_launch: the window ops with/without PDL and in-kernel parameter grads
#   attn           bench_window_attention: the fused attention against eager and SDPA
#   norms          bench_layer_norm and bench_linear
#   norms-window   bench_layer_norm with layer_norm / add_layer_norm through window.py's kernels (the experiment
#                  SWINBENCH_LN_VIA_WINDOW=1), against the plain `norms` run
#   ln-route       diag_layer_norm_route: layer_norm / add_layer_norm via their own kernels or window.py's, GPU time
#                  and per plain call in alternation
#   sweep-norm     the norm + shift + partition backward's launch sweep at stages 3-4
#   warp-rows      diag_warp_rows: the LayerNorm + shift + partition forward with a warp per row, against the shipped one
#   sweep-slots    the same for the ROW_SUMS tile: band length, pipelining and rows of column sums (slots)
#   diag           diag_maxnreg and diag_column_sums
#   eager          amp, fmha and fmha-gather (the bias gathered before the attention), eager, profiled,
#                  then 12 rounds in alternation
#   eager-pair     as eager, amp and fmha only (profiled, 12 interleaved rounds)
#   graph-fmha     fmha-graph alone (step ms with CUDA-graph replay)
#   graphs         amp, fmha-graph, torch-compile-graphs, fmha-compile-graphs, block-graph
#   compile        torch-compile and fmha-compile, then 8 rounds in alternation
#   prof-compile-graphs  fmha-compile-graphs and torch-compile-graphs, profiled
#   block          amp, dense, block, dense-graph, block-graph
#   infer          the fmha chain, forward only
#   chain          the whole fmha-compile recipe, baseline to fmha-compile
#   host           bench_host: what the host spends per step
#   host-eager     bench_host at batch 64 for amp and fmha: host ms per step, per-thread and cProfile tops
#   host-phases    host ms of forward / backward / optimizer for amp and fmha at batch 64
#   host-paired    amp, fmha and fmha without merge_add_norm in one process, steps in alternation (20 rounds);
#                  PAIRED_STAGES=amp,fmha,fmha+plainlaunch (say) pairs other stages
#   host-spy       where py-spy is installed (a wheel in .gpu/wheels): sampled Python stacks of 60 eager fmha
#                  steps, every thread (collapsed stacks in pyspy_fmha.txt)
#   profile        swinbench profile on Swin-T (the README's first command, under nsys)
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out/r"
export PYTHONUNBUFFERED=1
source .gpu/setup-gpu.sh >/dev/null 2>&1 || echo "setup-gpu.sh failed: no nsys/nvtx"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
B64=(--model swin_base_patch4_window7_224 --batch 64)
pytest_part() {  # name timeout files...: the failures in full in $out/r/NAME.log, a summary here
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rf --tb=long --durations=5 "$@" > "$out/r/$name.log" 2>&1
  echo "rc=$?"; grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$out/r/$name.log" | head -40
}
for part in "$@"; do
  echo "=== $part $(date -u +%H:%M:%S)"
  case $part in
    env)     swinbench env 2>&1 | tail -30 ;;
    tests-kernels) pytest_part tests_kernels 400 tests/test_window_kernels.py tests/test_layer_norm.py tests/test_cached_launcher.py \
               tests/test_column_sums.py tests/test_kernel_ops.py tests/test_window_attention.py ;;
    tests-passes) pytest_part tests_passes 400 tests/test_pass_fused_window.py tests/test_pass_fused_layernorm.py \
               tests/test_pass_fused_attention.py tests/test_pass_fused_block.py tests/test_pass_fused_linear.py \
               tests/test_pass_master_weights.py ;;
    tests-window) pytest_part tests_window 450 tests/test_window_kernels.py tests/test_cached_launcher.py \
               tests/test_pass_fused_window.py tests/test_pass_fused_layernorm.py ;;
    tests-rows) pytest_part tests_rows 200 tests/test_pass_fused_window.py tests/test_pass_fused_attention.py \
               tests/test_window_attention.py -k "token_rows or table_mode or matches_unpatched or composes or norm2" ;;
    tests-pdl) pytest_part tests_pdl 200 tests/test_window_kernels.py tests/test_cached_launcher.py -k "pdl or launcher" ;;
    tests-launcher) pytest_part tests_launcher 200 tests/test_cached_launcher.py ;;
    tests-compile) pytest_part tests_compile 400 tests/test_compile_fused_passes.py ;;
    window)  timeout 120 python3 benchmarks/bench_window.py --check --out "$out/r/bench_window.json" 2>&1 | tail -31 ;;
    window-timm) timeout 120 python3 benchmarks/bench_window.py --check --timm-shifts --out "$out/r/bench_window_timm_shifts.json" 2>&1 | tail -31 ;;
    window-inductor) timeout 560 python3 benchmarks/bench_window.py --inductor --out "$out/r/bench_window_inductor.json" 2>&1 | tail -33 ;;
    window-launch) timeout 300 python3 benchmarks/diag_window_launch.py --out "$out/r/diag_window_launch.json" 2>&1 | tail -32 ;;
    norm-bwd) timeout 200 python3 benchmarks/diag_norm_backward.py --stages ${DIAG_STAGES:-s2,s3,s4} --out "$out/r/diag_norm_backward.json" 2>&1 | tail -8 ;;
    norms-window) SWINBENCH_LN_VIA_WINDOW=1 timeout 90 python3 benchmarks/bench_layer_norm.py --check \
               --out "$out/r/bench_layer_norm_via_window.json" 2>&1 | tail -22 ;;
    ln-route) timeout 200 python3 benchmarks/diag_layer_norm_route.py --out "$out/r/diag_layer_norm_route.json" 2>&1 | tail -14 ;;
    attn)    timeout 200 python3 benchmarks/bench_window_attention.py --check --out "$out/r/bench_window_attention.json" 2>&1 | tail -25 ;;
    norms)   timeout 90 python3 benchmarks/bench_layer_norm.py --check --out "$out/r/bench_layer_norm.json" 2>&1 | tail -22
             timeout 120 python3 benchmarks/bench_linear.py --check --out "$out/r/bench_linear.json" 2>&1 | tail -20 ;;
    sweep-norm) timeout 420 python3 benchmarks/sweep_norm_window.py --dirs bwd --stages s3,s4 \
               --out "$out/r/sweep_norm_window_bwd.json" 2>&1 | tail -16 ;;
    warp-rows) timeout 200 python3 benchmarks/diag_warp_rows.py --out "$out/r/diag_warp_rows.json" 2>&1 | tail -12 ;;
    sweep-slots) timeout 420 python3 benchmarks/sweep_norm_window.py --dirs bwd --stages ${SWEEP_STAGES:-s3,s4} --family slots \
               --out "$out/r/sweep_norm_window_slots.json" 2>&1 | tail -16 ;;
    diag)    timeout 90 python3 benchmarks/diag_maxnreg.py 2>&1 | tail -16
             timeout 90 python3 benchmarks/diag_column_sums.py 2>&1 | tail -12 ;;
    eager)   timeout 400 swinbench apply --recipe fmha --stages amp,fmha,benchmarks/recipes/fmha-gather.yaml --profile \
               "${B64[@]}" --steps 10 --warmup 3 --interleave 12 --out "$out/r/apply_eager" 2>&1 | tail -14 ;;
    eager-pair) timeout 330 swinbench apply --recipe fmha --stages amp,fmha --profile \
               "${B64[@]}" --steps 10 --warmup 3 --interleave 12 --out "$out/r/apply_eager_pair" 2>&1 | tail -14 ;;
    graph-fmha) timeout 200 swinbench apply --recipe fmha --stages fmha-graph "${B64[@]}" --out "$out/r/apply_graph_fmha" 2>&1 | tail -10 ;;
    graphs)  timeout 540 swinbench apply --recipe fmha --stages amp,fmha-graph,torch-compile-graphs,fmha-compile-graphs,block-graph \
               "${B64[@]}" --out "$out/r/apply_graphs" 2>&1 | tail -24 ;;
    compile) timeout 500 swinbench apply --recipe fmha-compile --stages torch-compile,fmha-compile \
               "${B64[@]}" --interleave 8 --out "$out/r/apply_compile" 2>&1 | tail -20 ;;
    prof-compile-graphs) timeout 540 swinbench apply --recipe fmha --stages torch-compile-graphs,fmha-compile-graphs --profile \
               "${B64[@]}" --steps 10 --warmup 3 --out "$out/r/apply_prof_compile_graphs" 2>&1 | tail -12
             grep -A6 "kernel time by category" "$out"/r/apply_prof_compile_graphs/report.md | head -8 ;;
    block)   timeout 400 swinbench apply --recipe block --stages amp,dense,block,dense-graph,block-graph \
               "${B64[@]}" --out "$out/r/apply_block" 2>&1 | tail -20 ;;
    infer)   timeout 540 swinbench apply --recipe fmha --mode infer "${B64[@]}" --out "$out/r/apply_infer" 2>&1 | tail -30 ;;
    chain)   timeout 540 swinbench apply --recipe fmha-compile "${B64[@]}" --out "$out/r/apply_chain" 2>&1 | tail -40 ;;
    host)    timeout 240 python3 benchmarks/bench_host.py --out "$out/r/bench_host.json" 2>&1 | tail -75 ;;
    host-eager) timeout 300 python3 benchmarks/bench_host.py --parts stages,threads,pyprof --stages amp,fmha --batch 64 \
               --out "$out/r/bench_host_eager.json" 2>&1 | tail -90 ;;
    host-phases) timeout 240 python3 benchmarks/bench_host.py --parts phases --stages amp,fmha --steps 20 --batch 64 \
               --out "$out/r/bench_host_phases.json" 2>&1 | tail -8 ;;
    host-paired) timeout 300 python3 benchmarks/bench_host.py --parts paired --stages "${PAIRED_STAGES:-amp,fmha,fmha+nomergenorm}" --steps 20 \
               --batch 64 --out "$out/r/bench_host_paired_eager.json" 2>&1 | tail -6 ;;
    host-spy)  spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
               if [ -x "$spy" ]; then
                 timeout 200 "$spy" record --nonblocking --threads --rate 200 --format raw -o "$out/r/pyspy_fmha.txt" -- \
                   python3 benchmarks/bench_host.py --parts phases --stages fmha --steps 60 --batch 64 2>&1 | tail -4; ls -la "$out/r"
               else echo "no py-spy"; fi ;;
    profile) timeout 300 swinbench profile --model swin_tiny_patch4_window7_224 --mode train --batch 32 --precision bf16 \
               --steps 4 --warmup 3 --out "$out/r/profile_swin_tiny_train_bf16" --top 12 2>&1 | tail -60 ;;
    *) echo "unknown part $part (see the list at the top of benchmarks/gpu_session.sh)" ;;
  esac
done
find "$out/r" -name '*.nsys-rep' -size +20M -delete
tar -C "$out/r" -cJf "$out/results.tar.xz" . && ls -la "$out"
