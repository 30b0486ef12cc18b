#!/usr/bin/env python3
"""Build the vision parity fixture under tests/fixtures/qwen35moe-vision/.

1. builds a tiny float32 transformers `Qwen3_5MoeForConditionalGeneration` (the text
   model of the qwen35moe fixture's geometry plus a 2-block ViT), random weights from a
   fixed seed, every norm and bias perturbed so each code path matters;
2. makes two images (`image.png`, 128x96, already on the 32-pixel grid; `odd.png`,
   150x101, which the processor resizes) and runs transformers' PIL image processor
   on both (`pixel_values*.npy`, `grid*.json` in reference.json);
3. records the reference: the merged image embedding (`image_embeds.npy`), the logits
   of one teacher-forced forward over a prompt holding the image and the greedy
   continuation (`full_logits.npy`), and the greedy tokens;
4. converts the checkpoint with llama.cpp's converter twice: the text model
   (`model-f32.gguf`, `--no-mtp`) and the vision encoder (`mmproj-f32.gguf`,
   `mmproj-f16.gguf`, `--mmproj`);
5. writes reference.json.

Needs what make_fixtures.py needs (torch, transformers 5.x, the converter in
.llamacpp/) plus pillow. Runs on a CPU in well under a minute.

Usage: python tools/reference/make_vision_fixture.py
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import make_fixtures as mf  # noqa: E402
import toy_tokenizer  # noqa: E402

SEED = 4242
N_GEN = 12
# Token ids the HF model treats as the image placeholder and its brackets. The toy
# vocabulary has no vision tokens; the parity test feeds ids, and scoria takes an
# image's rows from the request, not from the token's id.
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 300, 301, 302, 303
VISION = dict(
    depth=2, hidden_size=64, hidden_act="gelu_pytorch_tanh", intermediate_size=128, num_heads=4,
    in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
    num_position_embeddings=36, initializer_range=0.05,
)
PROCESSOR = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
                 image_std=[0.5, 0.5, 0.5], size={"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64})


def make_image(w: int, h: int, seed: int):
    from PIL import Image, ImageDraw
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 7) % 256], -1)
    a = (a + rng.integers(0, 40, size=a.shape)).clip(0, 255).astype(np.uint8)
    img = Image.fromarray(a, "RGB")
    d = ImageDraw.Draw(img)
    d.ellipse([w // 5, h // 5, w // 2, h // 2], fill=(250, 30, 30))
    d.rectangle([w // 2, h // 2, w - 10, h - 8], fill=(20, 40, 230))
    return img


def perturb_vision(model, g: torch.Generator) -> int:
    n = 0
    for name, p in model.named_parameters():
        if p.ndim == 1 and "norm" in name and name.endswith("weight"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + 1.0)
        elif p.ndim == 1:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        elif "pos_embed" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        elif "patch_embed" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.04)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.12)
        n += 1
    return n


def processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(**PROCESSOR)


@torch.no_grad()
def forward(model, ids: list[int], pv, grid):
    t = torch.tensor([ids], dtype=torch.long)
    mm = (t == IMAGE_TOKEN).int()
    out = model(input_ids=t, pixel_values=pv, image_grid_thw=grid, mm_token_type_ids=mm, use_cache=False)
    return out.logits[0].float().numpy()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/scoria-reference/qwen35moe-vision")
    ap.add_argument("--llamacpp", default=str(REPO / ".llamacpp"))
    args = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("highest")
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(args.llamacpp) / "gguf-py"))
    import gguf as gguf_mod  # noqa: F401  (the converter's copy, as make_fixtures uses)
    import transformers

    work, out = Path(args.workdir), REPO / "tests" / "fixtures" / "qwen35moe-vision"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = work / "tokenizer"
    tok_ids = toy_tokenizer.write("qwen35", mf.VOCAB, str(tok_dir))

    text = mf.make_config("qwen35moe", tok_ids).to_dict()
    config = transformers.Qwen3_5MoeConfig(
        text_config=text, vision_config=VISION, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, tie_word_embeddings=False)
    config.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    torch.manual_seed(SEED)
    model = transformers.Qwen3_5MoeForConditionalGeneration._from_config(
        config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        text_part = torch.nn.ModuleDict({"language_model": model.model.language_model, "lm_head": model.lm_head})
        kinds = mf.perturb(text_part, "qwen35moe", SEED)
        kinds["vision"] = perturb_vision(model.model.visual, g)
    log(f"parameters perturbed: {kinds}")

    proc = processor()
    images = {"image": make_image(128, 96, 1), "odd": make_image(150, 101, 2)}
    pixels, grids = {}, {}
    for name, img in images.items():
        img.save(out / f"{name}.png")
        feat = proc(images=[img], return_tensors="pt")
        pixels[name], grids[name] = feat["pixel_values"], feat["image_grid_thw"]
        np.save(out / f"pixel_values_{name}.npy", pixels[name].numpy().astype(np.float32))
        log(f"{name}: {img.size} -> grid {grids[name].tolist()}, pixel_values {tuple(pixels[name].shape)}")

    pv, grid = pixels["image"], grids["image"]
    with torch.no_grad():
        feats = model.model.get_image_features(pv, grid).pooler_output[0]
    np.save(out / "image_embeds.npy", feats.float().numpy())
    n_img = int(feats.shape[0])

    rng = np.random.default_rng(77)
    before = rng.integers(0, 256, size=9).tolist()
    after = rng.integers(0, 256, size=7).tolist()
    prompt = before + [VISION_START] + [IMAGE_TOKEN] * n_img + [VISION_END] + after
    seq = list(prompt)
    gen = []
    for _ in range(N_GEN):
        logits = forward(model, seq, pv, grid)
        nxt = int(np.argmax(logits[-1]))
        gen.append(nxt)
        seq.append(nxt)
    full = forward(model, seq, pv, grid)
    assert [int(np.argmax(full[len(prompt) - 1 + j])) for j in range(N_GEN)] == gen
    np.save(out / "full_logits.npy", full.astype(np.float32))
    m = mf.margins(full[len(prompt) - 1:])
    log(f"prompt {len(prompt)} tokens ({n_img} image rows), generated {gen}, min margin {m.min():.4g}")
    with torch.no_grad():
        pos, delta = model.model.get_rope_index(
            torch.tensor([seq]), (torch.tensor([seq]) == IMAGE_TOKEN).int(), image_grid_thw=grid)

    hf = work / "hf"
    model.save_pretrained(hf, safe_serialization=True)
    for f in tok_dir.iterdir():
        shutil.copy(f, hf / f.name)
    proc.save_pretrained(hf)
    mf.convert("qwen35moe", hf, "f32", out / "model-f32.gguf", Path(args.llamacpp))
    for outtype in ("f32", "f16"):
        convert_mmproj(hf, outtype, out / f"mmproj-{outtype}.gguf", args.llamacpp)

    # An encoder for the demo model (models/demo.gguf, hidden 128, the real Qwen3.5
    # vocabulary with its vision tokens): random weights, so the server's image path runs
    # end to end on the demo model; it sees nothing.
    demo_cfg = transformers.Qwen3_5MoeConfig(
        text_config=text | {"hidden_size": 128}, vision_config=VISION | {"out_hidden_size": 128},
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False)
    demo_cfg.architectures = ["Qwen3_5MoeForConditionalGeneration"]
    torch.manual_seed(SEED + 1)
    demo = transformers.Qwen3_5MoeForConditionalGeneration._from_config(
        demo_cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        perturb_vision(demo.model.visual, torch.Generator().manual_seed(SEED + 1))
    demo_hf = work / "hf_demo"
    demo.save_pretrained(demo_hf, safe_serialization=True)
    for f in tok_dir.iterdir():
        shutil.copy(f, demo_hf / f.name)
    proc.save_pretrained(demo_hf)
    convert_mmproj(demo_hf, "f16", out / "mmproj-demo-f16.gguf", args.llamacpp)
    (out / "tensors.txt").write_text("\n".join(
        mf.describe_gguf(out / "mmproj-f32.gguf", gguf_mod)) + "\n")

    commit_file = Path(args.llamacpp) / "COMMIT"
    ref = {
        "what": "tiny random Qwen3_5MoeForConditionalGeneration: image embedding and logits with one image",
        "seed": SEED,
        "prompt": prompt,
        "image_at": len(before) + 1,
        "image_rows": n_img,
        "image_grid_thw": grid[0].tolist(),
        "odd_grid_thw": grids["odd"][0].tolist(),
        "generated": gen,
        "greedy_min_margin": float(m.min()),
        "rope_positions": pos[:, 0, :].tolist(),
        "rope_delta": int(delta[0, 0]),
        "processor": PROCESSOR | {"class": "Qwen2VLImageProcessorPil", "resample": "bicubic"},
        "hf_config": json.loads(config.to_json_string(use_diff=False)),
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": np.__version__,
            "llama_cpp_converter_commit": commit_file.read_text().strip() if commit_file.exists() else "unknown",
            "device": "cpu, 1 thread, float32, deterministic algorithms",
        },
    }
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    log(f"wrote {out}")


def convert_mmproj(hf: Path, outtype: str, mmproj: Path, llamacpp: str) -> None:
    import subprocess
    run = [sys.executable, str(HERE / "convert.py"), "--pre", "qwen35", "--llamacpp", llamacpp, "--",
           str(hf), "--outtype", outtype, "--outfile", str(mmproj), "--model-name", "scoria-tiny-vision",
           "--mmproj"]
    log("  $ " + " ".join(run[1:]))
    r = subprocess.run(run, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-4000:] + r.stderr[-8000:])
        raise SystemExit(f"converter failed for the mmproj {mmproj.name}")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


if __name__ == "__main__":
    main()
