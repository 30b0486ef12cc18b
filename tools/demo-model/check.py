#!/usr/bin/env python3
"""Compare scoria's logits for the fixture's token ids with transformers' (export.py --fixture).

Runs `scoria run -m GGUF --prompt-ids ... --dump-logits` twice: over `sequence_ids` in one
pass (against full_logits.npy) and over `prompt_ids` with greedy generation (the generated
tokens against `greedy_ids`, the decode rows against logits.npy). Prints, per comparison, the
largest error relative to the row's largest |reference logit| over the stored columns, the
largest log-sum-exp difference over the whole vocabulary, and argmax agreement; exits 1 when
`--tol` is exceeded.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def run(scoria: str, gguf: str, ids: list[int], n: int, threads: int) -> tuple[np.ndarray, list[int]]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "logits.npy"
        cmd = [scoria, "run", "-m", gguf, "--prompt-ids", ",".join(map(str, ids)), "-n", str(n),
               "--dump-logits", str(out), "--print-ids", "--temp", "0", "--ignore-eos", "--device", "cpu"]
        if threads:
            cmd += ["-t", str(threads)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"scoria failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        logits = np.load(out)
    gen: list[int] = []
    for line in (r.stdout + "\n" + r.stderr).splitlines():
        s = line.strip().strip("[]")
        if s and all(p.strip().isdigit() for p in s.replace(",", " ").split()) and len(s.split(",")) >= min(n, 2):
            gen = [int(p) for p in s.replace(",", " ").split()]
    return logits, gen


def compare(name: str, ours: np.ndarray, ref: np.ndarray, cols: np.ndarray, lse: np.ndarray | None) -> dict:
    sub = ours[:, cols]
    scale = np.maximum(np.abs(ref).max(1), 1e-6)
    rel = np.abs(sub - ref).max(1) / scale
    res = {"rows": int(ref.shape[0]), "max_rel": float(rel.max()), "median_rel": float(np.median(rel)),
           "worst_row": int(rel.argmax()),
           "argmax_agree": int((sub.argmax(1) == ref.argmax(1)).sum())}
    if lse is not None:
        m = ours.max(1, keepdims=True)
        ours_lse = (m[:, 0] + np.log(np.exp(ours - m).sum(1)))
        res["max_abs_logsumexp_diff"] = float(np.abs(ours_lse - lse).max())
    print(f"{name}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--scoria", default="target/release/scoria")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest relative error accepted")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    fx = Path(args.fixture)
    ref = json.loads((fx / "reference.json").read_text())
    cols = np.asarray(ref["logit_columns"])
    full = np.load(fx / "full_logits.npy")
    stepped = np.load(fx / "logits.npy")
    seq, prompt, greedy = ref["sequence_ids"], ref["prompt_ids"], ref["greedy_ids"]

    ours, _ = run(args.scoria, args.gguf, seq, 1, args.threads)
    one = compare("one pass over sequence_ids vs full_logits", ours[:len(seq)], full, cols,
                  np.asarray(ref["logsumexp"]))
    ours2, gen = run(args.scoria, args.gguf, prompt, len(greedy), args.threads)
    n = len(prompt) + len(greedy) - 1
    dec = compare("prompt + greedy decode vs logits", ours2[:n], stepped[:n], cols, None)
    ours_greedy = [int(x) for x in ours2[len(prompt) - 1:n].argmax(1)]
    same = sum(a == b for a, b in zip(ours_greedy, greedy))
    print(f"greedy tokens (argmax of scoria's rows): {same}/{len(greedy)} equal to transformers'"
          + (f"; scoria printed {gen[:8]}..." if gen else ""))
    ok = one["max_rel"] <= args.tol and dec["max_rel"] <= args.tol
    print("PASS" if ok else f"FAIL (tolerance {args.tol})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
