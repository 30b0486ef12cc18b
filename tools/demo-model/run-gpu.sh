#!/usr/bin/env bash
# What the GPU machine runs, from the repository root, with `.demo-data` (gather.py's
# output) and `.whl` (the gguf wheel) carried along. One command, at most 10 minutes:
#
#   bash tools/demo-model/run-gpu.sh first    # train from scratch, export, split
#   bash tools/demo-model/run-gpu.sh resume   # continue from /tmp's checkpoint (same machine,
#                                             # started within 30 s of the first), export, split
#   bash tools/demo-model/run-gpu.sh bench    # 60 s of training, no export: the throughput
#
# BUDGET (seconds of training; default 420 for `first`, 460 for `resume`) is cut further so
# that training ends by START + LIMIT - EXPORT_RESERVE (590 and 110 s by default), whatever
# start-up and tokenizing took; the export needs well under 110 s. Everything that comes back is written under $OUT:
# demo.gguf.part0.. (15 MiB pieces; tools/demo-model/join.sh puts them together),
# demo.gguf.sha256, fixture.tar (the parity fixture and train-log.json) and run.log.
set -euo pipefail
START=$(date +%s)
MODE=${1:-first}
# the command's limit is 600 s; training ends early enough to leave EXPORT_RESERVE for the export
LIMIT=${LIMIT:-590}
EXPORT_RESERVE=${EXPORT_RESERVE:-110}
: "${OUT:?set OUT to the folder whose files come back}"
cd "$(dirname "$0")/../.."
WORK=/tmp/demo-run
CKPT=/tmp/demo-ckpt.pt
LOG=$OUT/run.log
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$WORK" "$OUT"
exec > >(tee -a "$LOG") 2>&1
echo "== $(date -u +%FT%TZ) run-gpu.sh $MODE, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/gguf-*.whl
export PYTHONPATH=/tmp/site
python3 -c 'import torch, transformers, tokenizers, gguf; print("torch", torch.__version__, "transformers", transformers.__version__, "tokenizers", tokenizers.__version__, "gguf ok")'

case "$MODE" in
  first)  BUDGET=${BUDGET:-420}; RESUME=() ;;
  resume) BUDGET=${BUDGET:-460}; RESUME=(--resume "$CKPT")
          [ -f "$CKPT" ] || { echo "no $CKPT: the machine is not the one the first run used"; exit 2; } ;;
  bench)  BUDGET=${BUDGET:-60}; RESUME=() ;;
  *) echo "usage: run-gpu.sh first|resume|bench"; exit 2 ;;
esac

python3 tools/demo-model/train.py --out "$WORK" --time-budget "$BUDGET" --ckpt "$CKPT" \
  --token-cache /tmp/demo-tokens --end-by $((START + LIMIT - EXPORT_RESERVE)) "${RESUME[@]}" ${TRAIN_ARGS:-}
echo "== training done after $(( $(date +%s) - START )) s"
[ "$MODE" = bench ] && exit 0

python3 tools/demo-model/export.py --ckpt "$WORK/final.pt" --out "$WORK/demo.gguf" --quant demo \
  --fixture "$WORK/fixture" --ppl-file README.md --samples
cp "$WORK/train-log.json" "$WORK/fixture/"
tar -C "$WORK" -cf "$OUT/fixture.tar" fixture
(cd "$WORK" && sha256sum demo.gguf) > "$OUT/demo.gguf.sha256"
split -b 15M -d -a 1 "$WORK/demo.gguf" "$OUT/demo.gguf.part"
ls -l "$OUT"
echo "== done $(date -u +%FT%TZ), $(( $(date +%s) - START )) s in all"
