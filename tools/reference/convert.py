#!/usr/bin/env python3
"""Run llama.cpp's convert_hf_to_gguf.py with its pre-tokenizer detection bypassed.

The converter identifies a BPE tokenizer by hashing how it splits a test string;
the fixtures' toy tokenizer (toy_tokenizer.py) is unknown to it.  This wrapper
imports the converter from .llamacpp/ (see README.md: it is never committed),
makes get_vocab_base_pre() answer the name given by --pre, and then runs the
converter's own main() with the remaining arguments.

Usage: python convert.py --pre qwen2|qwen35 [--llamacpp DIR] -- CONVERTER ARGS...
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pre", required=True, help="tokenizer.ggml.pre to write (qwen2, qwen35)")
    ap.add_argument("--llamacpp", default=str(Path(__file__).resolve().parents[2] / ".llamacpp"))
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest

    root = Path(a.llamacpp)
    if not (root / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{root}/convert_hf_to_gguf.py not found: see tools/reference/README.md")
    os.environ.pop("NO_LOCAL_GGUF", None)
    sys.path.insert(0, str(root / "gguf-py"))
    sys.path.insert(0, str(root))

    import conversion.base as base  # noqa: E402

    patched = 0
    for obj in vars(base).values():
        if isinstance(obj, type) and "get_vocab_base_pre" in vars(obj):
            setattr(obj, "get_vocab_base_pre", lambda self, tokenizer, _pre=a.pre: _pre)
            patched += 1
    if not patched:
        raise SystemExit("get_vocab_base_pre not found in conversion.base")

    import importlib.util
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", root / "convert_hf_to_gguf.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.argv = ["convert_hf_to_gguf.py", *rest]
    mod.main()


if __name__ == "__main__":
    main()
