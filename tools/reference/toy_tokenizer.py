#!/usr/bin/env python3
"""A tiny byte-level BPE tokenizer for the parity fixtures.

256 byte tokens (GPT-2 byte-to-unicode alphabet, id == byte value), then merges
learnt deterministically from the short text below, then a few Qwen-style
special tokens.  The pre-tokenizer is Qwen's split regex (Qwen2/Qwen3 or the
Qwen3.5 variant) followed by ByteLevel, as in Qwen's own tokenizer.json, so
text splits the way the real tokenizers split it; only the vocabulary is small.

The parity tests feed token ids, not text: this tokenizer exists so that the
GGUF carries a well-formed vocabulary of the right size.

Usage: python toy_tokenizer.py --variant qwen2|qwen35 --vocab-size 320 OUTDIR
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter

QWEN2_PAT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN35_PAT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# (content, special) -- think/tool_call are not "special" in Qwen's own config.
SPECIALS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<tool_call>", False), ("</tool_call>", False), ("<think>", False), ("</think>", False),
]

CORPUS = """\
The engine reads a model from one file, maps its tensors and runs the layers in order.
Each token passes through attention or a linear recurrent layer, then through a mixture
of experts: a router picks a few experts for the token, and a shared expert always runs.
The state of the recurrent layers is small and fixed, so a long prompt costs memory only
in the attention layers. Tests compare the logits of the engine with those of the
reference implementation, position by position, and then the greedy tokens.
def forward(self, tokens): return self.norm(self.layers(self.embed(tokens)))
for i in range(10): print(i * 2 + 1, "the", "and", "expert", "token", "layer")
"""


def bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def learn_merges(pat: str, n_merges: int) -> list[tuple[str, str]]:
    import regex
    b2u = bytes_to_unicode()
    words = Counter("".join(b2u[b] for b in w.encode("utf-8")) for w in regex.findall(pat, CORPUS))
    seqs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: Counter = Counter()
        for w, c in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += c
        if not pairs:
            raise SystemExit("corpus too small for the requested vocabulary")
        # most frequent pair, ties broken by the pair itself: deterministic
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        for w in words:
            s = seqs[w]
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def build(variant: str, vocab_size: int) -> dict[str, object]:
    pat = QWEN2_PAT if variant == "qwen2" else QWEN35_PAT
    b2u = bytes_to_unicode()
    n_merges = vocab_size - 256 - len(SPECIALS)
    merges = learn_merges(pat, n_merges)
    vocab = {b2u[b]: b for b in range(256)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    assert len(vocab) == 256 + n_merges
    added = [
        {"id": len(vocab) + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": sp}
        for i, (s, sp) in enumerate(SPECIALS)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pat}, "behavior": "Isolated", "invert": False},
            dict(byte_level)]},
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }
    tokenizer_config = {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                                  "single_word", "special")} for a in added},
        "bos_token": None, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "errors": "replace",
        "model_max_length": 4096, "split_special_tokens": False,
        # loads tokenizer.json verbatim in transformers 4.x and 5.x
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None,
    }
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": tokenizer_config,
            "vocab.json": vocab, "merges.txt": "#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n"}


def write(variant: str, vocab_size: int, outdir: str) -> dict[str, int]:
    files = build(variant, vocab_size)
    os.makedirs(outdir, exist_ok=True)
    for name, content in files.items():
        with open(os.path.join(outdir, name), "w", encoding="utf-8", newline="\n") as f:
            if isinstance(content, str):
                f.write(content)
            else:
                json.dump(content, f, ensure_ascii=False, indent=None if name == "vocab.json" else 2)
    cfg = files["tokenizer_config.json"]
    ids = {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}  # type: ignore[index]
    return {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
            "first_special_id": min(ids.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=["qwen2", "qwen35"], default="qwen2")
    ap.add_argument("--vocab-size", type=int, default=320)
    ap.add_argument("outdir")
    a = ap.parse_args()
    print(write(a.variant, a.vocab_size, a.outdir))


if __name__ == "__main__":
    main()
