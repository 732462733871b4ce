#!/usr/bin/env bash
# A bench run longer than one device call (10 minutes), on one warm machine: start it in its own process session
# (the device tool ends a call's other processes when the call returns, not those), then wait for it in calls
# that follow one another within the machine's 30 s of idle, each bringing back what it wrote so far. No
# checkpoint, reload or recompile between calls, which --resume costs (~1-2 minutes a call for the acceptance
# bench). The machine still goes back after 30 minutes held, and device time counts all the while.
#     bash bench/gpu_background.sh start bash bench/gpu_call_acceptance.sh scale 2000 16 "0 1" 12 1500 ...
#     bash bench/gpu_background.sh wait 560     (again until it says finished; timeout_s of the call > 560)
# The run's $OUT is $BG/out (default BG=/tmp/bg); each wait copies it into the call's $OUT and prints the log's
# tail. `start` refuses while an earlier run is still going, or finished with no wait since to bring it back.
set -u
BG=${BG:-/tmp/bg}
case "${1:-}" in
  start)
    shift
    if [ $# -eq 0 ]; then echo "usage: bash bench/gpu_background.sh start COMMAND [ARGS...]" >&2; exit 2; fi
    if [ -f "$BG/pid" ] && [ ! -f "$BG/rc" ] && kill -0 "$(cat "$BG/pid")" 2>/dev/null; then
      echo "a run is still going (pid $(cat "$BG/pid")): wait for it first" >&2; exit 1
    fi
    if [ -f "$BG/rc" ] && [ ! -f "$BG/fetched" ] && [ "${FORCE:-0}" != 1 ]; then
      echo "the last run (rc $(cat "$BG/rc")) finished but no wait brought its output back: wait first, or FORCE=1" >&2
      exit 1
    fi
    rm -rf "$BG" && mkdir -p "$BG/out"
    printf '%q ' "$@" > "$BG/command"
    OUT="$BG/out" setsid bash -c "$(cat "$BG/command") > '$BG/log.txt' 2>&1; echo \$? > '$BG/rc'" < /dev/null > /dev/null 2>&1 &
    echo $! > "$BG/pid"
    echo "started (pid $!): $(cat "$BG/command")"
    ;;
  wait)
    limit=${2:-540}
    if [ ! -f "$BG/pid" ]; then echo "no run started in $BG" >&2; exit 2; fi
    end=$((SECONDS + limit))
    while [ ! -f "$BG/rc" ] && [ "$SECONDS" -lt "$end" ]; do sleep 2; done
    [ -n "${OUT:-}" ] && mkdir -p "$OUT" && cp -r "$BG/out/." "$OUT/"
    tail -n "${TAIL_LINES:-40}" "$BG/log.txt"
    if [ -f "$BG/rc" ]; then
      [ -n "${OUT:-}" ] && touch "$BG/fetched"
      echo "finished: rc $(cat "$BG/rc")"; exit "$(cat "$BG/rc")"
    fi
    if ! kill -0 "$(cat "$BG/pid")" 2>/dev/null; then echo "the run died without an exit status (killed?)"; exit 1; fi
    echo "still running: wait again"
    ;;
  *) echo "usage: bash bench/gpu_background.sh start COMMAND [ARGS...] | wait [SECONDS]" >&2; exit 2 ;;
esac
