#!/usr/bin/env bash
# One device call (issue #45; ~5 minutes on an H200): how many acceptance-bench jobs should share the GPU at once?
# Several processes on one GPU take turns on it (time-slicing between their CUDA contexts; no MPS), and the
# bench's small-target steps are host-bound: on 2026-12-05, 12 jobs sharing the H200 trained ~239K tokens/s
# together, where one DFlash 8,192-token step of that shape alone runs 176K. This runs N copies of our default's
# step (DFlash 2, the bench's SmolLM2 shape, one 8,192-token row, 512 anchors: a quarter of the acceptance
# default's 2,048) at once for each N and prints the tokens/s of each and of all together: the acceptance bench's
# --workers is the N past which the sum stops growing. Carry [".carry/node/controller", ".carry/node/wheelhouse"] and run from the repository root:
#     bash bench/gpu_call_sharing.sh ["1 2 4 8"]       (MODE=reduce-overhead to time that compile mode)
# MPS=1 runs the copies through a CUDA MPS server of this call's own (bench/gpu_mps.sh), which lets several
# processes' kernels run on the GPU at once instead of taking turns; the image may lack it (the run says so).
# Rows: $OUT/sharing/<mode>-mps-<on|off>.tar.gz (each job's .json and .log) and the table, <mode>-mps-<on|off>.md.
set -u
source "$(dirname "$0")/gpu_pylib.sh"  # the carried wheels on the path
mode=${MODE:-default}
cores=$(nproc)
source "$(dirname "$0")/gpu_mps.sh"
name="$mode-mps-$mps"  # one set per (compile mode, MPS): a call that compares them keeps both
rows="/tmp/sharing/$name"  # the rows stay here; $OUT gets 2 files a set (a call brings back at most 8)
rm -rf "$rows" && mkdir -p "$rows" "$OUT/sharing"
for n in ${1:-1 2 4 8}; do
  echo "=== $n at once"
  threads=$((cores / n > 0 ? cores / n : 1))  # as the acceptance bench splits the cores among its workers
  for i in $(seq 1 "$n"); do
    OMP_NUM_THREADS=$threads timeout 300 python3 bench/bench_train_e2e.py --target random:smollm2-135m \
      --variant dflash2 --token-budget 8192 --sample-len 256 --anchors 512 --layers 2 --block-size 8 --warmup 20 \
      --steps 200 --compile-mode "$mode" --json "$rows/$n-$i.json" > "$rows/$n-$i.log" 2>&1 &
  done
  wait
done
python3 - "$rows" "$mode" "$mps" <<'PY'
import json, statistics, sys
from pathlib import Path

folder, mode, mps = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
rows = {}
for path in folder.glob("*-*.json"):
    n = int(path.stem.split("-")[0])
    rows.setdefault(n, []).append(json.loads(path.read_text()))
lines = [f"N jobs of our default's step at once (DFlash 2, random SmolLM2 shape, 8,192-token rows, compile mode {mode}, MPS {mps})",
         "", "| jobs at once | finished | ms/step each (median of jobs) | tokens/s each | tokens/s together |",
         "|---:|---:|---:|---:|---:|"]
for n in sorted(rows):
    each = [r["tokens_per_s"] for r in rows[n]]
    lines.append(f"| {n} | {len(each)} | {statistics.median(r['ms_per_step'] for r in rows[n]):.1f} | "
                 f"{statistics.median(each):,.0f} | {sum(each):,.0f} |")
lines.append("\n(staggered starts: a job's timed steps may overlap others' compilation, which flatters N > 1 a little)")
text = "\n".join(lines)
(folder / "table.md").write_text(text + "\n")
print(text)
PY
cp "$rows/table.md" "$OUT/sharing/$name.md"
tar -czf "$OUT/sharing/$name.tar.gz" -C /tmp/sharing "$name"
