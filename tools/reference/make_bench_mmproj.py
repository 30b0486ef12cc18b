#!/usr/bin/env python3
"""A random vision encoder at Qwen3.5/3.6-35B-A3B's real geometry, as an mmproj GGUF.

For timing the image encoder (scoria's and llama.cpp's `mtmd`) without downloading a
checkpoint: transformers' `Qwen3_5MoeForConditionalGeneration` vision tower at the
published geometry (27 blocks of width 1152, MLP 4304, 16 heads, patch 16, merge 2, a
48×48 learned position grid, rows of 2048 for the text model), random weights, converted
by llama.cpp's converter (`--mmproj`, F16 by default). The text half is a one-layer stub the
converter skips. Needs what make_vision_fixture.py needs.

Usage: python tools/reference/make_bench_mmproj.py -o /tmp/mmproj-q35-f16.gguf [--outtype f16]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import make_vision_fixture as vf  # noqa: E402
import toy_tokenizer  # noqa: E402

GEOMETRY = dict(
    depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304, num_heads=16,
    in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=2048,
    num_position_embeddings=2304, initializer_range=0.02,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--outtype", default="f16")
    ap.add_argument("--workdir", default="/tmp/scoria-reference/bench-mmproj")
    ap.add_argument("--llamacpp", default=str(REPO / ".llamacpp"))
    a = ap.parse_args()
    import transformers

    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tok = work / "tokenizer"
    toy_tokenizer.write("qwen35", 320, str(tok))
    text = dict(vocab_size=320, hidden_size=2048, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=64, layer_types=["full_attention"],
                moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=2,
                num_experts_per_tok=1, rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=GEOMETRY, image_token_id=300,
                                        video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)
    cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    torch.manual_seed(1)
    model = transformers.Qwen3_5MoeForConditionalGeneration._from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        vf.perturb_vision(model.model.visual, torch.Generator().manual_seed(1))
    hf = work / "hf"
    model.save_pretrained(hf, safe_serialization=True)
    for f in tok.iterdir():
        shutil.copy(f, hf / f.name)
    proc = vf.processor()
    proc.save_pretrained(hf)
    vf.convert_mmproj(hf, a.outtype, Path(a.output), a.llamacpp)
    vf.log(f"wrote {a.output}")


if __name__ == "__main__":
    main()
