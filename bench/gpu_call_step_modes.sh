#!/usr/bin/env bash
# One device call (issue #45; ~5 minutes on an H200): does replaying the compiled layers as CUDA graphs
# (TrainConfig.compile_mode: reduce-overhead) take the acceptance bench's step off the host? Carry
# [".carry/node", ".carry/fp8"] (bash infra/node-wheelhouse.sh fills them) and run from the repository root:
#     bash bench/gpu_call_step_modes.sh
# It checks the graphs on a tiny target first (replayed, none skipped, losses equal the default mode's), then
# times the step at the bench's shape in each mode (100 steps after 10 of warm-up; a profile of 5 more says the
# GPU's busy share). Rows land in $OUT/e2e/smol-<mode>.json; compare with
# bench/results/acceptance-step-alone-2026-12-04/ (66.5 ms eager, 49.9 ms compiled, GPU busy 4.7-8.7 ms).
# Last, the compiled step on an 8,192-token row (512 anchors, the same density): the host's share of a step does
# not grow with the row (the same ops per step on the CPU at 256 and 2,048 tokens), so it should cost well under
# 4x the 2,048-token step; if so, #45's larger points train on 8,192-token steps (--token-budget 8192) at ~4x the
# tokens a second. Its row: $OUT/e2e/smol-8192.json.
set -u
export PYTHONUNBUFFERED=1
python3 -c "import glob, zipfile; [zipfile.ZipFile(w).extractall('/tmp/pylib') for w in glob.glob('.carry/node/*/*.whl') + glob.glob('.carry/fp8/*.whl')]"
export PYTHONPATH=/tmp/pylib
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/e2e" /tmp/e2e
echo "=== the graphs on a tiny target"
python3 -m pytest -o addopts="" --noconftest -q tests/gpu/test_compile_mode_gpu.py 2>&1 | tail -5
smol="--target random:smollm2-135m --token-budget 2048 --sample-len 256 --anchors 128 --layers 2 --block-size 8
      --warmup 10 --steps 100 --profile --profile-steps 5"
for mode in default reduce-overhead; do
  echo "=== step, compile mode $mode"
  timeout 200 python3 bench/bench_train_e2e.py $smol --compile-mode "$mode" --profile-out "/tmp/e2e/smol-$mode.json.gz" \
    --json "$OUT/e2e/smol-$mode.json" 2>&1 | grep -v Warn | tail -12
done
echo "=== step on an 8,192-token row, compile mode default"
wide=${smol/--token-budget 2048/--token-budget 8192}
timeout 200 python3 bench/bench_train_e2e.py ${wide/--anchors 128/--anchors 512} \
  --compile-mode default --profile-out /tmp/e2e/smol-8192.json.gz --json "$OUT/e2e/smol-8192.json" 2>&1 | grep -v Warn | tail -12
