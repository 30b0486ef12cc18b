#!/usr/bin/env python3
"""A scripted multi-turn agent conversation against a running server: how many prompt
tokens each turn re-reads.

    python3 bench/multiturn.py --url http://127.0.0.1:8080 [--key KEY] [--turns 10] \
        [--words 1500] [--max-tokens 64] [--json out.json]

Each turn appends a user message of about --words words (~2k tokens) to the
conversation, asks with reasoning on (greedy), and appends the assistant's answer as a
client does: its content only, the reasoning dropped. Prints, per turn, the prompt's
length, the tokens the server evaluated (`timings.prompt_n`) and those it reused
(`timings.cache_n`). With a prompt cache that serves chat turns, each turn evaluates
about its new message plus the previous answer; without one, the whole conversation.
Standard library only.
"""

import argparse
import json
import random
import sys
import time
import urllib.request


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--key", default="")
    ap.add_argument("--model", default="scoria")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--words", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the per-turn numbers here")
    a = ap.parse_args()

    rng = random.Random(a.seed)
    vocab = "the of and to in is that for it as with was on be by this are from at or an have not but".split()
    vocab += [f"item{i}" for i in range(200)]
    messages = [{"role": "system", "content": "You are a coding agent. Read each file and reply briefly."}]
    rows = []
    headers = {"Content-Type": "application/json"}
    if a.key:
        headers["Authorization"] = f"Bearer {a.key}"
    for turn in range(1, a.turns + 1):
        text = " ".join(rng.choice(vocab) for _ in range(a.words))
        messages.append({"role": "user", "content": f"Turn {turn}. File contents:\n{text}"})
        body = {
            "model": a.model,
            "messages": messages,
            "max_tokens": a.max_tokens,
            "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": True},
        }
        req = urllib.request.Request(a.url + "/v1/chat/completions", json.dumps(body).encode(), headers)
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.load(r)
        secs = time.monotonic() - t0
        t = out.get("timings", {})
        row = {
            "turn": turn,
            "prompt_tokens": out["usage"]["prompt_tokens"],
            "evaluated": t.get("prompt_n"),
            "reused": t.get("cache_n"),
            "seconds": round(secs, 2),
        }
        rows.append(row)
        print(f"turn {turn:2}: prompt {row['prompt_tokens']:6} tokens, evaluated {row['evaluated']:6}, "
              f"reused {row['reused']:6}, {secs:.1f} s", flush=True)
        # The client sends back the answer, not the reasoning.
        messages.append({"role": "assistant", "content": out["choices"][0]["message"].get("content") or ""})
    total_eval = sum(r["evaluated"] or 0 for r in rows)
    total_prompt = sum(r["prompt_tokens"] for r in rows)
    print(f"total: {total_prompt} prompt tokens over {len(rows)} turns, {total_eval} evaluated "
          f"({100.0 * total_eval / max(total_prompt, 1):.1f}%)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
