#!/usr/bin/env bash
# Installs the CUDA 13.0 compiler (nvcc) that `--features cuda` builds the kernels with,
# from NVIDIA's Python wheels, into one fixed prefix (no root, no system CUDA needed):
#
#   bash scripts/install-cuda-toolchain.sh          # prints NVCC=<path>
#   export NVCC=$(bash scripts/install-cuda-toolchain.sh --print-path)
#
# Why 13.0 and not newer: the GPU machine's driver is 580 (CUDA 13.0); a cubin or PTX made
# by a newer nvcc does not load there.
#
# The wheels install into $PREFIX/nvidia/cu13 (bin/nvcc, nvvm/bin/cicc, nvvm/libdevice,
# include/ with the crt headers and include/cccl). That tree is laid out as a CUDA toolkit
# and nvcc finds its parts through its own bin/nvcc.profile, so `$PREFIX/bin/nvcc` is a
# small wrapper that runs it from there. Host compilation needs a C++ compiler (g++).
#
# Idempotent: when the prefix already holds this exact set of packages and nvcc runs,
# it only prints the path. SCORIA_CUDA_PREFIX overrides the prefix.
set -euo pipefail

PREFIX="${SCORIA_CUDA_PREFIX:-$HOME/.cache/scoria/cuda-13.0}"
PACKAGES=(
  "nvidia-cuda-nvcc==13.0.*"
  "nvidia-cuda-runtime==13.0.*"
  "nvidia-cuda-crt==13.0.*"
  "nvidia-cuda-cccl==13.0.*"
  "nvidia-nvvm==13.0.*"
)
STAMP="$PREFIX/.installed"
WANT="${PACKAGES[*]}"
NVCC="$PREFIX/bin/nvcc"

print_only=0
if [ "${1:-}" = "--print-path" ]; then print_only=1; fi

say() { if [ "$print_only" -eq 0 ]; then echo "$@"; else echo "$@" >&2; fi; }

ready() {
  [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$NVCC" ] \
    && "$NVCC" --version >/dev/null 2>&1
}

if ! ready; then
  command -v python3 >/dev/null 2>&1 || { echo "install-cuda-toolchain: python3 is needed (pip installs the nvcc wheels)" >&2; exit 1; }
  command -v g++ >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1 \
    || { echo "install-cuda-toolchain: nvcc needs a host C++ compiler: install g++" >&2; exit 1; }
  say "== installing nvcc 13.0 into $PREFIX"
  rm -rf "$PREFIX"
  mkdir -p "$PREFIX/bin"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-warn-script-location \
    --target "$PREFIX" "${PACKAGES[@]}" >&2
  TOOLKIT="$PREFIX/nvidia/cu13"
  for f in bin/nvcc bin/nvcc.profile bin/ptxas bin/fatbinary nvvm/bin/cicc nvvm/libdevice include/cuda_runtime.h include/crt/host_config.h; do
    [ -e "$TOOLKIT/$f" ] || { echo "install-cuda-toolchain: the wheels did not provide $TOOLKIT/$f" >&2; exit 1; }
  done
  # pip may drop the executable bits of files that are not console scripts.
  chmod +x "$TOOLKIT"/bin/* "$TOOLKIT"/nvvm/bin/* 2>/dev/null || true
  cat >"$NVCC" <<EOF
#!/usr/bin/env bash
# Runs the pip-installed nvcc from its own directory so that its nvcc.profile finds
# cicc, libdevice and the headers (written by scripts/install-cuda-toolchain.sh).
exec "$TOOLKIT/bin/nvcc" "\$@"
EOF
  chmod +x "$NVCC"
  # A kernel through the whole pipeline (cicc, ptxas, fatbinary) proves the install.
  probe="$(mktemp -d)"
  trap 'rm -rf "$probe"' EXIT
  printf '%s\n' '#include <cuda_fp16.h>' \
    'extern "C" __global__ void probe(float* x, const __half* h) { x[threadIdx.x] += __half2float(h[threadIdx.x]); }' \
    >"$probe/probe.cu"
  "$NVCC" -fatbin -gencode arch=compute_90,code=sm_90 -o "$probe/probe.fatbin" "$probe/probe.cu" >&2 \
    || { echo "install-cuda-toolchain: nvcc is installed but cannot compile a kernel (see above)" >&2; exit 1; }
  echo "$WANT" >"$STAMP"
fi

if [ "$print_only" -eq 1 ]; then
  echo "$NVCC"
else
  "$NVCC" --version | tail -n 2
  echo "NVCC=$NVCC"
  echo "(export NVCC=$NVCC, or let crates/cuda/build.rs find it in this prefix)"
fi
