#!/usr/bin/env bash
# The whole test suite, as CI runs it on a fresh machine:
#   1. installs what the server suite needs (Debian chromium and nodejs, the
#      openai/anthropic SDKs and pytest in a Python virtual environment,
#      target/test-venv, playwright-core, the agent clients) — skipped when already
#      present;
#   2. cargo test: kernels against their scalar reference, dequantization against
#      the gguf package's (crates/quant/tests/oracle.rs), GGUF reader/writer,
#      tokenizer and chat templates, parity with transformers for the three
#      archs, the engine's byte-level invariants;
#   3. bench/compare.py on llama-bench- and scoria-shaped files (bench/test_compare.py),
#      and the repository's own checks (scripts/test_*.py: scripts, docs);
#   4. the server driven by the official SDKs, the stats page in headless
#      Chromium, and the real agent clients Claude Code and Codex CLI
#      (scripts/server-tests.sh, which runs scripts/agent-clients.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-test-deps.sh
# The Python packages live in a virtual environment: its python3 first on PATH (the
# dequantization oracle runs `python3` with gguf and numpy).
PATH="$(bash scripts/install-test-deps.sh --print-venv)/bin:$PATH"
export PATH
cargo test --workspace --locked
python3 -B -m unittest discover -s bench -p 'test_*.py'
python3 -B -m unittest discover -s scripts -p 'test_*.py'
# The SDK suite runs on a synthetic random-weight model (--synth): its output never
# closes a think block by itself, so the thinking-budget path is exercised (the trained
# demo model closes its think blocks at once). The agent clients run on the demo model.
bash scripts/server-tests.sh --synth
