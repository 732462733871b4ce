#!/usr/bin/env bash
# One acceptance call on the device machine (bench_acceptance.py's docstring has the procedure): after a first
# call that carried [".carry/acceptance/a"], carry [".carry/acceptance/b"] (plus ".carry/fp8" for FP8 rows) and
#     bash bench/gpu_call_acceptance.sh SUITE STEPS MULTIPLIER "SEEDS" WORKERS DEADLINE_S [more bench options]
# SUITE "-": no suite, the rows of --variants alone; e.g. issue #43's FP8 rows at 2,000 steps over 4x data, two
# jobs a call (the bf16 default's seeds 0 and 1 are in bench/results/drafter-fp8-2026-12-04/acceptance-2000-steps):
#     bash bench/gpu_call_acceptance.sh - 2000 4 "0" 2 420 --variants default+drafter_fp8,default+target_fp8+drafter_fp8
# or a point of issue #45's curve, resumable across calls on the warm machine (add --resume to the next call):
#     bash bench/gpu_call_acceptance.sh scale 2000 4 "0 1" 12 480 --checkpoint-every 500 --train-compile
# A point longer than one call runs in the background on the warm machine instead (bench/gpu_background.sh):
#     bash bench/gpu_background.sh start bash bench/gpu_call_acceptance.sh scale 2000 16 "0 1" 6 1500 --token-budget 8192
# Rows land in $OUT (results.jsonl, table.md, log.txt); merge the curve's with bench/acceptance_curve.py.
# Completions generated in the call come back in $OUT/completions.tar: unpack it into the ignored
# .carry/acceptance/completions/ (tar -xf ... -C) and carry that folder (a call of its own) in later sessions.
set -u
if [ $# -lt 6 ]; then
  echo "usage: bash bench/gpu_call_acceptance.sh SUITE STEPS MULTIPLIER \"SEEDS\" WORKERS DEADLINE_S [options]" >&2
  exit 2
fi
suite=() steps=$2 multiplier=$3 seeds=$4 workers=$5 deadline=$6
[ "$1" != "-" ] && suite=(--suite "$1")
shift 6
wheels=(.carry/acceptance/b/whl/*.whl)
[ -d .carry/fp8 ] && wheels+=(.carry/fp8/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "${wheels[@]}" || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
source "$(dirname "$0")/gpu_mps.sh"  # MPS=1: the workers share the GPU through an MPS server (bench/gpu_call_sharing.sh)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# Every 10 s while the jobs run: the GPU's busy share and memory, and the host's load (16 cores): which of the
# two a set of jobs sharing the GPU waits on (their rows' host_*_ms say where each job's main thread went).
if command -v nvidia-smi > /dev/null; then
  (while sleep 10; do
     echo "$(date +%T) gpu $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader) load $(cut -d' ' -f1-3 /proc/loadavg)"
   done) > "$OUT/utilization.txt" 2>&1 &
  sampler=$!
  trap 'kill "$sampler" 2> /dev/null; mps_stop' EXIT  # this trap replaces gpu_mps.sh's: stop its server too
fi
set -o pipefail
# shellcheck disable=SC2086  # the seeds are several arguments
python3 bench/bench_acceptance.py --assets .carry/acceptance --out "$OUT" --work /tmp/acceptance "${suite[@]}" \
  --steps "$steps" --long-multiplier 0 --seeds $seeds --data-multipliers "$multiplier" --eval-prompts 16 \
  --eval-new-tokens 96 --workers "$workers" --deadline-s "$deadline" "$@" 2>&1 | grep -v Warning | tee "$OUT/log.txt" | tail -60
exit $?
