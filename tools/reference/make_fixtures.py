#!/usr/bin/env python3
"""Build the parity fixtures under tests/fixtures/<arch>/.

For each architecture (qwen3moe, qwen3next, qwen35moe) this script

1. builds a tiny float32 HuggingFace model (transformers' own class), random
   weights from a fixed seed, with every norm, A_log, dt_bias and conv weight
   perturbed so that each code path matters;
2. records the reference: logits of one forward over an 80-token random prompt,
   then 32 greedy steps through the KV/recurrent cache (logits.npy), and one
   teacher-forced forward over all 112 tokens (full_logits.npy); several seeds
   are tried and the one whose smallest greedy top-1/top-2 margin is largest is
   kept;
3. builds the Q8_0 reference: the same model with every weight that the
   converter stores as Q8_0 replaced by its Q8_0 round trip, teacher-forced
   over the same 112 tokens (q8_0_full_logits.npy) and its own greedy run;
4. converts both models with llama.cpp's converter (convert.py wrapper) to
   model-f32.gguf and model-q8_0.gguf, and checks that every tensor of the Q8_0
   file dequantizes exactly to the F32 conversion of the Q8_0 reference model;
5. writes reference.json and tensors.txt.

Runs on a CPU in a few minutes.  Needs torch, transformers (5.x), numpy,
safetensors, regex, and the converter in .llamacpp/ (see README.md).

Usage: python tools/reference/make_fixtures.py [--arch ARCH ...] [--seeds N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import toy_tokenizer  # noqa: E402

VOCAB = 320
N_PROMPT = 80
N_GEN = 32
N_NORMAL = VOCAB - len(toy_tokenizer.SPECIALS)  # prompt ids are drawn from the BPE tokens

STD = 0.12          # projections and experts (initializer_range)
EMBED_STD = 1.0     # token embeddings: the current token matters, so greedy runs do not loop at once
LM_HEAD_STD = 0.2   # lm_head: logits std about 2, wider top-1/top-2 margins
ROUTER_STD = 0.3    # router and shared-expert gate: decisive routing
NORM_STD = 0.2      # every RMSNorm weight: w = 1 + N(0, NORM_STD) in effect
CONV_STD = 0.3      # depthwise causal conv taps
A_RANGE = (0.5, 8.0)    # A = exp(A_log) ~ U(A_RANGE)
DT_BIAS = (0.5, 0.5)    # dt_bias ~ N(mean, std)

ARCHS: dict[str, dict] = {
    "qwen3moe": dict(
        hf_class="Qwen3MoeForCausalLM", config_class="Qwen3MoeConfig", tokenizer="qwen2", pre="qwen2",
        no_mtp=False, zero_centred_norms=False,
        config=dict(
            vocab_size=VOCAB, hidden_size=96, num_hidden_layers=4,
            num_attention_heads=6, num_key_value_heads=2, head_dim=32,
            intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False,
            initializer_range=STD, use_sliding_window=False,
        ),
    ),
    "qwen3next": dict(
        hf_class="Qwen3NextForCausalLM", config_class="Qwen3NextConfig", tokenizer="qwen2", pre="qwen2",
        no_mtp=True, zero_centred_norms=True,
        config=dict(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_conv_kernel_dim=4, full_attention_interval=4,
            intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False,
            initializer_range=STD,
        ),
    ),
    "qwen35moe": dict(
        hf_class="Qwen3_5MoeForCausalLM", config_class="Qwen3_5MoeTextConfig", tokenizer="qwen35", pre="qwen35",
        no_mtp=True, zero_centred_norms=True,
        config=dict(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_conv_kernel_dim=4, full_attention_interval=4,
            moe_intermediate_size=32, shared_expert_intermediate_size=64,
            num_experts=10, num_experts_per_tok=3,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [3, 3, 2], "mrope_interleaved": True},
            max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False,
            initializer_range=STD,
        ),
    ),
}
ARCH_INDEX = {name: i for i, name in enumerate(ARCHS)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- model

def make_config(arch: str, tok_ids: dict):
    import transformers
    spec = ARCHS[arch]
    cls = getattr(transformers, spec["config_class"])
    cfg = dict(spec["config"])
    if cfg.get("full_attention_interval"):
        n, k = cfg["num_hidden_layers"], cfg["full_attention_interval"]
        cfg["layer_types"] = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
    cfg.update(eos_token_id=tok_ids["eos_token_id"], pad_token_id=tok_ids["pad_token_id"], bos_token_id=None)
    config = cls(**cfg)
    config.architectures = [spec["hf_class"]]
    return config


def is_q8_weight(name: str, p: torch.Tensor) -> bool:
    """Whether the converter stores this parameter as Q8_0 in a q8_0 conversion."""
    if p.ndim < 2:
        return False
    if name.endswith("mlp.gate.weight") or "shared_expert_gate" in name or "conv1d" in name:
        return False  # ffn_gate_inp, ffn_gate_inp_shexp, ssm_conv1d stay F32
    return True


@torch.no_grad()
def perturb(model, arch: str, seed: int) -> dict:
    """Overwrite every parameter from one seeded generator; returns a summary."""
    g = torch.Generator().manual_seed(seed)
    zc = ARCHS[arch]["zero_centred_norms"]
    kinds: dict[str, int] = {}

    def rn(shape, std, mean=0.0):
        return torch.randn(shape, generator=g, dtype=torch.float32) * std + mean

    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            lo, hi = A_RANGE
            v = torch.rand(p.shape, generator=g) * (hi - lo) + lo
            p.copy_(v.log()); kind = "A_log"
        elif name.endswith("dt_bias"):
            p.copy_(rn(p.shape, DT_BIAS[1], DT_BIAS[0])); kind = "dt_bias"
        elif "conv1d" in name:
            p.copy_(rn(p.shape, CONV_STD)); kind = "conv1d"
        elif p.ndim == 1 and "norm" in name:
            if zc and "linear_attn.norm" not in name:
                p.copy_(rn(p.shape, NORM_STD)); kind = "norm(1+w)"
            else:
                p.copy_(rn(p.shape, NORM_STD, 1.0)); kind = "norm(w)"
        elif name.endswith("mlp.gate.weight") or "shared_expert_gate" in name:
            p.copy_(rn(p.shape, ROUTER_STD)); kind = "router/shexp_gate"
        elif name.endswith("embed_tokens.weight"):
            p.copy_(rn(p.shape, EMBED_STD)); kind = "embedding"
        elif name.endswith("lm_head.weight"):
            p.copy_(rn(p.shape, LM_HEAD_STD)); kind = "lm_head"
        elif p.ndim >= 2:
            p.copy_(rn(p.shape, STD)); kind = "weight"
        else:
            raise RuntimeError(f"unhandled parameter {name} {tuple(p.shape)}")
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def build_model(arch: str, config, seed: int):
    import transformers
    cls = getattr(transformers, ARCHS[arch]["hf_class"])
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    kinds = perturb(model, arch, seed)
    return model, kinds


@torch.no_grad()
def q8_model(model, arch: str, config, gguf_mod):
    """A copy of the model whose Q8_0-stored weights went through quantize/dequantize."""
    import copy
    m = copy.deepcopy(model)
    qt = gguf_mod.GGMLQuantizationType.Q8_0
    names = []
    for name, p in m.named_parameters():
        if is_q8_weight(name, p):
            a = p.detach().numpy().astype(np.float32)
            assert a.shape[-1] % 32 == 0, (name, a.shape)
            q = gguf_mod.quants.quantize(a, qt)
            d = gguf_mod.quants.dequantize(q, qt).reshape(a.shape)
            p.copy_(torch.from_numpy(np.ascontiguousarray(d, dtype=np.float32)))
            names.append(name)
    return m, names


# ----------------------------------------------------------------------------- reference runs

@torch.no_grad()
def greedy_run(model, prompt: list[int], n_gen: int):
    """Prompt forward, then n_gen greedy steps through the cache.

    Returns (logits [len(prompt)+n_gen, V], generated ids).  Row i holds the logits
    after token i of prompt+generated; generated[j] = argmax(row len(prompt)-1+j)."""
    ids = torch.tensor([prompt], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    rows = [out.logits[0].float()]
    cache = out.past_key_values
    gen: list[int] = []
    for _ in range(n_gen):
        nxt = int(torch.argmax(rows[-1][-1]))
        gen.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]], dtype=torch.long), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        rows.append(out.logits[0].float())
    return torch.cat(rows, 0).numpy(), gen


@torch.no_grad()
def full_forward(model, seq: list[int]):
    out = model(input_ids=torch.tensor([seq], dtype=torch.long), use_cache=False, output_router_logits=True)
    router = getattr(out, "router_logits", None)
    return out.logits[0].float().numpy(), router


def margins(logits: np.ndarray) -> np.ndarray:
    top2 = np.sort(logits, axis=-1)[:, -2:]
    return (top2[:, 1] - top2[:, 0]).astype(np.float64)


def router_gaps(router, k: int) -> dict | None:
    """Smallest gap between the k-th and (k+1)-th router logit, per MoE layer."""
    if not router:
        return None
    per_layer = []
    for r in router:
        r = r.detach().float().reshape(-1, r.shape[-1])
        s = torch.sort(r, dim=-1, descending=True).values
        per_layer.append(float((s[:, k - 1] - s[:, k]).min()))
    return {"min_gap_kth_vs_next_per_layer": per_layer, "min_gap": min(per_layer)}


@torch.no_grad()
def hf_generate(model, prompt: list[int], n_gen: int) -> list[int]:
    from transformers import GenerationConfig
    gc = GenerationConfig(do_sample=False, max_new_tokens=n_gen, min_new_tokens=0, eos_token_id=None,
                          pad_token_id=model.config.pad_token_id, num_beams=1)
    out = model.generate(torch.tensor([prompt], dtype=torch.long), generation_config=gc)
    return out[0, len(prompt):].tolist()


def evaluate_seed(arch: str, config, seed: int, prompt: list[int], gguf_mod):
    model, kinds = build_model(arch, config, seed)
    step_logits, gen = greedy_run(model, prompt, N_GEN)
    seq = prompt + gen
    full, router = full_forward(model, seq)
    m = margins(step_logits)
    greedy_m = m[N_PROMPT - 1:N_PROMPT - 1 + N_GEN]
    tf_tokens = np.argmax(full[N_PROMPT - 1:N_PROMPT - 1 + N_GEN], axis=-1).tolist()
    info = dict(
        seed=seed,
        greedy_min_margin=float(greedy_m.min()),
        distinct_generated=len(set(gen)),
        logits_std=float(step_logits.std()),
        max_abs_diff_step_vs_full=float(np.abs(step_logits - full).max()),
        teacher_forced_argmax_matches=tf_tokens == gen,
    )
    rg = router_gaps(router, config.num_experts_per_tok)
    info["router_min_gap"] = rg["min_gap"] if rg else None
    qm, _ = q8_model(model, arch, config, gguf_mod)
    _, q8_gen = greedy_run(qm, prompt, N_GEN)
    info["q8_0_greedy_identical"] = q8_gen == gen
    return model, kinds, step_logits, gen, full, router, info


# ----------------------------------------------------------------------------- conversion / GGUF

def convert(arch: str, hf_dir: Path, outtype: str, outfile: Path, llamacpp: Path) -> str:
    spec = ARCHS[arch]
    cmd = [sys.executable, str(HERE / "convert.py"), "--pre", spec["pre"], "--llamacpp", str(llamacpp), "--",
           str(hf_dir), "--outtype", outtype, "--outfile", str(outfile), "--model-name", f"scoria-tiny-{arch}"]
    if spec["no_mtp"]:
        cmd.append("--no-mtp")
    log("  $ " + " ".join(cmd[1:]))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(r.stdout[-5000:] + r.stderr[-10000:])
        raise SystemExit(f"converter failed for {arch} {outtype}")
    return r.stdout + r.stderr


def read_gguf(path: Path, gguf_mod):
    rd = gguf_mod.GGUFReader(str(path))
    tensors = {}
    for t in rd.tensors:
        tensors[t.name] = t
    return rd, tensors


def dequant(t, gguf_mod) -> np.ndarray:
    qt = gguf_mod.GGMLQuantizationType(int(t.tensor_type))
    shape = [int(x) for x in reversed(t.shape.tolist())]  # numpy order (ne reversed)
    if qt == gguf_mod.GGMLQuantizationType.F32:
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    return gguf_mod.quants.dequantize(np.asarray(t.data), qt).reshape(shape)


def field_value(f, gguf_mod):
    try:
        v = f.contents()
    except Exception:  # older gguf-py
        v = None
    return v


def describe_gguf(path: Path, gguf_mod) -> list[str]:
    rd, tensors = read_gguf(path, gguf_mod)
    lines = [f"# {path.name}: {len(tensors)} tensors, {path.stat().st_size} bytes", "## metadata"]
    for key, f in rd.fields.items():
        if key.startswith("GGUF."):
            continue
        v = field_value(f, gguf_mod)
        if isinstance(v, list) and len(v) > 16:
            s = f"[{len(v)} items: {', '.join(repr(x) for x in v[:4])}, ...]"
        else:
            s = repr(v)
        lines.append(f"{key} = {s}")
    lines.append("## tensors (name, type, ne = [ne0, ne1, ...])")
    for name, t in tensors.items():
        qt = gguf_mod.GGMLQuantizationType(int(t.tensor_type)).name
        lines.append(f"{name:40s} {qt:6s} {[int(x) for x in t.shape.tolist()]}")
    return lines


def verify_q8(q8_path: Path, ref_path: Path, f32_path: Path, gguf_mod) -> dict:
    """Every Q8_0 tensor dequantizes exactly to the F32 conversion of the Q8_0 reference model;
    every F32 tensor of the q8 file equals the F32 file's."""
    _, q8 = read_gguf(q8_path, gguf_mod)
    _, ref = read_gguf(ref_path, gguf_mod)
    _, f32 = read_gguf(f32_path, gguf_mod)
    assert set(q8) == set(ref) == set(f32), "tensor sets differ"
    counts: dict[str, int] = {}
    for name, t in q8.items():
        qt = gguf_mod.GGMLQuantizationType(int(t.tensor_type)).name
        counts[qt] = counts.get(qt, 0) + 1
        a = dequant(t, gguf_mod)
        b = dequant(ref[name], gguf_mod)
        if not np.array_equal(a, b):
            raise SystemExit(f"{q8_path}: {name} ({qt}) differs from the Q8_0 reference by "
                             f"{np.abs(a - b).max()}")
        if qt == "F32" and not np.array_equal(a, dequant(f32[name], gguf_mod)):
            raise SystemExit(f"{q8_path}: F32 tensor {name} differs from the F32 file")
        assert qt in ("F32", "Q8_0"), f"{name} stored as {qt}"
    return counts


