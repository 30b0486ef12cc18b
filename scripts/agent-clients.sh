#!/usr/bin/env bash
# Real coding agents against `scoria serve` (issue 12): Claude Code and Codex CLI,
# installed from npm at pinned versions, each run non-interactively against the
# embedded demo model (with an API key) through the steering proxy
# tests/agents/steer_proxy.py, which ends every answer at once and, once, answers with
# a canned tool call so the client's tool-result turn reaches the server.
#
#   scripts/agent-clients.sh [--bin PATH] [--only claude|codex] [--full] [--install-only]
#
#   --bin PATH      the scoria binary (default: release/scoria in cargo's target dir, built if missing)
#   --only NAME     run one client
#   --full          the clients' default prompts (Claude Code ~19k tokens, Codex ~9k) and
#                   a 64k context: minutes per turn on a small CPU. Without it each client
#                   gets a short system prompt and a few tools (~2k tokens a turn), which
#                   keeps CI fast and changes nothing in the protocol.
#   --install-only  install the clients and stop
#
# SCORIA_AGENT_SERVE_ARGS adds arguments to `scoria serve` (e.g. "--threads 1", so a
# --full prompt takes longer than the clients' 300 s stream watchdogs).
#
# Checks, per client: exit status 0, every request answered 2xx, streams ended properly,
# the tool round trip reached the server and was accepted. Prints each client's
# version and the prompt-cache reuse of each follow-up turn; no reuse is a failure
# (SCORIA_AGENT_EXPECT_CACHE=0 only reports it). Claude Code then runs a second
# session with another prompt (so its billing header differs, as between real
# sessions); the two sessions' first turns, replayed in order on a fresh server, must
# show the second reusing the first's cached system prompt and tools (same switch).
# Outputs: target/agent-tests/<client>/ (claude2/: the second session).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Where cargo puts what it builds: `target/` unless CARGO_TARGET_DIR or a cargo config
# says otherwise, so ask cargo rather than assume.
cargo_target_dir() {
  (cd "$ROOT" && cargo metadata --format-version 1 --no-deps) |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])'
}
OUT="$ROOT/target/agent-tests"
CLIENTS="${SCORIA_AGENT_CLIENTS_DIR:-$ROOT/target/agent-clients}"
CLAUDE_VERSION=2.1.197
CODEX_VERSION=0.171.0

BIN="${SCORIA_BIN:-}"
ONLY=""
FULL=0
INSTALL_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) BIN="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --full) FULL=1; shift ;;
    --install-only) INSTALL_ONLY=1; shift ;;
    -h|--help) sed -n '2,28p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
CLIENT_TIMEOUT="${SCORIA_AGENT_TIMEOUT:-600}"
[ "$FULL" = 1 ] && CLIENT_TIMEOUT="${SCORIA_AGENT_TIMEOUT:-7200}"

command -v node >/dev/null 2>&1 || {
  echo "node is missing: run scripts/install-test-deps.sh (Debian's nodejs)" >&2
  exit 2
}

# ---- the clients, pinned, in an ignored prefix (skipped when already there)
installed_version() { # package name -> version in $CLIENTS, or nothing
  node -e 'try { console.log(require(process.argv[1] + "/package.json").version) } catch (e) {}' \
    "$CLIENTS/node_modules/$1" 2>/dev/null || true
}
if [ "$(installed_version @anthropic-ai/claude-code)" != "$CLAUDE_VERSION" ] \
   || [ "$(installed_version @openai/codex)" != "$CODEX_VERSION" ]; then
  echo "== installing Claude Code $CLAUDE_VERSION and Codex $CODEX_VERSION (npm) into $CLIENTS"
  mkdir -p "$CLIENTS"
  [ -f "$CLIENTS/package.json" ] || echo '{"name":"scoria-agent-clients","private":true}' > "$CLIENTS/package.json"
  timeout 900 npm install --prefix "$CLIENTS" --no-audit --no-fund --silent \
    "@anthropic-ai/claude-code@$CLAUDE_VERSION" "@openai/codex@$CODEX_VERSION"
fi
CLAUDE="$CLIENTS/node_modules/.bin/claude"
CODEX="$CLIENTS/node_modules/.bin/codex"
# Claude Code's native binary is put in place by its postinstall script, which some npm
# configurations skip: run it then.
if ! timeout 60 "$CLAUDE" --version >/dev/null 2>&1; then
  (cd "$CLIENTS/node_modules/@anthropic-ai/claude-code" && timeout 300 node install.cjs)
fi
echo "   $(timeout 60 "$CLAUDE" --version)"
echo "   $(timeout 60 "$CODEX" --version 2>/dev/null | tail -n 1)"
[ "$INSTALL_ONLY" = 1 ] && exit 0

