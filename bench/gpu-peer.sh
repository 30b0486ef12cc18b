#!/usr/bin/env bash
# One GPU comparison of scoria against llama.cpp on one machine, in one command.
#
#   bench/gpu-peer.sh SCORIA LLAMA_BENCH MODEL OUTDIR [NCMOE]
#
# SCORIA       the scoria binary, built with CUDA elsewhere (it records the commit it was built
#              from; $SCORIA_COMMIT, when set, overrides it)
# LLAMA_BENCH  a llama-bench binary built with CUDA elsewhere (its commit in $PEER_COMMIT,
#              else the build_commit it reports); this script neither fetches nor builds it
# MODEL        the GGUF (must exist)
# OUTDIR       every log goes here: machine.txt, scoria.json/.log, llama-bench.json/.err,
#              *-smi.csv (nvidia-smi memory samples every 200 ms), vram.txt, compare.txt and
#              results.jsonl (the lines compare.py also appends to bench/results.jsonl)
# NCMOE        llama.cpp's --n-cpu-moe for the profile (default 0: every expert in VRAM)
#
# Environment (all optional):
#   PROFILE (FULL), MODEL_LABEL ("Q35 ..." for results.jsonl; default: the file name),
#   MACHINE (default: GPU, CPU, cores and RAM as this machine reports them),
#   THREADS (16), PP (512,4096), TG (128), DEPTHS (0,4096), REPS (3), DEVICE (cuda),
#   PEER_EXTRA ("-mmp 0 -ub 4096 -b 4096": the flags docs/benchmarks.md's recorded peer runs used),
#   SCORIA_EXTRA (more `scoria bench` flags, e.g. "--vram-budget 16G" for the W16 profile, with
#   NCMOE 36 for the peer),
#   BOUND_TPS (space-separated TEST=TPS for compare.py, e.g. "tg128=252"),
#   DEADLINE (unix time after which remaining steps are skipped; default now + 570 s),
#   CGROUP_MAX (e.g. 16G for the W12-R16 profile: each engine runs in a cgroup v2 of its own
#   with that memory.max, after the page cache is dropped instead of warmed; the cgroup's
#   memory.events, memory.peak, io.stat and the page-cache lines of memory.stat go to
#   OUTDIR/<engine>-cgroup.txt: disk bytes read, refaults (thrash), OOM kills).
#
# Order: machine facts, page-cache warm (cat), scoria bench --device $DEVICE (its own warm-up
# per test, rotated seeded ids), llama-bench -ngl 99 --n-cpu-moe N -fa 1 (its own warm-up),
# then compare.py. nvidia-smi samples memory in the background during each engine's run.
set -u
SCORIA=${1:?scoria binary} LB=${2:?llama-bench binary} MODEL=${3:?model path} OUT=${4:?out dir}
NCMOE=${5:-0}
PROFILE=${PROFILE:-FULL} THREADS=${THREADS:-16} REPS=${REPS:-3} DEVICE=${DEVICE:-cuda}
PP=${PP:-512,4096} TG=${TG:-128} DEPTHS=${DEPTHS:-0,4096}
PEER_EXTRA=${PEER_EXTRA--mmp 0 -ub 4096 -b 4096}
SCORIA_EXTRA=${SCORIA_EXTRA:-}
DEADLINE=${DEADLINE:-$(( $(date +%s) + 570 ))}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
left() { echo $(( DEADLINE - $(date +%s) )); }
stamp() { echo "== $(date -u +%H:%M:%S) ($(left) s left) $*" | tee -a "$OUT/steps.txt"; }

[ -s "$MODEL" ] || { echo "gpu-peer.sh: model $MODEL not found" >&2; exit 2; }
[ -x "$SCORIA" ] || { echo "gpu-peer.sh: $SCORIA is not an executable" >&2; exit 2; }
[ -x "$LB" ] || { echo "gpu-peer.sh: $LB is not an executable" >&2; exit 2; }

SMI_PID=
smi_start() { # name
    SMI_PID=
    command -v nvidia-smi >/dev/null || return 0
    nvidia-smi --query-gpu=timestamp,index,memory.used,memory.total,utilization.gpu \
        --format=csv,noheader,nounits -lms 200 >"$OUT/$1-smi.csv" 2>&1 &
    SMI_PID=$!
}
smi_stop() { # name baseline_mib
    [ -n "$SMI_PID" ] || return 0
    kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null
    awk -F', *' -v n="$1" -v base="$2" '$3 ~ /^[0-9]+$/ { if ($3 + 0 > m) m = $3 + 0; s++ }
        END { printf "%s: VRAM peak %d MiB (%.2f GiB) on the busiest sample, %d MiB before it started, %d samples\n",
              n, m, m / 1024, base, s }' "$OUT/$1-smi.csv" | tee -a "$OUT/vram.txt"
}
vram_now() { # MiB in use on GPU 0 now
    command -v nvidia-smi >/dev/null || { echo 0; return; }
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | head -1 | tr -dc 0-9
}