# ----------------------------------------------------------------------------- main

def geometry(arch: str, config) -> dict:
    c = config
    g = dict(
        vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers,
        heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
        q_dim=c.num_attention_heads * c.head_dim, experts=c.num_experts, experts_per_tok=c.num_experts_per_tok,
        moe_intermediate=c.moe_intermediate_size, rope_theta=c.rope_parameters["rope_theta"],
        rms_norm_eps=c.rms_norm_eps,
    )
    if arch == "qwen3moe":
        g["norm_topk_prob"] = c.norm_topk_prob
    else:
        rot = int(c.head_dim * c.rope_parameters["partial_rotary_factor"])
        g.update(
            partial_rotary_factor=c.rope_parameters["partial_rotary_factor"], rope_dims=rot,
            layer_types=list(c.layer_types), full_attention_interval=4,
            shared_expert_intermediate=c.shared_expert_intermediate_size,
            linear_key_heads=c.linear_num_key_heads, linear_value_heads=c.linear_num_value_heads,
            linear_key_head_dim=c.linear_key_head_dim, linear_value_head_dim=c.linear_value_head_dim,
            conv_kernel=c.linear_conv_kernel_dim,
            conv_channels=2 * c.linear_num_key_heads * c.linear_key_head_dim
            + c.linear_num_value_heads * c.linear_value_head_dim,
            attn_output_gate=True,
        )
        if arch == "qwen3next":
            g["norm_topk_prob"] = c.norm_topk_prob
        else:
            g["mrope_section"] = c.rope_parameters.get("mrope_section")
    return g


