#!/usr/bin/env bash
# Two scoria builds (or one build under two settings) on the same `scoria bench`
# arguments, alternated round by round, so that a machine whose speed drifts (the lent
# hosts move by ±15% between machines and within one) moves both alike.
#
#   bench/ab.sh ROUNDS LOGDIR A B -- BENCH_ARGS...
#
# A and B: a scoria binary, optionally with settings for its runs, as
#   PATH[,VAR=VALUE...]      e.g. /tmp/old   or   .carry/gpu/scoria,SCORIA_NO_PDL=1
# Each run is `env VARS PATH bench BENCH_ARGS`, its stderr in LOGDIR/{a,b}-ROUND.log, its
# table in LOGDIR/{a,b}-ROUND.md. Prints, per round and side, the runs' median lines
# ("tg128: 349.26 t/s median", "tg128 x4: ..."), then each test's medians side by side
# in LOGDIR/summary.txt. A run that fails is reported and the rounds go on.
set -u
ROUNDS=${1:?rounds} LOG=${2:?log dir} A=${3:?build A} B=${4:?build B}
shift 4
[ "${1:-}" = "--" ] && shift
mkdir -p "$LOG"

run() { # side spec round
    local side=$1 spec=$2 r=$3
    shift 3
    local bin=${spec%%,*} vars=()
    [ "$bin" != "$spec" ] && IFS=, read -r -a vars <<<"${spec#*,}"
    env "${vars[@]}" "$bin" bench "$@" >"$LOG/$side-$r.md" 2>"$LOG/$side-$r.log" ||
        echo "$side round $r: exit $? (see $LOG/$side-$r.log)"
    grep -Eo '(tg|pp)[0-9]+(@d[0-9]+)?( x[0-9]+)?: [0-9.]+ t/s median' "$LOG/$side-$r.log" |
        sed "s/^/$side round $r: /"
}
for r in $(seq 1 "$ROUNDS"); do
    run a "$A" "$r" "$@"
    run b "$B" "$r" "$@"
done | tee "$LOG/runs.txt"

# test | A's medians | B's medians | B / A (of the medians of each side's rounds)
python3 - "$LOG/runs.txt" <<'PY' | tee "$LOG/summary.txt"
import re, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    m = re.match(r"(a|b) round \d+: (.+): ([\d.]+) t/s median", line)
    if m:
        runs.setdefault(m.group(2), {"a": [], "b": []})[m.group(1)].append(float(m.group(3)))
print("| test | A (t/s per round) | B (t/s per round) | B / A |")
print("|---|---|---|---|")
for test, s in runs.items():
    ratio = (f"{statistics.median(s['b']) / statistics.median(s['a']):.3f}"
             if s["a"] and s["b"] else "—")
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs) or "—"
    print(f"| {test} | {fmt(s['a'])} | {fmt(s['b'])} | {ratio} |")
PY
