"""The real Qwen3.5 vocabulary, read from the repository's own packed ranks
(`crates/model/assets/qwen35.ranks.gz`, see that folder's NOTICE), in the two forms the
demo model needs:

* a HuggingFace `tokenizers` tokenizer (tokenizer.json) that tokenizes text the way
  Qwen's tiktoken ranks do (the corpus and the chat data are tokenized with it);
* the arrays llama.cpp's converter writes to GGUF (`tokenizer.ggml.tokens`,
  `token_type`, `merges`), exactly as `model::vocab` builds them in Rust.

Merges: tiktoken has ranks, not merges. For every multi-byte token T we run tiktoken's
merge loop (join the leftmost adjacent pair whose concatenation has the lowest rank) on
T's bytes alone; when it ends in T, the last pair it joined is T's merge, at T's rank.
Tokens that the loop never builds get no merge (BPE `ignore_merges` reproduces
tiktoken's whole-pre-token lookup for them). Deriving them takes about a minute in
Python, so `build()` caches the result next to the data (`--cache`).
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RANKS = REPO / "crates" / "model" / "assets" / "qwen35.ranks.gz"

N_RANKS = 248_044
VOCAB_SIZE = 248_320  # rows of token_embd in every Qwen3.5 checkpoint

# Added tokens, in id order from N_RANKS (crates/model/src/vocab.rs, QWEN3_ADDED).
ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>",
    "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
]
# llama.cpp types these USER_DEFINED (HF special: false, not <|...|>-shaped); the other
# added tokens are CONTROL.
USER_DEFINED = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                "<think>", "</think>"}
# HF `special: false` (kept when decoding with skip_special_tokens).
NOT_SPECIAL = USER_DEFINED | {"<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                              "<|repo_name|>", "<|file_sep|>"}

TT_NORMAL, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED = 1, 3, 4, 5

ENDOFTEXT = N_RANKS + ADDED.index("<|endoftext|>")   # 248044
IM_START = N_RANKS + ADDED.index("<|im_start|>")     # 248045
IM_END = N_RANKS + ADDED.index("<|im_end|>")         # 248046

# Qwen3.5's pre-tokenizer regex (letter runs include combining marks).
QWEN35_PAT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def read_ranks(path: Path = RANKS) -> list[bytes]:
    """`ranks[r]` = the bytes of rank r (format: see crates/model/assets/pack_ranks.py)."""
    raw = gzip.decompress(path.read_bytes())
    if raw[:6] != b"SCQV1\0":
        raise SystemExit(f"{path}: not a packed rank file")
    (n,) = struct.unpack_from("<I", raw, 6)
    out, i = [], 10
    for _ in range(n):
        ln = raw[i]
        out.append(raw[i + 1:i + 1 + ln])
        i += 1 + ln
    if n != N_RANKS or i != len(raw):
        raise SystemExit(f"{path}: {n} ranks ({len(raw) - i} bytes left over), expected {N_RANKS}")
    return out


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _merge_loop(rank_of: dict[bytes, int], token: bytes):
    parts = [token[i:i + 1] for i in range(len(token))]
    last = None
    while len(parts) > 1:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = rank_of.get(parts[i] + parts[i + 1])
            if r is not None and (best is None or r < best):
                best, at = r, i
        if at < 0:
            break
        last = (parts[at], parts[at + 1])
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts, last


def derive_merges(ranks: list[bytes]) -> list[tuple[bytes, bytes]]:
    rank_of = {t: r for r, t in enumerate(ranks)}
    merges = []
    for t in ranks:
        if len(t) == 1:
            continue
        parts, last = _merge_loop(rank_of, t)
        if parts == [t]:
            merges.append(last)
    return merges


class Vocab:
    """Everything both forms are made from."""

    def __init__(self, ranks: list[bytes], merges: list[tuple[bytes, bytes]]):
        b2u = bytes_to_unicode()
        enc = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
        self.rank_tokens = [enc(t) for t in ranks]
        self.merges = [f"{enc(a)} {enc(b)}" for a, b in merges]
        self.ignore_merges = len(self.merges) < sum(1 for t in ranks if len(t) > 1)

    # ---- GGUF (llama.cpp converter / model::vocab layout)
    def gguf_tokens(self) -> list[str]:
        toks = self.rank_tokens + ADDED
        toks += [f"[PAD{i}]" for i in range(len(toks), VOCAB_SIZE)]
        return toks

    def gguf_token_types(self) -> list[int]:
        types = [TT_NORMAL] * N_RANKS
        types += [TT_USER_DEFINED if a in USER_DEFINED else TT_CONTROL for a in ADDED]
        types += [TT_UNUSED] * (VOCAB_SIZE - len(types))
        return types

    # ---- HF tokenizers
    def tokenizer_json(self) -> dict:
        added = [{"id": N_RANKS + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": s not in NOT_SPECIAL} for i, s in enumerate(ADDED)]
        bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        return {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN35_PAT}, "behavior": "Isolated", "invert": False},
                dict(bl)]},
            "post_processor": dict(bl), "decoder": dict(bl),
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                      "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": self.ignore_merges,
                      "vocab": {t: r for r, t in enumerate(self.rank_tokens)}, "merges": self.merges},
        }

    def tokenizer(self):
        from tokenizers import Tokenizer
        return Tokenizer.from_str(json.dumps(self.tokenizer_json(), ensure_ascii=False))


def build(cache: Path | None = None) -> Vocab:
    """The vocabulary; merges are read from `cache` (xz JSON) when it exists, else derived
    (and written there)."""
    ranks = read_ranks()
    if cache is not None and cache.exists():
        with lzma.open(cache, "rt", encoding="utf-8") as f:
            d = json.load(f)
        if d.get("n_ranks") != N_RANKS:
            raise SystemExit(f"{cache}: made for {d.get('n_ranks')} ranks, not {N_RANKS}; delete it")
        merges = [(bytes.fromhex(a), bytes.fromhex(b)) for a, b in d["merges"]]
    else:
        merges = derive_merges(ranks)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            with lzma.open(tmp, "wt", encoding="utf-8", preset=6) as f:
                json.dump({"n_ranks": N_RANKS, "merges": [[a.hex(), b.hex()] for a, b in merges]}, f)
            os.replace(tmp, cache)
    return Vocab(ranks, merges)
