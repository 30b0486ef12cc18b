#!/usr/bin/env bash
# One CPU-only comparison of scoria against llama.cpp's CPU backend on one machine, in one go.
#
#   bench/cpu-peer.sh SCORIA LLAMA_BENCH MODEL LOGDIR [THREADS] [DEADLINE_EPOCH_S]
#
# SCORIA       the scoria binary (built elsewhere; it records the commit it was built from,
#              and $SCORIA_COMMIT, when set, overrides it)
# LLAMA_BENCH  a llama-bench binary built elsewhere, CPU backend only (its commit in $PEER_COMMIT);
#              this script neither fetches nor builds it
# MODEL        the GGUF; when missing it is made with `scoria synth` ($GEOMETRY, $QUANT, seed 1)
# LOGDIR       every log goes here, plus summary.json (medians) and summary.txt
# THREADS      threads for both engines (default: nproc)
# DEADLINE     unix time after which the remaining steps are skipped (default: now + 540 s)
#
# Order: machine facts, synth if needed, page-cache warm (cat), scoria warm-up, scoria tg128 x3,
# llama-bench (pp512 + tg128, 3 repetitions, its own warm-up; jsonl
# on stdout so finished tests survive a timeout), scoria pp512 x3, then `scoria bench`'s RAM
# traffic line (the bytes a decode token reads, the GB/s and the share of the measured RAM reads),
# then scoria's prompt speed at 1, 2, 4, 8 and THREADS threads ($SCALING, pp$SCALE_N: default 128).
# Each scoria repetition gets its own prompt ids (rotated, seeded), so no two repetitions route alike.
set -u
SCORIA=${1:?scoria binary} LB=${2:?llama-bench binary} MODEL=${3:?model path} LOG=${4:?log dir}
T=${5:-$(nproc)}
DEADLINE=${6:-$(( $(date +%s) + 540 ))}
GEOMETRY=${GEOMETRY:-qwen3.6-35b-a3b} QUANT=${QUANT:-q4_k_m}
TG_N=${TG_N:-128} PP_N=${PP_N:-512} REPS=${REPS:-3}
mkdir -p "$LOG"
left() { echo $(( DEADLINE - $(date +%s) )); }
stamp() { echo "== $(date -u +%H:%M:%S) ($(left) s left) $*" | tee -a "$LOG/steps.txt"; }

# Prompt ids: n ids from a seeded LCG, in [1000, 200000) (plain tokens, no special ids).
ids() { # n seed
    awk -v n="$1" -v s="$2" 'BEGIN { x = s * 2654435761 % 4294967296;
        for (i = 0; i < n; i++) { x = (1103515245 * x + 12345) % 2147483648;
            printf "%s%d", (i ? "," : ""), 1000 + x % 199000 } }'
}

stamp "machine"
{
    date -u; uname -a; nproc; lscpu; free -g; df -h /tmp
    echo "scoria_commit=${SCORIA_COMMIT:-as built, below} peer_commit=${PEER_COMMIT:-unknown} threads=$T"
    "$SCORIA" --version
} >"$LOG/machine.txt" 2>&1
cat "$LOG/machine.txt"

if [ ! -s "$MODEL" ]; then
    stamp "synth $GEOMETRY $QUANT"
    timeout $(( $(left) - 200 )) "$SCORIA" synth --geometry "$GEOMETRY" --quant "$QUANT" --seed 1 \
        --no-sync --force -o "$MODEL" >"$LOG/synth.log" 2>&1
    echo "synth rc=$?"; tail -3 "$LOG/synth.log"
fi
"$SCORIA" inspect "$MODEL" >"$LOG/inspect.txt" 2>&1 || true
ls -l "$MODEL"

stamp "warm the page cache"
{ time cat "$MODEL" >/dev/null; } 2>&1 | tee -a "$LOG/steps.txt"
free -g | tee -a "$LOG/steps.txt"

stamp "scoria warm-up"
timeout 120 "$SCORIA" run --device cpu -m "$MODEL" --prompt-ids "$(ids 8 99)" -n 16 --ignore-eos -t "$T" \
    >"$LOG/scoria-warmup.log" 2>&1
tail -2 "$LOG/scoria-warmup.log"

for r in $(seq 1 "$REPS"); do
    [ "$(left)" -gt 150 ] || { stamp "skip scoria tg rep $r"; continue; }
    stamp "scoria tg$TG_N rep $r"
    timeout 150 "$SCORIA" run --device cpu -m "$MODEL" --prompt-ids "$(ids 8 "$r")" -n "$TG_N" --ignore-eos \
        -t "$T" >"$LOG/scoria-tg-$r.log" 2>&1
    grep -E '^scoria:|^prompt:' "$LOG/scoria-tg-$r.log"
