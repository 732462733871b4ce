#!/usr/bin/env bash
# On a node set up by infra/node-install.sh, from the repository root: the local services (SeaweedFS, Prefect
# server, stage server; detached with setsid, so they outlive this shell) and ONE pipeline run, started
# detached too, then its output followed for at most WAIT_S seconds. Run it again to follow the same run
# (a run that is still going is never started twice); once it ended, its output and exit status are printed.
# A new run needs the old record moved away: rm WORK_DIR/pipeline.*
#
#   bash infra/node-pipeline.sh WORK_DIR PARAMS_FILE [WAIT_S]
#   e.g. bash infra/node-pipeline.sh /tmp/dflash-node infra/examples/smollm2-1gpu.json 540
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(realpath "${1:?usage: node-pipeline.sh WORK_DIR PARAMS_FILE [WAIT_S]}")
params=$(realpath "${2:?usage: node-pipeline.sh WORK_DIR PARAMS_FILE [WAIT_S]}")
wait_s=${3:-540}
export DFLASH_WORK_DIR="$work" DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
dflash="$work/venv/bin/dflash"
log="$work/pipeline.log" pid_file="$work/pipeline.pid" rc_file="$work/pipeline.rc"
started=$(date +%s)
"$dflash" services up
echo "services up in $(( $(date +%s) - started )) s"
if [ ! -f "$pid_file" ]; then
  # The exit status lands in pipeline.rc; the run's own processes are the stage server's, not this shell's.
  setsid nohup sh -c "'$dflash' run pipeline --params '$params'; echo \$? > '$rc_file'" \
    > "$log" 2>&1 < /dev/null &
  echo $! > "$pid_file"
  echo "pipeline started (log $log)"
fi
seen=$(cat "$work/pipeline.seen" 2>/dev/null || echo 0)  # lines an earlier follow printed
while :; do
  lines=$(wc -l < "$log")
  if [ "$lines" -gt "$seen" ]; then
    sed -n "$((seen + 1)),${lines}p" "$log"
    seen=$lines
    echo "$seen" > "$work/pipeline.seen"
  fi
  if [ -f "$rc_file" ]; then
    echo "pipeline ended with exit status $(cat "$rc_file") after following for $(( $(date +%s) - started )) s"
    exit "$(cat "$rc_file")"
  fi
  if [ $(( $(date +%s) - started )) -ge "$wait_s" ]; then
    echo "pipeline still running after following for $wait_s s: run this again to keep following"
    exit 0
  fi
  sleep 5
done
