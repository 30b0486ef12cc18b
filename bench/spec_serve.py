#!/usr/bin/env python3
"""Greedy decoding speed and draft acceptance of one running server on fixed prompts.

    bench/spec_serve.py --url http://127.0.0.1:8080 --engine scoria|llama --label L [--tokens 128]

Renders five chat prompts with the server's own /apply-template (scoria and llama-server
both answer it, so both engines get the same prompt text from the same file's template),
sends each raw (scoria: /v1/completions; llama-server: /completion), temperature 0,
ignore_eos, `--tokens` tokens, one warm-up pass then the measured pass, and prints one
JSON line: tokens, the servers' own decode time (`timings.predicted_ms`), t/s, drafted and
accepted tokens (`timings.draft_n`, `draft_n_accepted`), and a digest of the texts (equal
digests: equal texts, e.g. speculation on and off). Standard library only.
"""

import argparse
import hashlib
import json
import sys
import urllib.request

PROMPTS = [
    "Write a Rust function that adds two numbers.",
    "What is a mixture of experts?",
    "Explain how a hash map works.",
    "Write a Python function that reverses a list.",
    "Repeat this code exactly, then add a mul function:\n"
    "fn add(a: i32, b: i32) -> i32 {\n    a + b\n}",
]


def post(url, body):
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def render(url, content):
    return post(url + "/apply-template", {"messages": [{"role": "user", "content": content}]})[
        "prompt"
    ]


def complete(url, engine, prompt, tokens):
    if engine == "scoria":
        r = post(
            url + "/v1/completions",
            {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True},
        )
        text = r["choices"][0]["text"]
    else:
        r = post(
            url + "/completion",
            {
                "prompt": prompt,
                "n_predict": tokens,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
            },
        )
        text = r["content"]
    t = r.get("timings") or {}
    return text, t


def run(url, engine, prompts, tokens):
    out = {"tokens": 0, "predicted_ms": 0.0, "draft_n": 0, "draft_n_accepted": 0}
    texts = []
    for p in prompts:
        text, t = complete(url, engine, p, tokens)
        texts.append(text)
        out["tokens"] += int(t.get("predicted_n", 0))
        out["predicted_ms"] += float(t.get("predicted_ms", 0.0))
        out["draft_n"] += int(t.get("draft_n") or 0)
        out["draft_n_accepted"] += int(t.get("draft_n_accepted") or 0)
    out["texts_sha256"] = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:16]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--engine", choices=["scoria", "llama"], required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    prompts = [render(a.url, p) for p in PROMPTS]
    run(a.url, a.engine, prompts, a.tokens)  # warm-up
    r = run(a.url, a.engine, prompts, a.tokens)
    r["tps"] = round(1000.0 * r["tokens"] / r["predicted_ms"], 1) if r["predicted_ms"] else None
    r["acceptance"] = round(r["draft_n_accepted"] / r["draft_n"], 3) if r["draft_n"] else None
    r["label"] = a.label
    r["engine"] = a.engine
    r["prompts_sha256"] = hashlib.sha256("\x00".join(prompts).encode()).hexdigest()[:16]
    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    sys.exit(main())
