#!/usr/bin/env bash
# The GPU test suite in two halves, because the GPU machine has no cargo:
#
#   scripts/gpu-tests.sh build [DIR]   (here) builds the test executables that use
#                                      the GPU and the release `scoria` binary into
#                                      DIR (default .carry/gpu, ignored by git) and
#                                      packs them as DIR.tar.xz (what to carry: the
#                                      machine takes a limited working tree: every
#                                      executable embeds the same kernels, so one xz
#                                      stream whose dictionary spans several of them
#                                      packs 270 MB into ~15 MB, where -T0's
#                                      independent blocks left 70 MB)
#   scripts/gpu-tests.sh run [DIR]     (on the GPU machine, from the repository
#                                      root) unpacks DIR.tar.xz when DIR is absent,
#                                      runs every test executable in DIR against the
#                                      GPU and prints one closing line
#                                      `N passed, N failed`
#
# The tests are ordinary test targets built with `--features cuda`: the kernel
# tests of crates/cuda (every kernel against the CPU reference, bit for bit where
# docs/design.md requires it) and the engine's parity and invariant tests run with
# SCORIA_TEST_DEVICE=cuda, and the GPU's faults (engine's tests/faults_gpu.rs: VRAM
# taken by another process, a real sticky error). SCORIA_REQUIRE_GPU=1 makes a missing
# GPU a failure.
# The kernels are built for sm_90 only (the GPU machine's H200; every executable
# embeds them, and the archive must stay small) unless SCORIA_CUDA_ARCHS says otherwise.
# The other test targets run on the CPU alone and are left to the ordinary test run.
GPU_TARGETS="cuda-gpu_kernels engine-gpu engine-invariants engine-parity engine-batch engine-sched engine-spec engine-vision engine-faults_gpu engine-nvfp4_scales"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Where cargo puts what it builds: `target/` unless CARGO_TARGET_DIR or a cargo config
# says otherwise, so ask cargo rather than assume.
cargo_target_dir() {
  (cd "$ROOT" && cargo metadata --format-version 1 --no-deps) |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])'
}
MODE="${1:-}"
DIR="${2:-$ROOT/.carry/gpu}"

case "$MODE" in
build)
  if [ -z "${NVCC:-}" ] && ! command -v nvcc >/dev/null 2>&1; then
    NVCC="$(bash "$ROOT/scripts/install-cuda-toolchain.sh" --print-path)"
    export NVCC
  fi
  export SCORIA_CUDA_ARCHS="${SCORIA_CUDA_ARCHS:-90}"
  mkdir -p "$DIR"
  rm -f "$DIR"/test-*
  cd "$ROOT"
  cargo build --release --features cuda -p scoria-cli
  cp "$(cargo_target_dir)/release/scoria" "$DIR/scoria"
  # Test executables: one per test target; names come from cargo's JSON messages.
  cargo test --release --features cuda -p scoria-cuda -p scoria-engine --no-run
  cargo test --release --features cuda -p scoria-cuda -p scoria-engine --no-run \
    --message-format=json 2>/dev/null |
    python3 -c '
import json, sys, shutil, os
d = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        pkg = m["package_id"].split("#")[-1].split("@")[0]
        target = pkg.removeprefix("scoria-") + "-" + m["target"]["name"]
        if target in sys.argv[2].split():
            shutil.copy(m["executable"], os.path.join(d, "test-" + target))
            print("built", "test-" + target)
' "$DIR" "$GPU_TARGETS"
  strip "$DIR"/scoria "$DIR"/test-*
  tar -C "$(dirname "$DIR")" -cf - "$(basename "$DIR")" | xz -T1 --lzma2=preset=6,dict=192MiB >"$DIR.tar.xz"
  du -sh "$DIR" "$DIR.tar.xz"
  ;;
run)
  cd "$ROOT"
  if [ ! -d "$DIR" ] && [ -f "$DIR.tar.xz" ]; then
    tar -C "$(dirname "$DIR")" -xJf "$DIR.tar.xz"
  fi
  export SCORIA_REQUIRE_GPU=1 SCORIA_TEST_DEVICE="${SCORIA_TEST_DEVICE:-cuda}" SCORIA_REPO_ROOT="$ROOT"
  pass=0; fail=0; status=0
  for t in "$DIR"/test-*; do
    echo "== $(basename "$t")"
    log="$(mktemp)"
    if ! "$t" --test-threads=1 2>&1 | tee "$log"; then status=1; fi
    p=$(grep -Eo 'test result: [a-zA-Z]+\. [0-9]+ passed; [0-9]+ failed' "$log" | awk '{s+=$4} END {print s+0}')
    f=$(grep -Eo 'test result: [a-zA-Z]+\. [0-9]+ passed; [0-9]+ failed' "$log" | awk '{s+=$6} END {print s+0}')
    pass=$((pass + p)); fail=$((fail + f))
    rm -f "$log"
  done
  echo "$pass passed, $fail failed"
  exit $status
  ;;
*)
  sed -n '2,17p' "$0"; exit 2 ;;
esac