def run_arch(arch: str, args, gguf_mod, versions: dict) -> dict:
    spec = ARCHS[arch]
    work = Path(args.workdir) / arch
    out = REPO / "tests" / "fixtures" / arch
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)

    tok_dir = work / "tokenizer"
    tok_ids = toy_tokenizer.write(spec["tokenizer"], VOCAB, str(tok_dir))
    config = make_config(arch, tok_ids)

    prompt_seed = 1000 + ARCH_INDEX[arch]
    rng = np.random.default_rng(prompt_seed)
    prompt = rng.integers(0, N_NORMAL, size=N_PROMPT).tolist()

    seeds = [int(s) for s in args.seed_list] if args.seed_list else \
        [ARCH_INDEX[arch] * 100 + i for i in range(args.seeds)]
    best = None
    candidates = []
    for seed in seeds:
        t0 = time.time()
        res = evaluate_seed(arch, config, seed, prompt, gguf_mod)
        info = res[-1]
        candidates.append(info)
        log(f"{arch} seed {seed}: min greedy margin {info['greedy_min_margin']:.4g}, "
            f"{info['distinct_generated']} distinct, logits std {info['logits_std']:.3f}, "
            f"step/full diff {info['max_abs_diff_step_vs_full']:.2e}, tf match "
            f"{info['teacher_forced_argmax_matches']}, q8 same {info['q8_0_greedy_identical']}, "
            f"router gap {info['router_min_gap']:.3g} "
            f"({time.time() - t0:.1f}s)")
        # non-degenerate first; then wide greedy margins and wide router top-k gaps (an
        # engine's float32 rounding must flip neither a token nor an expert choice; past
        # 0.02 and 0.002 they count alike), then a Q8_0 run that keeps the F32 greedy
        # tokens, then the widest margin
        ok = info["distinct_generated"] >= 10 and info["teacher_forced_argmax_matches"]
        mm = info["greedy_min_margin"]
        rg = info["router_min_gap"] or 0.0
        key = (ok, min(mm, 0.02) + 10 * min(rg, 0.002), info["q8_0_greedy_identical"], mm)
        if best is None or key > best[0]:
            best = (key, res)
    assert best is not None
    model, kinds, step_logits, gen, full, router, info = best[1]
    seed = info["seed"]
    log(f"{arch}: keeping seed {seed}")

    gen_hf = hf_generate(model, prompt, N_GEN)
    seq = prompt + gen

    # Q8_0 reference
    qm, q8_names = q8_model(model, arch, config, gguf_mod)
    q8_full, q8_router = full_forward(qm, seq)
    q8_step, q8_gen = greedy_run(qm, prompt, N_GEN)

    # save both HF models (outside the repo) and convert
    hf_dir, q8_dir = work / "hf", work / "hf_q8ref"
    for m, d in ((model, hf_dir), (qm, q8_dir)):
        m.save_pretrained(d, safe_serialization=True)
        for f in tok_dir.iterdir():
            shutil.copy(f, d / f.name)
    f32_path, q8_path, ref_path = out / "model-f32.gguf", out / "model-q8_0.gguf", work / "q8ref-f32.gguf"
    convert(arch, hf_dir, "f32", f32_path, Path(args.llamacpp))
    convert(arch, hf_dir, "q8_0", q8_path, Path(args.llamacpp))
    convert(arch, q8_dir, "f32", ref_path, Path(args.llamacpp))
    q8_counts = verify_q8(q8_path, ref_path, f32_path, gguf_mod)

    # F32 GGUF spot check: embeddings and output equal the HF weights exactly
    _, f32t = read_gguf(f32_path, gguf_mod)
    sd = model.state_dict()
    assert np.array_equal(dequant(f32t["token_embd.weight"], gguf_mod), sd["model.embed_tokens.weight"].numpy())
    assert np.array_equal(dequant(f32t["output.weight"], gguf_mod), sd["lm_head.weight"].numpy())

    np.save(out / "logits.npy", step_logits.astype(np.float32))
    np.save(out / "full_logits.npy", full.astype(np.float32))
    np.save(out / "q8_0_full_logits.npy", q8_full.astype(np.float32))

    lines = describe_gguf(f32_path, gguf_mod) + [""] + describe_gguf(q8_path, gguf_mod)
    (out / "tensors.txt").write_text("\n".join(lines) + "\n")

    m_step, m_full, m_q8 = margins(step_logits), margins(full), margins(q8_full)
    gsl = slice(N_PROMPT - 1, N_PROMPT - 1 + N_GEN)
    small = [int(i) for i in np.nonzero(m_step < 1e-3)[0]]
    k = config.num_experts_per_tok
    ref = {
        "arch": arch,
        "hf_class": spec["hf_class"],
        "config_class": spec["config_class"],
        "seed": seed,
        "prompt_seed": prompt_seed,
        "n_prompt": N_PROMPT,
        "n_generated": N_GEN,
        "prompt_ids": prompt,
        "greedy_ids": gen,
        "sequence_ids": seq,
        "files": {
            "model-f32.gguf": "llama.cpp converter, --outtype f32" + (", --no-mtp" if spec["no_mtp"] else ""),
            "model-q8_0.gguf": "llama.cpp converter, --outtype q8_0" + (", --no-mtp" if spec["no_mtp"] else ""),
            "logits.npy": f"float32 [{N_PROMPT + N_GEN}, {VOCAB}]: rows 0..{N_PROMPT - 1} from one forward over "
                          f"prompt_ids; row {N_PROMPT}+j from the cached decode step that fed greedy_ids[j]. "
                          f"Row i = logits after sequence_ids[i]; greedy_ids[j] = argmax(row {N_PROMPT - 1}+j).",
            "full_logits.npy": f"float32 [{N_PROMPT + N_GEN}, {VOCAB}]: one teacher-forced forward over all of "
                               f"sequence_ids (no cache)",
            "q8_0_full_logits.npy": f"float32 [{N_PROMPT + N_GEN}, {VOCAB}]: teacher-forced forward over "
                                    f"sequence_ids of the same model with every weight that model-q8_0.gguf "
                                    f"stores as Q8_0 replaced by its Q8_0 round trip (weights only; activations "
                                    f"in float32)",
            "tensors.txt": "metadata and tensor names/types/shapes of both GGUF files (gguf-py GGUFReader)",
        },
        "margins": {
            "definition": "top-1 minus top-2 logit, per row",
            "logits": m_step.tolist(),
            "full_logits": m_full.tolist(),
            "greedy_min": float(m_step[gsl].min()),
            "greedy_argmin_step": int(np.argmin(m_step[gsl])),
            "all_rows_min": float(m_step.min()),
            "rows_below_1e-3": small,
        },
        "checks": {
            "logits_std": float(step_logits.std()),
            "distinct_generated": len(set(gen)),
            "max_abs_diff_logits_vs_full_logits": float(np.abs(step_logits - full).max()),
            "teacher_forced_argmax_matches_greedy": bool(info["teacher_forced_argmax_matches"]),
            "hf_generate_matches_greedy": gen_hf == gen,
            "hf_generate_ids": gen_hf,
            "router": router_gaps(router, k),
        },
        "q8_0": {
            "quantized_hf_params": q8_names,
            "gguf_tensor_types": q8_counts,
            "dequantized_gguf_equals_reference_weights": True,
            "greedy_ids": q8_gen,
            "greedy_matches_f32": sum(int(a == b) for a, b in zip(q8_gen, gen)),
            "greedy_identical_to_f32": q8_gen == gen,
            "full_logits_max_abs_diff_vs_f32": float(np.abs(q8_full - full).max()),
            "full_logits_rowmax_abs_diff_vs_f32": np.abs(q8_full - full).max(-1).tolist(),
            "full_logits_margins": m_q8.tolist(),
            "teacher_forced_argmax_matches_f32_greedy": int(
                (np.argmax(q8_full[gsl], -1) == np.array(gen)).sum()),
            "router": router_gaps(q8_router, k),
        },
        "seed_search": candidates,
        "init": {
            "weights_std": STD, "embedding_std": EMBED_STD, "lm_head_std": LM_HEAD_STD, "router_and_shared_gate_std": ROUTER_STD, "norm_std": NORM_STD,
            "conv_std": CONV_STD, "A": f"exp(A_log) ~ U{A_RANGE}", "dt_bias": f"N{DT_BIAS}",
            "norms": ("zero-centred HF norms (1+w): w ~ N(0, norm_std), the converter writes 1+w; "
                      "linear_attn.norm (ssm_norm) w ~ 1 + N(0, norm_std), written as is"
                      if spec["zero_centred_norms"] else "w ~ 1 + N(0, norm_std)"),
            "parameter_kinds": kinds,
        },
        "geometry": geometry(arch, config),
        "hf_config": json.loads(config.to_json_string(use_diff=False)),
        "versions": versions,
    }
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    log(f"{arch}: wrote {out} (greedy min margin {ref['margins']['greedy_min']:.4g}, q8 greedy "
        f"{ref['q8_0']['greedy_matches_f32']}/{N_GEN}, q8 max diff {ref['q8_0']['full_logits_max_abs_diff_vs_f32']:.3g})")
    return ref


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", nargs="*", default=list(ARCHS))
    ap.add_argument("--seeds", type=int, default=24, help="seeds tried per arch")
    ap.add_argument("--seed-list", nargs="*", help="exact seeds to try (overrides --seeds)")
    ap.add_argument("--llamacpp", default=str(REPO / ".llamacpp"))
    ap.add_argument("--workdir", default=os.environ.get("SCORIA_REF_WORK", "/tmp/scoria-reference"))
    args = ap.parse_args()

    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("highest")
    torch.set_num_threads(1)

    sys.path.insert(0, str(Path(args.llamacpp) / "gguf-py"))
    import gguf as gguf_mod
    import transformers

    commit_file = Path(args.llamacpp) / "COMMIT"
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "llama_cpp_converter_commit": commit_file.read_text().strip() if commit_file.exists() else "unknown",
        "device": "cpu, 1 thread, float32, deterministic algorithms",
    }
    log(f"versions: {versions}")
    for arch in args.arch:
        run_arch(arch, args, gguf_mod, versions)


if __name__ == "__main__":
    main()