stamp "machine"
{
    date -u; uname -a; nproc; lscpu; free -g; df -h /tmp
    nvidia-smi 2>&1 | head -15; nvidia-smi -L 2>&1
    echo "scoria_commit=${SCORIA_COMMIT:-as built, below} peer_commit=${PEER_COMMIT:-unknown} ncmoe=$NCMOE threads=$THREADS profile=$PROFILE"
    "$SCORIA" --version
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if [ -z "${MACHINE:-}" ]; then
    gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sort | uniq -c |
        awk '{ c = $1; $1 = ""; printf "%s%dx%s", (n++ ? ", " : ""), c, $0 }')
    cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
    MACHINE="${gpus:-no GPU}; $cpu, $(nproc) cores, $(free -g | awk '/^Mem:/ { print $2 }') GiB RAM"
fi
MODEL_LABEL=${MODEL_LABEL:-$(basename "$MODEL")}

CG=
if [ -n "${CGROUP_MAX:-}" ]; then
    echo "+memory +io" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null
    [ -w /sys/fs/cgroup/cgroup.subtree_control ] && grep -qw memory /sys/fs/cgroup/cgroup.subtree_control ||
        { echo "gpu-peer.sh: CGROUP_MAX needs a writable cgroup v2 with the memory controller" >&2; exit 2; }
fi
cg_start() { # name: a fresh cgroup with memory.max, the page cache dropped
    [ -n "${CGROUP_MAX:-}" ] || return 0
    CG=/sys/fs/cgroup/gpu-peer-$$-$1
    mkdir -p "$CG" && echo "$CGROUP_MAX" >"$CG/memory.max" && echo 0 >"$CG/memory.swap.max" 2>/dev/null
    sync; echo 3 >/proc/sys/vm/drop_caches
    stamp "cgroup $CG: memory.max $(cat "$CG/memory.max"), page cache dropped"
}
cg_stop() { # name
    [ -n "$CG" ] || return 0
    { echo "memory.max $(cat "$CG/memory.max")"; echo "memory.peak $(cat "$CG/memory.peak" 2>/dev/null)"
      echo "-- memory.events"; cat "$CG/memory.events"
      echo "-- io.stat (rbytes: bytes read from each disk)"; cat "$CG/io.stat"
      echo "-- memory.stat"; grep -E "^(anon|file|file_mapped|pgmajfault|workingset_refault_file|workingset_activate_file) " "$CG/memory.stat"
    } >"$OUT/$1-cgroup.txt" 2>&1
    cat "$OUT/$1-cgroup.txt"
    rmdir "$CG" 2>/dev/null; CG=
}
in_cg() { # command...: runs it inside $CG when there is one
    if [ -n "$CG" ]; then sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$CG" "$@"; else "$@"; fi
}

if [ -z "${CGROUP_MAX:-}" ]; then
    stamp "warm the page cache"
    { time cat "$MODEL" >/dev/null; } 2>&1 | tee -a "$OUT/steps.txt"
fi

# shellcheck disable=SC2206
SC_CMD=("$SCORIA" bench -m "$MODEL" --device "$DEVICE" -t "$THREADS" -p "$PP" -n "$TG" -d "$DEPTHS"
        -r "$REPS" $SCORIA_EXTRA -o json --output "$OUT/scoria.json")
if [ "$(left)" -gt 60 ]; then
    stamp "scoria: ${SC_CMD[*]}"
    cg_start scoria; base=$(vram_now); smi_start scoria
    in_cg timeout $(( $(left) - 40 )) "${SC_CMD[@]}" 2>"$OUT/scoria.log"
    echo "scoria rc=$?"; smi_stop scoria "$base"; cg_stop scoria; tail -12 "$OUT/scoria.log"
else
    stamp "skip scoria"
fi

# shellcheck disable=SC2206
LB_CMD=("$LB" -m "$MODEL" -ngl 99 --n-cpu-moe "$NCMOE" -fa 1 -t "$THREADS" -p "$PP" -n "$TG"
        -d "$DEPTHS" -r "$REPS" $PEER_EXTRA -o json -oe md)
if [ "$(left)" -gt 30 ]; then
    stamp "llama-bench: ${LB_CMD[*]}"
    cg_start llama-bench; base=$(vram_now); smi_start llama-bench
    in_cg timeout $(( $(left) - 15 )) "${LB_CMD[@]}" >"$OUT/llama-bench.json" 2>"$OUT/llama-bench.err"
    echo "llama-bench rc=$?"; smi_stop llama-bench "$base"; cg_stop llama-bench; tail -14 "$OUT/llama-bench.err"
else
    stamp "skip llama-bench"
fi

stamp "compare"
CACHE="page cache warm"
[ -n "${CGROUP_MAX:-}" ] && CACHE="each engine in a cgroup with memory.max $CGROUP_MAX, page cache dropped first"
bounds=()
for b in ${BOUND_TPS:-}; do bounds+=(--bound-tps "$b"); done
python3 "$HERE/compare.py" "$OUT/scoria.json" "$OUT/llama-bench.json" \
    --profile "$PROFILE" --model "$MODEL_LABEL" --machine "$MACHINE" \
    ${SCORIA_COMMIT:+--commit "$SCORIA_COMMIT"} ${PEER_COMMIT:+--peer-commit "$PEER_COMMIT"} \
    "${bounds[@]}" \
    --command "bench/gpu-peer.sh (${SC_CMD[*]}; ${LB_CMD[*]}); $CACHE, median of $REPS" \
    --results "$HERE/results.jsonl" --results "$OUT/results.jsonl" 2>&1 | tee "$OUT/compare.txt"
cat "$OUT/vram.txt" 2>/dev/null
stamp "done"
