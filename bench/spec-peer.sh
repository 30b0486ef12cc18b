#!/usr/bin/env bash
# Speculative decoding of scoria against llama.cpp's on one machine, in one command.
#
#   bench/spec-peer.sh SCORIA LLAMA_SERVER MODEL OUTDIR
#
# SCORIA        the scoria binary (built with CUDA elsewhere for DEVICE=cuda)
# LLAMA_SERVER  a llama-server binary built elsewhere ("-" for none: scoria alone); this
#               script neither fetches nor builds it
# MODEL         a GGUF with an MTP block (blk.N.nextn.*), the same file for both engines
# OUTDIR        each server's log and results.jsonl (one JSON line per setting, from
#               bench/spec_serve.py: tokens, t/s, drafted, accepted, a digest of the texts)
#
# Each setting starts its own server alone (--parallel 1 / -np 1), waits for /health,
# runs bench/spec_serve.py (five chat prompts rendered by the server's template, greedy,
# ignore_eos, TOKENS tokens each, a warm-up pass then the measured pass) and stops it.
# scoria: --spec off, mtp, ngram, auto (DRAFT_MAX drafts at most); llama.cpp: no
# speculation, then --spec-type draft-mtp --spec-draft-n-max PEER_DRAFTS.
#
# Environment (all optional): DEVICE (cuda), TOKENS (128), DRAFT_MAX (scoria's default
# when unset), PEER_DRAFTS (3, llama.cpp's default n_max), SETTINGS ("off mtp ngram auto";
# empty: none of scoria's), PORT (8181), NGL (99), CTX (4096); SCORIA_ARGS and PEER_ARGS,
# more arguments for each server (tiered experts, e.g. SCORIA_ARGS="--vram-budget 1.3G"
# PEER_ARGS="--n-cpu-moe 5").
set -u
SCORIA=${1:?scoria binary} LS=${2:?llama-server binary or -} MODEL=${3:?model} OUT=${4:?out dir}
DEVICE=${DEVICE:-cuda} TOKENS=${TOKENS:-128} PEER_DRAFTS=${PEER_DRAFTS:-3}
SETTINGS=${SETTINGS-off mtp ngram auto} PORT=${PORT:-8181} NGL=${NGL:-99} CTX=${CTX:-4096}
HERE=$(cd "$(dirname "$0")" && pwd)
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"
[ -s "$MODEL" ] || { echo "spec-peer.sh: model $MODEL not found" >&2; exit 2; }

# Starts "$@" in the background as server NAME, waits for /health (120 s at most).
serve() {
    local name=$1; shift
    "$@" >"$OUT/$name.log" 2>&1 &
    PID=$!
    for _ in $(seq 600); do
        if python3 -c "import urllib.request,sys; urllib.request.urlopen('$URL/health', timeout=2)" 2>/dev/null; then
            return 0
        fi
        kill -0 "$PID" 2>/dev/null || { echo "spec-peer.sh: $name exited; its log:" >&2; tail -20 "$OUT/$name.log" >&2; return 1; }
        sleep 0.2
    done
    echo "spec-peer.sh: $name not ready in 120 s" >&2
    return 1
}
stop() { kill "$PID" 2>/dev/null; wait "$PID" 2>/dev/null; }

measure() { # engine label
    python3 "$HERE/spec_serve.py" --url "$URL" --engine "$1" --label "$2" --tokens "$TOKENS" \
        | tee -a "$OUT/results.jsonl"
}

for s in $SETTINGS; do
    extra=()
    [ -n "${DRAFT_MAX:-}" ] && [ "$s" != off ] && extra=(--draft-max "$DRAFT_MAX")
    if serve "scoria-$s" "$SCORIA" serve --model "$MODEL" --device "$DEVICE" --port "$PORT" \
        --parallel 1 -c "$CTX" --spec "$s" "${extra[@]}" ${SCORIA_ARGS:-}; then
        measure scoria "scoria --spec $s${DRAFT_MAX:+ --draft-max $DRAFT_MAX}${SCORIA_ARGS:+ $SCORIA_ARGS}"
    fi
    stop
done

if [ "$LS" != - ]; then
    for spec in none draft-mtp; do
        extra=(--spec-type "$spec")
        [ "$spec" = draft-mtp ] && extra+=(--spec-draft-n-max "$PEER_DRAFTS")
        if serve "llama-$spec" "$LS" -m "$MODEL" -ngl "$NGL" -c "$CTX" -np 1 --port "$PORT" \
            "${extra[@]}" ${PEER_ARGS:-}; then
            measure llama "llama-server --spec-type $spec${extra[2]:+ --spec-draft-n-max $PEER_DRAFTS}${PEER_ARGS:+ $PEER_ARGS}"
        fi
        stop
    done
fi