if [ -z "$BIN" ]; then
  BIN="$(cargo_target_dir)/release/scoria"
  if [ ! -x "$BIN" ]; then
    echo "== building scoria (release)"
    (cd "$ROOT" && timeout 3600 cargo build --release -p scoria-cli)
  fi
fi
[ -x "$BIN" ] || { echo "no scoria binary at $BIN" >&2; exit 2; }

# ---- the server: the demo model, an API key, a free loopback port
mkdir -p "$OUT"
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
KEY="scoria-agents-$(python3 -c 'import secrets; print(secrets.token_hex(8))')"
URL="http://127.0.0.1:$PORT"
CTX=8192
[ "$FULL" = 1 ] && CTX=65536
LOG="$OUT/server.log"
# shellcheck disable=SC2086 # word splitting of the extra arguments is intended
# The demo model with a random vision encoder of its width, so a screenshot the client
# reads reaches the model (it sees nothing in it: the encoder is random).
MMPROJ="$ROOT/tests/fixtures/qwen35moe-vision/mmproj-demo-f16.gguf"
"$BIN" serve --host 127.0.0.1 --port "$PORT" --api-key "$KEY" --max-context "$CTX" \
  --mmproj "$MMPROJ" ${SCORIA_AGENT_SERVE_ARGS:-} >"$LOG" 2>&1 &
SERVER_PID=$!
PROXY_PID=""
cleanup() {
  [ -n "$PROXY_PID" ] && kill "$PROXY_PID" 2>/dev/null || true
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  wait 2>/dev/null || true
}
trap cleanup EXIT
deadline=$((SECONDS + ${SCORIA_START_TIMEOUT:-300}))
until curl -sf --max-time 2 "$URL/health" >/dev/null 2>&1; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
    echo "server not ready; log:" >&2; tail -n 30 "$LOG" >&2; exit 1
  fi
  sleep 0.25
done
echo "== scoria serve on $URL (demo model, context $CTX)"

NODE_BIN="$(dirname "$(command -v node)")"
start_proxy() { # dir
  rm -f "$1/record.jsonl" "$1/proxy.port"
  mkdir -p "$1/requests"
  python3 "$ROOT/tests/agents/steer_proxy.py" serve --upstream "$URL" --record "$1/record.jsonl" \
    --tool-file "$1/work/${TOOL_FILE:-hello.txt}" --port-file "$1/proxy.port" --dump-dir "$1/requests" \
    >"$1/proxy.log" 2>&1 &
  PROXY_PID=$!
  for _ in $(seq 1 100); do [ -s "$1/proxy.port" ] && break; sleep 0.05; done
  [ -s "$1/proxy.port" ] || { echo "the proxy did not start" >&2; cat "$1/proxy.log" >&2; exit 1; }
  PROXY_URL="http://127.0.0.1:$(cat "$1/proxy.port")"
}
stop_proxy() { kill "$PROXY_PID" 2>/dev/null || true; wait "$PROXY_PID" 2>/dev/null || true; PROXY_PID=""; }
fresh() { # client -> its directory, with a clean home and a work dir holding hello.txt
  local d="$OUT/$1"     # and screenshot.png
  rm -rf "$d"; mkdir -p "$d/home" "$d/work"
  echo "hello from the scoria agent test" > "$d/work/hello.txt"
  cp "$ROOT/tests/fixtures/qwen35moe-vision/image.png" "$d/work/screenshot.png"
  echo "$d"
}
# Only what the client needs: no proxies or keys from the caller's environment.
client_env=(env -i "PATH=$NODE_BIN:/usr/local/bin:/usr/bin:/bin" "LANG=C.UTF-8" "TERM=dumb")

status=0
report() { # client, dir, rc [extra check flags...]
  local expect=()
  [ "${SCORIA_AGENT_EXPECT_CACHE:-1}" = 1 ] && expect=(--expect-cache)
  expect+=("${@:4}")
  echo "   exit status $3 (output: $2)"
  if [ "$3" != 0 ]; then
    echo "   FAILED: $1 exited with $3; its stderr:"; tail -n 20 "$2/stderr" | sed 's/^/     /'
    status=1
  fi
  if ! python3 "$ROOT/tests/agents/steer_proxy.py" check --record "$2/record.jsonl" \
      --client "$1" --transcript "$2/stdout" "${expect[@]}" | sed 's/^/   /'; then
    status=1
  fi
}

claude_session() { # directory name, prompt, extra check flags...
  D="$(fresh "$1")"
  start_proxy "$D"
  echo "== Claude Code $("$CLAUDE" --version) via $PROXY_URL ($1)"
  args=(-p "$2" --output-format stream-json --verbose --allowedTools Read)
  # The Agent tool keeps the mid-conversation system message (its agent list) in the
  # request; Read is the tool the proxy calls.
  [ "$FULL" = 1 ] || args+=(--tools Agent,Read --system-prompt "You are a coding agent under test. Use your tools.")
  rc=0
  (cd "$D/work" && "${client_env[@]}" HOME="$D/home" \
      ANTHROPIC_BASE_URL="$PROXY_URL" ANTHROPIC_API_KEY="$KEY" \
      CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 DISABLE_TELEMETRY=1 \
      DISABLE_ERROR_REPORTING=1 \
      timeout "$CLIENT_TIMEOUT" "$CLAUDE" "${args[@]}" </dev/null >"$D/stdout" 2>"$D/stderr") || rc=$?
  stop_proxy
  report claude "$D" "$rc" "${@:3}"
}

