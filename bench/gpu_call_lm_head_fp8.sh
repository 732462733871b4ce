#!/usr/bin/env bash
# One device call (issue #43; ~7 minutes on a fresh H100/H200), carrying [".carry/node", ".carry/fp8"]
# (bash infra/node-wheelhouse.sh fills them), from the repository root:
#     bash bench/gpu_call_lm_head_fp8.sh
# The loss's LM-head GEMMs in FP8 (TrainConfig.lm_head_fp8, dflash_core.fp8.Fp8LMHead) on one machine: first the
# GPU test (DFlash 2's compiled loss stays within 1% of bf16 at Qwen3's vocabulary), then the Qwen3-8B DFlash 2
# step with FP8 target and drafter GEMMs, the LM head in bf16 (off) and in FP8 (on). Rows land in
# $OUT/lmhead/d2-tfp8-dfp8-<off|on>.json; the goal of issue #43 item 3 is <= 241 ms a step.
set -u
source "$(dirname "$0")/gpu_pylib.sh"  # the carried wheels on the path
mkdir -p "$OUT/lmhead"
echo "=== tests/gpu/test_lm_head_fp8_gpu.py"
gpu_tests 180 tests/gpu/test_lm_head_fp8_gpu.py
for state in off on; do
  flag=(); [ "$state" = on ] && flag=(--lm-head-fp8)
  echo "=== Qwen3-8B DFlash 2, FP8 target + drafter GEMMs, LM head $state"
  timeout 240 python3 bench/bench_train_e2e.py --variant dflash2 --target-fp8 --drafter-fp8 tensorwise "${flag[@]}" \
    --json "$OUT/lmhead/d2-tfp8-dfp8-$state.json" 2>&1 | grep -v Warn | tail -5
done
