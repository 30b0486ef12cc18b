#!/usr/bin/env python3
"""Time to first token of an image chat request against a running server.

    python3 bench/image_ttft.py [--url http://127.0.0.1:8080] [--sizes 512,1024] [--runs 2]

For each size, sends OpenAI chat requests (streamed, max_tokens 1) holding one PNG of
that many pixels a side as a data URL and the words "Describe this image.", each image
fresh random pixels (so neither the prompt cache nor a slot holds it), and prints the
seconds from sending the request to the first streamed token, and the same for the
text alone. Standard library only (the PNG is written here).
"""

import argparse
import base64
import json
import random
import struct
import time
import urllib.request
import zlib


def png(side: int, seed: int) -> bytes:
    rng = random.Random(seed)
    row = side * 3
    raw = b"".join(b"\x00" + rng.randbytes(row) for _ in range(side))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    head = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b"")


def ttft(url: str, content) -> float:
    body = json.dumps({
        "model": "x",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
    }).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: ") and b"[DONE]" not in line:
                d = json.loads(line[6:])
                ch = d.get("choices") or [{}]
                if ch[0].get("delta", {}).get("content") or ch[0].get("finish_reason"):
                    return time.perf_counter() - t
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--sizes", default="512,1024")
    ap.add_argument("--runs", type=int, default=2)
    a = ap.parse_args()
    text = "Describe this image."
    ttft(a.url, text)  # warm-up
    print(f"text only: {min(ttft(a.url, text) for _ in range(a.runs)):.3f} s")
    seed = 1
    for side in [int(s) for s in a.sizes.split(",")]:
        times = []
        for _ in range(a.runs):
            url = "data:image/png;base64," + base64.b64encode(png(side, seed)).decode()
            seed += 1
            times.append(ttft(a.url, [{"type": "image_url", "image_url": {"url": url}},
                                      {"type": "text", "text": text}]))
        print(f"{side}x{side}: " + ", ".join(f"{t:.3f}" for t in times) + " s to the first token")


if __name__ == "__main__":
    main()