# The two sessions' first turns, replayed in order to a fresh server: the second must
# reuse the first's cached system prompt and tools (the server drops the billing
# header whose suffix differs between them), with usage as Anthropic defines it.
replay_first_turns() { # dump dirs...
  local port url log pid rc=0 expect=()
  [ "${SCORIA_AGENT_EXPECT_CACHE:-1}" = 1 ] && expect=(--expect-cache)
  port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
  url="http://127.0.0.1:$port"
  log="$OUT/replay-server.log"
  echo "== the sessions' first turns replayed on a fresh server ($url)"
  # shellcheck disable=SC2086 # word splitting of the extra arguments is intended
  "$BIN" serve --host 127.0.0.1 --port "$port" --api-key "$KEY" --max-context "$CTX" \
    ${SCORIA_AGENT_SERVE_ARGS:-} >"$log" 2>&1 &
  pid=$!
  local deadline=$((SECONDS + ${SCORIA_START_TIMEOUT:-300}))
  until curl -sf --max-time 2 "$url/health" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
      echo "   FAILED: the replay server did not start; log:"; tail -n 20 "$log" | sed 's/^/     /'
      status=1; kill "$pid" 2>/dev/null || true; return
    fi
    sleep 0.25
  done
  python3 "$ROOT/tests/agents/steer_proxy.py" replay --upstream "$url" --key "$KEY" \
    "${expect[@]}" "$@" | sed 's/^/   /' || rc=$?
  [ "$rc" = 0 ] || status=1
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

if [ -z "$ONLY" ] || [ "$ONLY" = claude ]; then
  claude_session claude "Read hello.txt and tell me what it says."
  # A second session, as a new user's next `claude` run: another first prompt, so
  # another billing-header suffix (issue 45). Its live first turn must reuse the first
  # session's system prompt and tools (the slot keeps its mark at their end through the
  # first session's follow-up turns); SCORIA_AGENT_EXPECT_SESSION_CACHE=0 only reports it.
  session_check=(--expect-session-cache)
  [ "${SCORIA_AGENT_EXPECT_SESSION_CACHE:-1}" = 0 ] && session_check=(--report-session-cache)
  claude_session claude2 "Read hello.txt and summarize it in five words." "${session_check[@]}"
  replay_first_turns "$OUT/claude/requests" "$OUT/claude2/requests"
  # A screenshot: Read of a PNG comes back as an image block in the tool result, which
  # the server must take (issue 43).
  TOOL_FILE=screenshot.png claude_session claude-image \
    "Read screenshot.png and tell me what you see." --expect-image
fi

if [ -z "$ONLY" ] || [ "$ONLY" = codex ]; then
  D="$(fresh codex)"
  start_proxy "$D"
  echo "== $("$CODEX" --version 2>/dev/null | tail -n 1) via $PROXY_URL"
  echo "You are a coding agent under test. Use your tools." > "$D/instructions.md"
  args=(exec --skip-git-repo-check --sandbox read-only --json -m scoria-demo
        -c model_provider=scoria -c model_providers.scoria.name=scoria
        -c "model_providers.scoria.base_url=$PROXY_URL/v1"
        -c model_providers.scoria.env_key=SCORIA_API_KEY
        -c model_providers.scoria.wire_api=responses
        -c analytics.enabled=false -c check_for_update_on_startup=false)
  [ "$FULL" = 1 ] || args+=(-c "model_instructions_file=$D/instructions.md" -c web_search=disabled
        --disable multi_agent --disable goals --disable skill_search --disable apps
        --disable image_generation)
  args+=("Show me what hello.txt says.")
  rc=0
  (cd "$D/work" && "${client_env[@]}" HOME="$D/home" CODEX_HOME="$D/home" SCORIA_API_KEY="$KEY" \
      timeout "$CLIENT_TIMEOUT" "$CODEX" "${args[@]}" </dev/null >"$D/stdout" 2>"$D/stderr") || rc=$?
  stop_proxy
  report codex "$D" "$rc"
fi

if ! kill -0 "$SERVER_PID" 2>/dev/null; then
  echo "the server died; log tail:" >&2; tail -n 30 "$LOG" >&2; status=1
fi
[ "$status" = 0 ] && echo "== agent clients passed" || echo "== agent clients FAILED (server log: $LOG)"
exit "$status"