done

if [ "$(left)" -gt 120 ]; then
    stamp "llama-bench"
    timeout $(( $(left) - 60 )) "$LB" -m "$MODEL" -p "$PP_N" -n "$TG_N" -t "$T" -r "$REPS" -ngl 0 \
        -o jsonl -oe md >"$LOG/llama-bench.jsonl" 2>"$LOG/llama-bench.err"
    echo "llama-bench rc=$?"; tail -8 "$LOG/llama-bench.err"
else
    stamp "skip llama-bench"
fi

for r in $(seq 1 "$REPS"); do
    [ "$(left)" -gt 40 ] || { stamp "skip scoria pp rep $r"; continue; }
    stamp "scoria pp$PP_N rep $r"
    timeout $(( $(left) - 20 )) "$SCORIA" run --device cpu -m "$MODEL" --prompt-ids "$(ids "$PP_N" $(( 100 + r )))" \
        -n 1 --ignore-eos -t "$T" >"$LOG/scoria-pp-$r.log" 2>&1
    grep -E '^prompt:' "$LOG/scoria-pp-$r.log"
done

if [ "$(left)" -gt 40 ]; then
    stamp "scoria bench: RAM traffic of a decode token against the measured RAM reads"
    timeout $(( $(left) - 20 )) "$SCORIA" bench --device cpu -m "$MODEL" -t "$T" -p 0 -n 64 -r 1 \
        >"$LOG/scoria-bench.md" 2>"$LOG/scoria-bench.log"
    grep -E "RAM reads|RAM traffic" "$LOG/scoria-bench.log"
fi

# Prompt speed by thread count (what does not scale shows here): pp$SCALE_N, one run each,
# thread counts from $SCALING (default 1 2 4 8 and THREADS), while time is left.
for t in ${SCALING:-1 2 4 8 $T}; do
    [ "$(left)" -gt 60 ] || { stamp "skip scaling t=$t"; continue; }
    stamp "scoria pp${SCALE_N:-128} at $t threads"
    timeout $(( $(left) - 30 )) "$SCORIA" bench --device cpu -m "$MODEL" -t "$t" -p "${SCALE_N:-128}" -n 0 -r 1 \
        >"$LOG/scoria-scale-$t.md" 2>"$LOG/scoria-scale-$t.log"
    grep -E "pp[0-9]+: [0-9]" "$LOG/scoria-scale-$t.log"
done

stamp "summary"
python3 - "$LOG" "$TG_N" "$PP_N" <<'EOF' | tee "$LOG/summary.txt"
import glob, json, re, statistics, sys
log, tg, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pat = re.compile(r"prompt: (\d+) tokens in ([\d.]+) ms \(([\d.]+) tok/s\).*generation: (\d+) tokens in ([\d.]+) ms \(([\d.]+) tok/s\)")
def runs(kind, col):
    out = []
    for f in sorted(glob.glob(f"{log}/scoria-{kind}-*.log")):
        m = pat.search(open(f).read())
        if m:
            out.append(float(m.group(col)))
    return out
s = {"scoria": {f"tg{tg}": runs("tg", 6), f"pp{pp}": runs("pp", 3)}, "llama.cpp": {}}
try:
    for line in open(f"{log}/llama-bench.jsonl"):
        if not line.strip():
            continue
        r = json.loads(line)
        name = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        s["llama.cpp"][name] = r.get("samples_ts") or [r["avg_ts"]]
        s.setdefault("llama.cpp_info", {}).update({k: r.get(k) for k in
            ("build_commit", "cpu_info", "backends", "n_threads", "type_k", "flash_attn", "n_ubatch", "n_batch", "use_mmap")})
except Exception as e:
    s["llama.cpp_error"] = repr(e)
med = {}
for eng in ("scoria", "llama.cpp"):
    for test, xs in s[eng].items():
        if xs:
            med.setdefault(test, {})[eng] = statistics.median(xs)
for test, d in med.items():
    if "scoria" in d and "llama.cpp" in d:
        d["ratio"] = d["scoria"] / d["llama.cpp"]
s["median_tps"] = med
json.dump(s, open(f"{log}/summary.json", "w"), indent=1)
print(json.dumps(s, indent=1))
EOF
stamp "done"
