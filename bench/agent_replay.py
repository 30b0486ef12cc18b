#!/usr/bin/env python3
"""An agent's coding session replayed against a running server, each turn generated twice:
speculation off and on. Prints how many draft tokens were proposed and kept, the decode
speeds, and whether the two answers are the same bytes (they must be).

    python3 bench/agent_replay.py --url http://127.0.0.1:8080 [--key KEY] \
        [--max-tokens 256] [--json out.json] FILE...

The sessions are recorded from FILE... (small text files, a few KB each, so that a session
fits the demo model's 4,096 positions; by default four of this repository's own): for each
file a session of two turns: the user pastes it and asks for a one-line edit with the whole
file back, then for the first 40 lines of the edited file. The second turn's history holds
the first turn's recorded answer (the edited file, as an agent keeps it), so every prompt
repeats text the model may re-emit: what prompt lookup drafts from.

Each turn is asked with `speculative.n_max` 0 (off) and then with the server's default
draft length (on), greedy; the server must run with speculation (`--spec ngram`, or `auto`
where it picks prompt lookup). Speedup = the turns' decode milliseconds off / on
(`timings.predicted_ms`). Standard library only.
"""

import argparse
import json
import pathlib
import sys
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_FILES = ["bench/ab.sh", "scripts/test.sh", "crates/model/src/moe.rs", "bench/multiturn.py"]


def record(files):
    """One session per file, each a list of turns: (user message, the recorded answer an
    agent keeps in its history)."""
    sessions = []
    for path in files:
        turns = []
        text = pathlib.Path(path).read_text()
        lines = text.splitlines()
        name = pathlib.Path(path).name
        # The edit: a comment line after the first line (the shebang or the first statement).
        mark = "//" if path.endswith(".rs") else "#"
        comment = f"{mark} Reviewed: keep this file's behaviour unchanged."
        edited = "\n".join(lines[:1] + [comment] + lines[1:]) + "\n"
        turns.append((
            f"Here is `{name}`:\n\n```\n{text}```\n\nAdd the line `{comment}` after its first line "
            "and reply with the whole file, nothing else.",
            f"```\n{edited}```",
        ))
        # The second turn: part of the file again (the first 40 lines of the edited file).
        head = "\n".join(edited.splitlines()[:40]) + "\n"
        turns.append((
            f"Now show the first 40 lines of `{name}` as edited, nothing else.",
            f"```\n{head}```",
        ))
        sessions.append(turns)
    return sessions


def ask(url, headers, model, messages, max_tokens, n_max):
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    if n_max is not None:
        body["speculative.n_max"] = n_max
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=3600) as r:
        out = json.load(r)
    t = out.get("timings", {})
    return {
        "content": out["choices"][0]["message"].get("content") or "",
        "tokens": t.get("predicted_n", 0),
        "decode_ms": t.get("predicted_ms", 0.0),
        "drafted": t.get("draft_n") or 0,
        "accepted": t.get("draft_n_accepted") or 0,
        "seconds": time.monotonic() - t0,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--key", default="")
    ap.add_argument("--model", default="scoria")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", help="write the per-turn numbers here")
    ap.add_argument("files", nargs="*", default=[str(REPO / f) for f in DEFAULT_FILES])
    a = ap.parse_args()

    headers = {"Content-Type": "application/json"}
    if a.key:
        headers["Authorization"] = f"Bearer {a.key}"
    system = {"role": "system", "content": "You are a coding agent. Edit files exactly as asked."}
    turns = [(k == 0, user, answer) for session in record(a.files) for k, (user, answer) in enumerate(session)]
    rows, same = [], True
    for i, (first, user, answer) in enumerate(turns, 1):
        if first:
            messages = [system]
        messages.append({"role": "user", "content": user})
        off = ask(a.url, headers, a.model, messages, a.max_tokens, 0)
        on = ask(a.url, headers, a.model, messages, a.max_tokens, None)
        same &= off["content"] == on["content"]
        row = {
            "turn": i,
            "tokens": on["tokens"],
            "off_ms": off["decode_ms"],
            "on_ms": on["decode_ms"],
            "drafted": on["drafted"],
            "accepted": on["accepted"],
            "same_bytes": off["content"] == on["content"],
        }
        rows.append(row)
        rate = 100.0 * row["accepted"] / max(row["drafted"], 1)
        print(f"turn {i:2}: {row['tokens']:4} tokens, off {row['off_ms']:8.1f} ms, on {row['on_ms']:8.1f} ms, "
              f"drafted {row['drafted']:4}, accepted {row['accepted']:4} ({rate:.1f}%), "
              f"{'same bytes' if row['same_bytes'] else 'DIFFERENT BYTES'}", flush=True)
        # The agent keeps its recorded answer, whatever this model said.
        messages.append({"role": "assistant", "content": answer})
    off_ms = sum(r["off_ms"] for r in rows)
    on_ms = sum(r["on_ms"] for r in rows)
    drafted = sum(r["drafted"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    print(f"total: {tokens} tokens over {len(rows)} turns; drafted {drafted}, accepted {accepted} "
          f"({100.0 * accepted / max(drafted, 1):.1f}%); decode {off_ms:.0f} ms off, {on_ms:.0f} ms on: "
          f"{off_ms / max(on_ms, 1e-9):.2f}x; answers {'identical' if same else 'DIFFER'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
