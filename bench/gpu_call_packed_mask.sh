#!/usr/bin/env bash
# One device call (issue #43; ~8 minutes on a fresh H200), carrying [".carry/node", ".carry/fp8"]
# (bash infra/node-wheelhouse.sh fills them), from the repository root:
#     bash bench/gpu_call_packed_mask.sh [hybrid|dense|both]
# A/B of dflash_core.packed_mask on one machine: transformers' packed-sequence check (find_packed_sequence_indices)
# read from the batch's host copy of the position ids (on), against transformers reading the device's copy, which
# waits for the GPU once per target forward (off: the module's install made a no-op). First the GPU test that
# such a forward does not sync, then the 27B hybrid's FP8 step (bench_hybrid_step, packed), then the Qwen3-8B
# DFlash 2 FP8 step (bench_train_e2e). Rows land in $OUT/mask/<bench>-<on|off>.json; compare with
# bench/results/drafter-fp8-2026-12-04/.
set -u
source "$(dirname "$0")/gpu_pylib.sh"  # the carried wheels on the path
mkdir -p "$OUT/mask"
echo "=== tests/gpu/test_packed_mask_gpu.py (no sync in a packed forward with the host copy)"
gpu_tests 120 tests/gpu/test_packed_mask_gpu.py
run() {  # run NAME on|off SCRIPT ARGS...: the bench in this process, with the host-copy check installed or not
  local name=$1 state=$2 script=$3; shift 3
  echo "=== $name, host-copy packed check $state"
  timeout 300 python3 - "$state" "$script" "$@" --json "$OUT/mask/$name-$state.json" <<'PY' 2>&1 | grep -v Warn | tail -4
import runpy, sys
import dflash_core.packed_mask as packed_mask
state, script = sys.argv[1], sys.argv[2]
packed_mask._installed = state == "off"  # off: install() does nothing, transformers reads the device's copy
sys.argv = [script] + sys.argv[3:]
runpy.run_path(script, run_name="__main__")
PY
}
case "${1:-both}" in
  hybrid|both)
    for state in off on; do
      run hybrid-tfp8-dfp8 "$state" bench/bench_hybrid_step.py --packing packed --target-fp8 --drafter-fp8 tensorwise
    done ;;&
  dense|both)
    for state in on off; do
      run d2-tfp8-dfp8 "$state" bench/bench_train_e2e.py --variant dflash2 --target-fp8 --drafter-fp8 tensorwise
    done ;;
esac
