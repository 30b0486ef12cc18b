#!/usr/bin/env bash
# Starts `scoria serve` on a tiny model on a free loopback port (with an API key),
# waits for /health, runs the Python SDK suite (tests/server) and the headless
# Chromium check of the stats page, saves the screenshot, and stops the server; then
# runs the real coding agents, Claude Code and Codex CLI, against a demo server of
# their own (scripts/agent-clients.sh).
#
#   scripts/server-tests.sh [--model FILE | --synth] [--bin PATH] [--screenshot PATH]
#                           [--install] [--no-browser] [--no-pytest] [--no-agents]
#                           [-- PYTEST_ARGS...]
#
#   (default)     the embedded demo model (`scoria serve` with no --model)
#   --synth       write a tiny qwen35moe with `scoria synth` and serve that
#   --bin PATH    the scoria binary (default: build release/scoria in cargo's target dir)
#   --screenshot  where the stats page screenshot goes
#                 (default target/server-tests/stats-page.png)
#   --install     run scripts/install-test-deps.sh first (CI on a fresh machine)
#   --no-agents   skip the real agent clients
#
# Every step has a time limit; the server is always stopped on exit.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Where cargo puts what it builds: `target/` unless CARGO_TARGET_DIR or a cargo config
# says otherwise, so ask cargo rather than assume.
cargo_target_dir() {
  (cd "$ROOT" && cargo metadata --format-version 1 --no-deps) |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])'
}
OUT="$ROOT/target/server-tests"
mkdir -p "$OUT"

MODEL=""
SYNTH=0
BIN="${SCORIA_BIN:-}"
SHOT="$OUT/stats-page.png"
INSTALL=0
BROWSER=1
PYTEST=1
AGENTS=1
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    --synth) SYNTH=1; shift ;;
    --bin) BIN="$2"; shift 2 ;;
    --screenshot) SHOT="$2"; shift 2 ;;
    --install) INSTALL=1; shift ;;
    --no-browser) BROWSER=0; shift ;;
    --no-pytest) PYTEST=0; shift ;;
    --no-agents) AGENTS=0; shift ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

START_TIMEOUT="${SCORIA_START_TIMEOUT:-300}"
PYTEST_TIMEOUT="${SCORIA_PYTEST_TIMEOUT:-1500}"
BROWSER_TIMEOUT="${SCORIA_BROWSER_TIMEOUT:-180}"

if [ "$INSTALL" = 1 ]; then
  "$ROOT/scripts/install-test-deps.sh"
fi

if [ -z "$BIN" ]; then
  echo "== building scoria (release)"
  (cd "$ROOT" && timeout 3600 cargo build --release -p scoria-cli)
  BIN="$(cargo_target_dir)/release/scoria"
fi
[ -x "$BIN" ] || { echo "no scoria binary at $BIN" >&2; exit 2; }

if [ "$SYNTH" = 1 ] && [ -z "$MODEL" ]; then
  MODEL="$OUT/tiny-qwen35moe.gguf"
  echo "== synthesizing $MODEL"
  timeout 600 "$BIN" synth --arch qwen35moe --geometry tiny --quant q8_0 --force -o "$MODEL"
fi

PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
KEY="scoria-test-$(python3 -c 'import secrets; print(secrets.token_hex(8))')"
URL="http://127.0.0.1:$PORT"
LOG="$OUT/server.log"

SERVE_ARGS=(serve --host 127.0.0.1 --port "$PORT" --api-key "$KEY")
[ -n "$MODEL" ] && SERVE_ARGS+=(--model "$MODEL")
echo "== starting: $BIN ${SERVE_ARGS[*]/$KEY/KEY}  (log: $LOG)"
"$BIN" "${SERVE_ARGS[@]}" >"$LOG" 2>&1 &
SERVER_PID=$!

stop_server() {
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do
      kill -0 "$SERVER_PID" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  wait "$SERVER_PID" 2>/dev/null || true
}
trap stop_server EXIT

echo "== waiting for $URL/health (up to ${START_TIMEOUT}s)"
deadline=$((SECONDS + START_TIMEOUT))
until curl -sf --max-time 2 "$URL/health" >/dev/null 2>&1; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "server exited before it was ready; log:" >&2
    tail -n 50 "$LOG" >&2
    exit 1
  fi
  if [ $SECONDS -ge $deadline ]; then
    echo "server not ready after ${START_TIMEOUT}s; log:" >&2
    tail -n 50 "$LOG" >&2
    exit 1
  fi
  sleep 0.25
done
curl -s --max-time 5 "$URL/health" | python3 -c 'import json,sys; h=json.load(sys.stdin); m=h["model"]; print("   ready:", m.get("id"), m.get("arch"), "n_ctx", m.get("n_ctx"))'

export SCORIA_URL="$URL" SCORIA_API_KEY="$KEY" SCORIA_BIN="$BIN"
status=0
# The suite's packages are in scripts/install-test-deps.sh's virtual environment;
# without one, whatever python3 has.
PYTHON="$(bash "$ROOT/scripts/install-test-deps.sh" --print-venv)/bin/python"
[ -x "$PYTHON" ] || PYTHON=python3

if [ "$PYTEST" = 1 ]; then
  echo "== pytest tests/server"
  if ! (cd "$ROOT" && timeout "$PYTEST_TIMEOUT" "$PYTHON" -m pytest tests/server -q -p no:cacheprovider \
        --junitxml="$OUT/pytest.xml" "${PYTEST_ARGS[@]}"); then
    status=1
  fi
fi

if [ "$BROWSER" = 1 ]; then
  echo "== stats page in headless Chromium"
  mkdir -p "$(dirname "$SHOT")"
  if ! NODE_PATH="${SCORIA_TEST_NODE_DIR:-$OUT/node}/node_modules" timeout "$BROWSER_TIMEOUT" \
        node "$ROOT/tests/server/stats_page_check.cjs" --url "$URL" --key "$KEY" --screenshot "$SHOT"; then
    status=1
  elif [ -s "$SHOT" ]; then
    echo "   screenshot: $SHOT"
  else
    echo "no screenshot at $SHOT" >&2
    status=1
  fi
fi

if ! kill -0 "$SERVER_PID" 2>/dev/null; then
  echo "the server died during the tests; log tail:" >&2
  tail -n 50 "$LOG" >&2
  status=1
fi
stop_server

if [ "$AGENTS" = 1 ]; then
  echo "== real agent clients (Claude Code, Codex CLI)"
  if ! timeout "${SCORIA_AGENTS_TIMEOUT:-1800}" "$ROOT/scripts/agent-clients.sh" --bin "$BIN"; then
    status=1
  fi
fi
[ "$status" = 0 ] && echo "== server tests passed" || echo "== server tests FAILED (server log: $LOG)"
exit "$status"
