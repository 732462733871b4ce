#!/usr/bin/env bash
# Issue #43's GPU calls that are left (one H200; each call under the device tool's 10 minutes), carrying
# [".carry/node", ".carry/fp8"] (bash infra/node-wheelhouse.sh fills them), from the repository root:
#     bash bench/gpu_call_fp8_profiles.sh profiles     (~6 min)
#     bash bench/gpu_call_fp8_profiles.sh hybrid-bf16  (~4 min)
# profiles: where the two FP8 steps that miss their goals spend their time. The Qwen3-8B DFlash 2 step with FP8
#   target and drafter GEMMs (288.6 ms against <= 241) with bench_train_e2e's profile (GPU busy share, each
#   phase's span and kernel time, top kernels), then the 27B hybrid's FP8 step (756.5 ms against <= 700) with
#   bench_hybrid_step's profile (top ops by device time: the GDN kernels against the packing copies).
# hybrid-bf16: the 27B hybrid's bf16 row, not measured since 2026-12-01 (1,024.9 ms against <= 900).
# Rows and profile tables land in $OUT/fp8/; compare with bench/results/drafter-fp8-2026-12-04/.
#   (bench_hybrid_step profiles its timed steps: its ms under the profiler is not the row's figure.)
set -u
case "${1:-}" in
  profiles|hybrid-bf16) ;;
  *) echo "usage: bash bench/gpu_call_fp8_profiles.sh profiles|hybrid-bf16" >&2; exit 2 ;;
esac
source "$(dirname "$0")/gpu_pylib.sh"  # the carried wheels on the path
mkdir -p "$OUT/fp8"
case "${1:-}" in
  profiles)
    echo "=== Qwen3-8B DFlash 2, FP8 target + FP8 drafter (tensorwise), profiled"
    timeout 240 python3 bench/bench_train_e2e.py --variant dflash2 --target-fp8 --drafter-fp8 tensorwise \
      --profile --profile-out "$OUT/fp8/e2e-dflash2-tfp8-dfp8.json.gz" --json "$OUT/fp8/e2e-dflash2-tfp8-dfp8.json" \
      2>&1 | grep -v Warn | tail -60
    echo "=== 27B hybrid, packed, FP8 target + FP8 drafter (tensorwise), profiled"
    timeout 300 python3 bench/bench_hybrid_step.py --packing packed --target-fp8 --drafter-fp8 tensorwise --profile \
      --json "$OUT/fp8/hybrid-tfp8-dfp8-profiled.json" 2>&1 | grep -v Warn | tail -45
    ;;
  hybrid-bf16)
    echo "=== 27B hybrid, packed, bf16"
    timeout 540 python3 bench/bench_hybrid_step.py --packing packed --json "$OUT/fp8/hybrid-bf16.json" \
      2>&1 | grep -v Warn | tail -20
    ;;
esac
