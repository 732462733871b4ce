#!/usr/bin/env bash
# One device call (issue #45; ~6 minutes on an H200): does replaying the compiled layers as CUDA graphs
# (TrainConfig.compile_mode: reduce-overhead) take the acceptance bench's step off the host? Carry
# [".carry/node/controller", ".carry/node/wheelhouse"] (bash infra/node-wheelhouse.sh fills them; add
# ".carry/acceptance/a" to the same call when acceptance calls follow it) and run from the repository root:
#     bash bench/gpu_call_step_modes.sh        (TOKENS="8192": one row size only; MODES="default": that mode only;
#                                               both by default)
# It checks the graphs first (tests/gpu/test_compile_mode_gpu.py: replayed, none skipped, losses equal the default
# mode's, on the 6-layer tiny target and the 30-layer SmolLM2 shape), then times the step at the bench's shape in
# each mode on 2,048- and 8,192-token rows (128 and 512 anchors: one density; 100 steps after 10 of warm-up; a
# profile of 5 more says the GPU's busy share). Rows land in $OUT/e2e/smol-<tokens>-<mode>.json, each run's whole
# log in $OUT/e2e/smol-<tokens>-<mode>.log with its profile's top kernels and host ops (the chrome traces stay in
# /tmp/e2e-traces on the machine: a call brings back at most 8 files, 16 MiB each).
# 2026-12-05 (bench/results/acceptance-step-alone-2026-12-05/): default mode 26.6 ms a 2,048-token step (GPU busy
# 4.7 ms), 46.6 ms an 8,192-token one (11.3 ms); reduce-overhead broke in the 30-layer target's first forward
# (each no-grad layer call started a new graph iteration, which gave up the last layer's output), which the
# target's layers now copy their outputs for (dflash_core.target_runtime.graph_outputs_owned). 2026-12-05, session 25:
# the graphs replay, but 4 of them record again every step (82.2 ms against 37.3 ms in the default mode); the
# reduce-overhead run logs why each graph records (TORCH_LOGS=cudagraphs,perf_hints) into its .log. Graphing the
# target's 30 layers only (a mode of session 26) lost on an H100 in session 27, 84.8 against 35.6 ms, and was taken
# out (bench/results/acceptance-step-alone-2026-12-05/session27/).
set -u
source "$(dirname "$0")/gpu_pylib.sh"  # the carried wheels on the path
mkdir -p "$OUT/e2e" /tmp/e2e-traces  # the traces stay on the machine: a call brings back at most 8 files
echo "=== the graphs: tiny target, then the 30-layer SmolLM2 shape"
timeout 300 python3 -m pytest -o addopts="" --noconftest -q tests/gpu/test_compile_mode_gpu.py > "$OUT/e2e/graphs-test.log" 2>&1
tail -5 "$OUT/e2e/graphs-test.log"
for tokens in ${TOKENS:-2048 8192}; do
  for mode in ${MODES:-default reduce-overhead}; do
    echo "=== step, $tokens-token row, compile mode $mode"
    name="smol-$tokens-$mode"
    logs=(); [ "$mode" != default ] && logs=(TORCH_LOGS=cudagraphs,perf_hints)  # why each graph records
    env "${logs[@]}" timeout 150 python3 bench/bench_train_e2e.py --target random:smollm2-135m --token-budget "$tokens" \
      --sample-len 256 --anchors $((tokens / 16)) --layers 2 --block-size 8 --warmup 10 --steps 100 --profile \
      --profile-steps 5 --compile-mode "$mode" --profile-out "/tmp/e2e-traces/$name.trace.json.gz" --json "$OUT/e2e/$name.json" \
      > "$OUT/e2e/$name.log" 2>&1
    echo "rc $?"; grep -v Warn "$OUT/e2e/$name.log" | grep -E "^random:|busy|Error" | tail -4
  done
done
