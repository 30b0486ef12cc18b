#!/usr/bin/env bash
# Put the GGUF pieces that run-gpu.sh wrote under $OUT back together and check them.
#   tools/demo-model/join.sh DIR [OUTPUT.gguf]
# DIR holds demo.gguf.part0.. and demo.gguf.sha256; OUTPUT defaults to DIR/demo.gguf.
# fixture.tar, when there, is unpacked next to OUTPUT.
set -euo pipefail
dir=${1:?usage: join.sh DIR [OUTPUT.gguf]}
out=${2:-$dir/demo.gguf}
mkdir -p "$(dirname "$out")"
parts=$(ls "$dir"/demo.gguf.part* | sort -V)
cat $parts > "$out.tmp"
want=$(awk '{print $1}' "$dir/demo.gguf.sha256")
got=$(sha256sum "$out.tmp" | awk '{print $1}')
if [ "$want" != "$got" ]; then
  echo "join.sh: sha256 $got, expected $want: a piece is missing or damaged" >&2
  rm -f "$out.tmp"
  exit 1
fi
mv "$out.tmp" "$out"
echo "$out: $(stat -c %s "$out") bytes, sha256 $got"
if [ -f "$dir/fixture.tar" ]; then
  tar -C "$(dirname "$out")" -xf "$dir/fixture.tar"
  echo "fixture: $(dirname "$out")/fixture"
fi
