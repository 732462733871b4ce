#!/usr/bin/env bash
# One device call (issue #45; ~4-5 minutes warm with the speculators check, ~3 without): the acceptance bench's default step alone on the GPU (random
# SmolLM2 shape, DFlash 2, 2 layers reading 5 target layers, one 8,192-token row of 2,048 anchors: the default's 512
# per 2,048 tokens), its drafter attention flex (how the acceptance rows train from session 28 on), then dense
# (SDPA over the whole [16,384 x 24,576] grid: how every row trained before). Carry [".carry/node/controller",
# ".carry/node/wheelhouse"] (bash infra/node-wheelhouse.sh fills them; a warm machine keeps them from an earlier
# call), with ".carry/acceptance/b" for the speculators check below, and run from the repository root:
#     bash bench/gpu_call_acceptance_step.sh
# First, where .carry/acceptance/b is carried: speculators' drafter with its flex attention in its compiled forward
# (tests/gpu/test_speculators_flex_gpu.py), which the acceptance rows now train with: if it failed on this torch, the
# bench's eager fallback would run torch's slow flex reference.
# Rows: $OUT/e2e/acceptance-default-<flex|sdpa>.json and .log (each with its profile's GPU busy share, top kernels
# and peak GiB). The two rows' GPU-busy ms a step say what the acceptance jobs gain with flex (estimated ~2x:
# bench/bench_attention_work.py counts 5.57 TFLOP of dense attention a step against flex's 0.12); the dense row's
# top kernels say which SDPA kernel the old rows ran (a mask with grouped K/V heads: torch may take its math backend).
set -u
source "$(dirname "$0")/gpu_pylib.sh"  # the carried wheels on the path
mkdir -p "$OUT/e2e"
if compgen -G ".carry/acceptance/b/whl/*.whl" > /dev/null; then
  echo "=== speculators' compiled flex forward (tests/gpu/test_speculators_flex_gpu.py)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .carry/acceptance/b/whl/*.whl \
    && PYTHONPATH=/tmp/site timeout 150 python3 -m pytest -o addopts="" --noconftest -q -p no:cacheprovider \
      tests/gpu/test_speculators_flex_gpu.py > "$OUT/e2e/speculators-flex-test.log" 2>&1
  tail -3 "$OUT/e2e/speculators-flex-test.log"
fi
for attention in flex sdpa; do
  echo "=== the acceptance default's step, drafter attention $attention"
  name="acceptance-default-$attention"
  timeout 200 python3 bench/bench_train_e2e.py --target random:smollm2-135m --variant dflash2 --token-budget 8192 \
    --sample-len 256 --anchors 2048 --layers 2 --block-size 8 --warmup 10 --steps 100 --profile --profile-steps 5 \
    --attention "$attention" --profile-out "/tmp/$name.trace.json.gz" --json "$OUT/e2e/$name.json" > "$OUT/e2e/$name.log" 2>&1
  echo "rc $?"; grep -v Warn "$OUT/e2e/$name.log" | grep -E "^random:|busy|Error" | tail -4
done
