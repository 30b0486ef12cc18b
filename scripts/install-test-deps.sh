#!/usr/bin/env bash
# Installs what the server test suite needs on a fresh Debian machine:
#   - Debian's Chromium (the browser check drives /usr/bin/chromium; no browser download),
#   - Debian's nodejs and npm, when `node` is missing,
#   - into a Python virtual environment, target/test-venv (SCORIA_TEST_VENV; the system
#     Python is left alone): the packages in tests/server/requirements.txt (openai,
#     anthropic, pydantic, pytest, requests: the server suite) and
#     crates/quant/tests/requirements.txt (gguf and numpy, pinned: the dequantization
#     oracle of crates/quant/tests/oracle.rs). scripts/test.sh and
#     scripts/server-tests.sh use it; by hand: `. target/test-venv/bin/activate`;
#   - playwright-core from npm, under target/server-tests/node (outside the source tree),
#   - the agent clients Claude Code and Codex CLI from npm at pinned versions, under
#     target/agent-clients (scripts/agent-clients.sh --install-only).
# Safe to run twice; each step is skipped when already satisfied.
#
#   scripts/install-test-deps.sh [--print-venv]   (--print-venv: print the venv's path, install nothing)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NODE_DIR="${SCORIA_TEST_NODE_DIR:-$ROOT/target/server-tests/node}"
VENV="${SCORIA_TEST_VENV:-$ROOT/target/test-venv}"
if [ "${1:-}" = "--print-venv" ]; then echo "$VENV"; exit 0; fi

SUDO=""
if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi

if ! command -v chromium >/dev/null 2>&1; then
  echo "== installing chromium (Debian package)"
  timeout 600 $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive timeout 900 $SUDO apt-get install -y -qq chromium fonts-dejavu-core
fi
chromium --version || true

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "== installing nodejs and npm (Debian packages)"
  timeout 600 $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive timeout 900 $SUDO apt-get install -y -qq nodejs npm
fi
node --version

if [ ! -x "$VENV/bin/python" ]; then
  echo "== python virtual environment at $VENV"
  if ! python3 -m venv "$VENV" 2>/dev/null; then
    # Debian's python3 keeps venv in a package of its own.
    rm -rf "$VENV"
    timeout 600 $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive timeout 900 $SUDO apt-get install -y -qq python3-venv
    python3 -m venv "$VENV"
  fi
fi
echo "== python packages into $VENV: $(grep -hv '^#' "$ROOT/tests/server/requirements.txt" \
  "$ROOT/crates/quant/tests/requirements.txt" | grep -v '^$' | tr '\n' ' ')"
timeout 600 "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  -r "$ROOT/tests/server/requirements.txt" -r "$ROOT/crates/quant/tests/requirements.txt"

if [ ! -d "$NODE_DIR/node_modules/playwright-core" ]; then
  echo "== playwright-core (npm) into $NODE_DIR"
  mkdir -p "$NODE_DIR"
  [ -f "$NODE_DIR/package.json" ] || echo '{"name":"scoria-server-tests","private":true}' > "$NODE_DIR/package.json"
  # playwright-core never downloads a browser; the check uses Debian's chromium.
  PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 timeout 600 npm install --prefix "$NODE_DIR" --no-audit --no-fund --silent playwright-core@1
fi
echo "== agent clients (npm)"
"$ROOT/scripts/agent-clients.sh" --install-only
echo "test dependencies ready"
