#!/usr/bin/env python3
"""Write the trained demo model (train.py's final.pt) as a `qwen35moe` GGUF, exactly as
llama.cpp's converter writes a Qwen3.5-MoE checkpoint, and its parity fixture.

Transforms from the HF checkpoint layout (the converter's):
* every zero-centred RMSNorm weight w is stored as 1 + w (input/post-attention norms,
  q/k norms, the final norm, the MTP's three norms); the DeltaNet gated norm is stored as is;
* `A_log` -> `ssm_a` = -exp(A_log); `dt_bias` -> `ssm_dt.bias`; `conv1d.weight`
  [C, 1, K] -> `ssm_conv1d.weight` {K, C};
* value heads reordered from HF's grouped order (v-head h uses k-head h // r) to the tiled
  order ggml broadcasts (h' = j·Hk + g holds HF head g·r + j) in every value-indexed tensor:
  the V rows of `in_proj_qkv` and its conv channels, `in_proj_z`, `in_proj_a`, `in_proj_b`,
  `A_log`, `dt_bias`, and the input columns of `out_proj`;
* fused experts `gate_up_proj` [E, 2F, D] split into `ffn_gate_exps` and `ffn_up_exps`
  {D, F, E}; `down_proj` [E, D, F] -> `ffn_down_exps` {F, D, E};
* the MTP head (`mtp.*`) becomes block n_layer: `mtp.fc` -> `nextn.eh_proj`,
  `pre_fc_norm_embedding` -> `nextn.enorm`, `pre_fc_norm_hidden` -> `nextn.hnorm`,
  `mtp.norm` -> `nextn.shared_head_norm`, `mtp.layers.0.*` -> that block's attention and
  MoE tensors; `block_count` = n_layer + 1, `nextn_predict_layers` = 1 (`--no-mtp` leaves it out);
* the LM head is tied: no `output.weight`, the head is `token_embd`.

Quantization (`--quant`): `f32` (every tensor F32), `q8_0` (matrices Q8_0), or `demo`
(the committed file: `token_embd` IQ4_XS, matrices whose rows are a multiple of 256 long
IQ4_XS, the other matrices Q4_0, routers, the shared-expert gate, the conv, norms and
the DeltaNet A/dt in F32 as the converter keeps them). Q8_0 and Q4_0 blocks come from the
`gguf` package's quantizers, IQ4_XS blocks from `quant.py`; every block is read back with the
`gguf` package's dequantizer for the fixture.

Fixture (`--fixture`): a prompt of real text, transformers' greedy continuation and the
float32 logits of transformers' `Qwen3_5MoeForCausalLM` holding the file's dequantized
weights (see README.md for the files).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import model as M  # noqa: E402
import qwen_vocab  # noqa: E402
import quant  # noqa: E402

import gguf  # noqa: E402

QT = gguf.GGMLQuantizationType
ARCH = "qwen35moe"
TEMPLATE = REPO / "crates" / "model" / "assets" / "templates" / "qwen35.jinja"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- HF -> GGUF tensors

def v_head_perm(n_k: int, n_v: int) -> list[int]:
    """new position h' -> HF head (grouped -> tiled)."""
    r = n_v // n_k
    return [g * r + j for j in range(r) for g in range(n_k)]


def to_gguf(geom: M.Geometry, sd: dict[str, torch.Tensor], mtp: bool) -> list[tuple[str, np.ndarray, str]]:
    """(name, float32 array in numpy order (ggml ne reversed), kind) in file order; kind is
    the quantization rule: 'embd', 'mat', 'f32'."""
    t = {k: v.detach().float().cpu().numpy() for k, v in sd.items()}
    out: list[tuple[str, np.ndarray, str]] = []

    def put(name, arr, kind):
        out.append((name, np.ascontiguousarray(arr, dtype=np.float32), kind))

    hk, hv, dk = geom.lin_k_heads, geom.lin_v_heads, geom.lin_head_dim
    perm = v_head_perm(hk, hv)
    key_dim = hk * dk

    def reorder_rows(a, block):  # rows grouped per v-head in blocks of `block`
        return np.concatenate([a[h * block:(h + 1) * block] for h in perm], axis=0)

    def block(prefix: str, i: int, full_attention: bool):
        p = f"blk.{i}."
        put(p + "attn_norm.weight", 1.0 + t[prefix + "input_layernorm.weight"], "f32")
        if full_attention:
            a = prefix + "self_attn."
            put(p + "attn_q.weight", t[a + "q_proj.weight"], "mat")
            put(p + "attn_k.weight", t[a + "k_proj.weight"], "mat")
            put(p + "attn_v.weight", t[a + "v_proj.weight"], "mat")
            put(p + "attn_output.weight", t[a + "o_proj.weight"], "mat")
            put(p + "attn_q_norm.weight", 1.0 + t[a + "q_norm.weight"], "f32")
            put(p + "attn_k_norm.weight", 1.0 + t[a + "k_norm.weight"], "f32")
        else:
            a = prefix + "linear_attn."
            qkv = t[a + "in_proj_qkv.weight"]
            qkv = np.concatenate([qkv[:2 * key_dim], reorder_rows(qkv[2 * key_dim:], dk)], axis=0)
            conv = t[a + "conv1d.weight"][:, 0, :]  # [C, K]
            conv = np.concatenate([conv[:2 * key_dim], reorder_rows(conv[2 * key_dim:], dk)], axis=0)
            put(p + "ssm_a", -np.exp(t[a + "A_log"])[perm], "f32")
            put(p + "ssm_conv1d.weight", conv, "f32")
            put(p + "ssm_dt.bias", t[a + "dt_bias"][perm], "f32")
            put(p + "ssm_alpha.weight", t[a + "in_proj_a.weight"][perm], "mat")
            put(p + "ssm_beta.weight", t[a + "in_proj_b.weight"][perm], "mat")
            put(p + "attn_qkv.weight", qkv, "mat")
            put(p + "attn_gate.weight", reorder_rows(t[a + "in_proj_z.weight"], dk), "mat")
            put(p + "ssm_norm.weight", t[a + "norm.weight"], "f32")
            o = t[a + "out_proj.weight"]  # [D, Hv*dv]: reorder input columns
            put(p + "ssm_out.weight", np.concatenate([o[:, h * dk:(h + 1) * dk] for h in perm], axis=1), "mat")
        m = prefix + "mlp."
        gu = t[m + "experts.gate_up_proj"]
        f = gu.shape[1] // 2
        put(p + "ffn_gate_exps.weight", gu[:, :f, :], "mat")
        put(p + "ffn_up_exps.weight", gu[:, f:, :], "mat")
        put(p + "ffn_down_exps.weight", t[m + "experts.down_proj"], "mat")
        put(p + "ffn_gate_inp.weight", t[m + "gate.weight"], "f32")
        put(p + "ffn_gate_inp_shexp.weight", t[m + "shared_expert_gate.weight"], "f32")
        put(p + "ffn_gate_shexp.weight", t[m + "shared_expert.gate_proj.weight"], "mat")
        put(p + "ffn_up_shexp.weight", t[m + "shared_expert.up_proj.weight"], "mat")
        put(p + "ffn_down_shexp.weight", t[m + "shared_expert.down_proj.weight"], "mat")
        put(p + "post_attention_norm.weight", 1.0 + t[prefix + "post_attention_layernorm.weight"], "f32")

    put("token_embd.weight", t["model.embed_tokens.weight"], "embd")
    put("output_norm.weight", 1.0 + t["model.norm.weight"], "f32")
    for i in range(geom.n_layer):
        block(f"model.layers.{i}.", i, (i + 1) % 4 == 0)
    if mtp:
        n = geom.n_layer
        block("mtp.layers.0.", n, True)
        put(f"blk.{n}.nextn.eh_proj.weight", t["mtp.fc.weight"], "mat")
        put(f"blk.{n}.nextn.enorm.weight", 1.0 + t["mtp.pre_fc_norm_embedding.weight"], "f32")
        put(f"blk.{n}.nextn.hnorm.weight", 1.0 + t["mtp.pre_fc_norm_hidden.weight"], "f32")
        put(f"blk.{n}.nextn.shared_head_norm.weight", 1.0 + t["mtp.norm.weight"], "f32")
    return out


def from_gguf(geom: M.Geometry, tensors: dict[str, np.ndarray], mtp: bool) -> dict[str, torch.Tensor]:
    """The inverse of to_gguf: float32 GGUF-layout tensors back to the HF state dict."""
    hk, hv, dk = geom.lin_k_heads, geom.lin_v_heads, geom.lin_head_dim
    perm = v_head_perm(hk, hv)
    inv = [perm.index(h) for h in range(hv)]
    key_dim = hk * dk
    sd: dict[str, np.ndarray] = {}

    def unrows(a, blk):
        return np.concatenate([a[h * blk:(h + 1) * blk] for h in inv], axis=0)

    def block(prefix: str, i: int, full_attention: bool):
        p = f"blk.{i}."
        g = lambda n: tensors[p + n]  # noqa: E731
        sd[prefix + "input_layernorm.weight"] = g("attn_norm.weight") - 1.0
        sd[prefix + "post_attention_layernorm.weight"] = g("post_attention_norm.weight") - 1.0
        if full_attention:
            a = prefix + "self_attn."
            sd[a + "q_proj.weight"] = g("attn_q.weight")
            sd[a + "k_proj.weight"] = g("attn_k.weight")
            sd[a + "v_proj.weight"] = g("attn_v.weight")
            sd[a + "o_proj.weight"] = g("attn_output.weight")
            sd[a + "q_norm.weight"] = g("attn_q_norm.weight") - 1.0
            sd[a + "k_norm.weight"] = g("attn_k_norm.weight") - 1.0
        else:
            a = prefix + "linear_attn."
            qkv = g("attn_qkv.weight")
            sd[a + "in_proj_qkv.weight"] = np.concatenate([qkv[:2 * key_dim], unrows(qkv[2 * key_dim:], dk)])
            conv = g("ssm_conv1d.weight")
            conv = np.concatenate([conv[:2 * key_dim], unrows(conv[2 * key_dim:], dk)])
            sd[a + "conv1d.weight"] = conv[:, None, :]
            sd[a + "A_log"] = np.log(-g("ssm_a"))[inv]
            sd[a + "dt_bias"] = g("ssm_dt.bias")[inv]
            sd[a + "in_proj_a.weight"] = g("ssm_alpha.weight")[inv]
            sd[a + "in_proj_b.weight"] = g("ssm_beta.weight")[inv]
            sd[a + "in_proj_z.weight"] = unrows(g("attn_gate.weight"), dk)
            sd[a + "norm.weight"] = g("ssm_norm.weight")
            o = g("ssm_out.weight")
            sd[a + "out_proj.weight"] = np.concatenate([o[:, h * dk:(h + 1) * dk] for h in inv], axis=1)
        m = prefix + "mlp."
        sd[m + "experts.gate_up_proj"] = np.concatenate([g("ffn_gate_exps.weight"), g("ffn_up_exps.weight")], axis=1)
        sd[m + "experts.down_proj"] = g("ffn_down_exps.weight")
        sd[m + "gate.weight"] = g("ffn_gate_inp.weight")
        sd[m + "shared_expert_gate.weight"] = g("ffn_gate_inp_shexp.weight")
        sd[m + "shared_expert.gate_proj.weight"] = g("ffn_gate_shexp.weight")
        sd[m + "shared_expert.up_proj.weight"] = g("ffn_up_shexp.weight")
        sd[m + "shared_expert.down_proj.weight"] = g("ffn_down_shexp.weight")

    sd["model.embed_tokens.weight"] = tensors["token_embd.weight"]
    sd["model.norm.weight"] = tensors["output_norm.weight"] - 1.0
    for i in range(geom.n_layer):
        block(f"model.layers.{i}.", i, (i + 1) % 4 == 0)
    if mtp:
        n = geom.n_layer
        block("mtp.layers.0.", n, True)
        sd["mtp.fc.weight"] = tensors[f"blk.{n}.nextn.eh_proj.weight"]
        sd["mtp.pre_fc_norm_embedding.weight"] = tensors[f"blk.{n}.nextn.enorm.weight"] - 1.0
        sd["mtp.pre_fc_norm_hidden.weight"] = tensors[f"blk.{n}.nextn.hnorm.weight"] - 1.0
        sd["mtp.norm.weight"] = tensors[f"blk.{n}.nextn.shared_head_norm.weight"] - 1.0
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in sd.items()}


# ----------------------------------------------------------------------------- quantization

def choose_type(name: str, arr: np.ndarray, kind: str, plan: str):
    if kind == "f32" or plan == "f32":
        return QT.F32
    row = arr.shape[-1]
    if plan == "q8_0":
        return QT.Q8_0 if row % 32 == 0 else QT.F32
    if plan == "demo":
        # routed experts and the embedding (most of the bytes) at 4 bits, IQ4_XS where rows
        # allow it; the small dense matrices (attention, DeltaNet, shared expert, MTP fc) Q8_0
        if kind == "embd" or "_exps." in name:
            if row % 256 == 0:
                return QT.IQ4_XS
            return QT.Q4_0 if row % 32 == 0 else QT.F32
        return QT.Q8_0 if row % 32 == 0 else QT.F32
    raise SystemExit(f"unknown --quant {plan}")


def encode(arr: np.ndarray, qt, device: str) -> np.ndarray:
    if qt == QT.F32:
        return arr.astype(np.float32)
    if qt == QT.IQ4_XS:
        return quant.quantize_iq4_xs(arr, device=device)
    return gguf.quants.quantize(arr, qt)


def decode(data: np.ndarray, qt, shape) -> np.ndarray:
    if qt == QT.F32:
        return np.asarray(data, dtype=np.float32).reshape(shape)
    return gguf.quants.dequantize(data, qt).reshape(shape)


# ----------------------------------------------------------------------------- metadata

def write_gguf(path: Path, geom: M.Geometry, items, mtp: bool, name: str, file_type: int, vocab) -> None:
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_string("general.type", "model")
    w.add_string("general.name", name)
    a = ARCH + "."
    w.add_uint32(a + "block_count", geom.n_layer + (1 if mtp else 0))
    w.add_uint32(a + "context_length", geom.context_length)
    w.add_uint32(a + "embedding_length", geom.n_embd)
    w.add_uint32(a + "attention.head_count", geom.n_head)
    w.add_uint32(a + "attention.head_count_kv", geom.n_head_kv)
    half = geom.rope_dim // 2
    s = -(-half // 3)
    w.add_array(a + "rope.dimension_sections", [s, s, half - 2 * s, 0])
    w.add_float32(a + "rope.freq_base", geom.rope_theta)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", geom.rms_eps)
    w.add_uint32(a + "expert_count", geom.n_expert)
    w.add_uint32(a + "expert_used_count", geom.n_expert_used)
    w.add_uint32(a + "attention.key_length", geom.head_dim)
    w.add_uint32(a + "attention.value_length", geom.head_dim)
    w.add_uint32("general.file_type", file_type)
    w.add_uint32(a + "expert_feed_forward_length", geom.expert_ff)
    w.add_uint32(a + "expert_shared_feed_forward_length", geom.shared_ff)
    w.add_uint32(a + "ssm.conv_kernel", geom.conv_kernel)
    w.add_uint32(a + "ssm.state_size", geom.lin_head_dim)
    w.add_uint32(a + "ssm.group_count", geom.lin_k_heads)
    w.add_uint32(a + "ssm.time_step_rank", geom.lin_v_heads)
    w.add_uint32(a + "ssm.inner_size", geom.lin_v_heads * geom.lin_head_dim)
    w.add_uint32(a + "full_attention_interval", 4)
    w.add_uint32(a + "rope.dimension_count", geom.rope_dim)
    if mtp:
        w.add_uint32(a + "nextn_predict_layers", 1)
    w.add_uint32("general.quantization_version", 2)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen35")
    w.add_array("tokenizer.ggml.tokens", vocab.gguf_tokens())
    w.add_array("tokenizer.ggml.token_type", vocab.gguf_token_types())
    w.add_array("tokenizer.ggml.merges", vocab.merges)
    w.add_uint32("tokenizer.ggml.eos_token_id", qwen_vocab.IM_END)
    w.add_uint32("tokenizer.ggml.padding_token_id", qwen_vocab.ENDOFTEXT)
    w.add_uint32("tokenizer.ggml.bos_token_id", qwen_vocab.ENDOFTEXT)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", TEMPLATE.read_text("utf-8"))
    for name_, data, qt, shape in items:
        # quantized data is [..., bytes per row]; the writer derives the element shape from it
        w.add_tensor(name_, data, raw_dtype=qt if qt != QT.F32 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ----------------------------------------------------------------------------- fixture

FIXTURE_PROMPT = (
    "def fibonacci(n):\n"
    "    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    "    if n < 2:\n"
    "        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
    "The Rust standard library provides the `Vec` type, a growable array. "
    "A vector stores its elements on the heap and"
)


@torch.no_grad()
def make_fixture(geom, state, prompt_ids: list[int], n_gen: int, out: Path, n_cols: int, extra: dict):
    """Greedy run and teacher-forced logits of transformers' model with `state`."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    hf_model = M.hf_causal_lm(geom, state)
    ids = torch.tensor([prompt_ids])
    out_ids, step_rows = list(prompt_ids), []
    from transformers import DynamicCache
    cache = DynamicCache(config=hf_model.config)
    r = hf_model(input_ids=ids, past_key_values=cache, use_cache=True)
    logits = [r.logits[0].float()]
    for _ in range(n_gen):
        nxt = int(torch.argmax(logits[-1][-1]))
        out_ids.append(nxt)
        r = hf_model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        logits.append(r.logits[0].float())
    stepped = torch.cat(logits, 0)[: len(out_ids)]
    full = hf_model(input_ids=torch.tensor([out_ids]), use_cache=False).logits[0].float()
    greedy = out_ids[len(prompt_ids):]
    # columns kept in the .npy files: the n_cols most likely ids over all rows, then every
    # 499th id of the vocabulary (so unseen-token rows are checked too)
    score = torch.softmax(full, -1).max(0).values
    top = torch.topk(score, min(n_cols, score.numel())).indices.sort().values.tolist()
    cols = sorted(set(top) | set(range(0, M.VOCAB_SIZE, 499)))
    colt = torch.tensor(cols)
    np.save(out / "logits.npy", stepped[:, colt].numpy().astype(np.float32))
    np.save(out / "full_logits.npy", full[:, colt].numpy().astype(np.float32))
    lse = torch.logsumexp(full, -1)
    s = torch.sort(full, -1, descending=True).values
    margins = (s[:, 0] - s[:, 1]).tolist()
    mtp = M.mtp_logits_hf(geom, state, hf_model, torch.tensor([out_ids])) if "mtp.fc.weight" in state else None
    ref = {
        "prompt_text": FIXTURE_PROMPT,
        "prompt_ids": prompt_ids, "greedy_ids": greedy, "sequence_ids": out_ids,
        "logit_columns": cols,
        "files": {
            "logits.npy": f"float32 [{len(out_ids)}, {len(cols)}]: columns `logit_columns` of the logits; rows "
                          f"0..{len(prompt_ids) - 1} from one forward over prompt_ids, row {len(prompt_ids)}+j from "
                          f"the cached decode step that fed greedy_ids[j]. Row i = logits after sequence_ids[i].",
            "full_logits.npy": f"float32 [{len(out_ids)}, {len(cols)}]: columns `logit_columns` of one "
                               f"teacher-forced forward over all of sequence_ids",
        },
        "logsumexp": lse.tolist(),
        "margins": {"definition": "top-1 minus top-2 logit over the full vocabulary, per row of full_logits",
                    "full_logits": margins,
                    "greedy_min": float(min(margins[len(prompt_ids) - 1:len(out_ids) - 1]))},
        "checks": {"max_abs_diff_logits_vs_full_logits": float((stepped - full).abs().max()),
                   "greedy_argmax_in_columns": all(g in set(cols) for g in greedy)},
        **extra,
    }
    if mtp is not None:
        ref["mtp"] = {
            "definition": "MTP head (blk.N.nextn.*) over the full vocabulary: row p pairs token sequence_ids[p+1] "
                          "with the trunk's post-norm hidden state at p and predicts sequence_ids[p+2]; "
                          "argmax per row and the logits of the columns `logit_columns`",
            "argmax": mtp[0].argmax(-1).tolist(),
            "accuracy_vs_sequence": float((mtp[0, :-1].argmax(-1) == torch.tensor(out_ids[2:])).float().mean()),
        }
        np.save(out / "mtp_logits.npy", mtp[0][:, colt].numpy().astype(np.float32))
        ref["files"]["mtp_logits.npy"] = f"float32 [{len(out_ids) - 1}, {len(cols)}]: the MTP rows above"
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    return ref


@torch.no_grad()
def perplexity(geom, state, tok, path: Path, n_bytes: int, ctx: int) -> dict:
    """Perplexity of transformers' model with `state` on the first `n_bytes` of `path`, in
    consecutive windows of `ctx` tokens: over every predicted token, and llama.cpp's way
    (`llama-perplexity`: only the second half of each window is scored)."""
    text = path.read_bytes()[:n_bytes].decode("utf-8", errors="ignore")
    ids = tok.encode(text, add_special_tokens=False).ids
    m = M.hf_causal_lm(geom, state)
    nll_all, n_all, nll_half, n_half = 0.0, 0, 0.0, 0
    for s in range(0, len(ids) - ctx + 1, ctx):
        x = torch.tensor([ids[s:s + ctx]])
        lp = torch.log_softmax(m(input_ids=x, use_cache=False).logits[0].float(), -1)
        nll = -lp[:-1].gather(1, x[0, 1:, None])[:, 0]
        nll_all += float(nll.sum())
        n_all += nll.numel()
        nll_half += float(nll[ctx // 2 - 1:].sum())
        n_half += nll[ctx // 2 - 1:].numel()
    return {"file": path.name, "bytes": n_bytes, "ctx": ctx, "tokens": len(ids),
            "ppl_all_tokens": float(np.exp(nll_all / max(n_all, 1))),
            "ppl_second_half_of_each_window": float(np.exp(nll_half / max(n_half, 1)))}


@torch.no_grad()
def samples(geom, state, tok, n: int = 80, time_limit: float = 40.0) -> list[dict]:
    """A few continuations (temperature 0.7, top-k 40, seed 0) to read in the log: text, code, and
    chat turns rendered with our template's generation prompt."""
    import chat
    m = M.hf_causal_lm(geom, state)
    tpl = chat.template()
    prompts = [
        "def quicksort(items):\n",
        "The Rust programming language",
        "## Installation\n\n",
        tpl.render(messages=[{"role": "user", "content": "What does `os.path.join` do?"}],
                   add_generation_prompt=True),
        tpl.render(messages=[{"role": "user", "content": "Hi! Who are you?"}], add_generation_prompt=True,
                   enable_thinking=False),
        tpl.render(messages=[{"role": "user", "content": "Read `src/main.rs` and tell me what it does."}],
                   tools=[chat.TOOLS["read_file"], chat.TOOLS["search_code"]], add_generation_prompt=True),
    ]
    out = []
    g = torch.Generator().manual_seed(0)
    t_end = time.time() + time_limit
    for p in prompts:
        if time.time() > t_end:
            break
        ids = tok.encode(p, add_special_tokens=False).ids
        x = torch.tensor([ids])
        from transformers import DynamicCache
        cache = DynamicCache(config=m.config)
        logits = m(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1]
        gen = []
        for _ in range(n):
            v, i = torch.topk(logits.float() / 0.7, 40)
            nxt = int(i[torch.multinomial(torch.softmax(v, -1), 1, generator=g)])
            gen.append(nxt)
            if nxt in (qwen_vocab.IM_END, qwen_vocab.ENDOFTEXT):
                break
            logits = m(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True).logits[0, -1]
        out.append({"prompt": p[-120:], "completion": tok.decode(gen, skip_special_tokens=False)})
    return out


# ----------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="train.py's final.pt")
    ap.add_argument("--out", required=True, help="the GGUF file to write")
    ap.add_argument("--quant", default="demo", choices=["demo", "q8_0", "f32"])
    ap.add_argument("--no-mtp", action="store_true", help="leave the MTP block out")
    ap.add_argument("--name", default="scoria demo qwen35moe")
    ap.add_argument("--fixture", help="folder for the parity fixture (reference.json, *.npy)")
    ap.add_argument("--fixture-gen", type=int, default=32)
    ap.add_argument("--fixture-cols", type=int, default=512)
    ap.add_argument("--ppl-file", help="also print transformers' perplexity of the file's weights on this text")
    ap.add_argument("--ppl-bytes", type=int, default=6144)
    ap.add_argument("--samples", action="store_true", help="print a few sampled continuations")
    ap.add_argument("--ppl-ctx", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the IQ4_XS search runs")
    args = ap.parse_args()

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    ck = torch.load(args.ckpt, map_location="cpu", weights_only=False)
    geom = M.Geometry(**ck["geometry"])
    mtp = geom.mtp and not args.no_mtp
    dm = M.DemoModel(geom, torch.as_tensor(ck["keep_ids"]))
    dm.load_state_dict(ck["model"])
    state = dm.hf_state_dict()
    items = to_gguf(geom, state, mtp)

    # the inverse mapping (used for the fixture) must give the GGUF tensors back: bit for bit
    # (x - 1 + 1 is exact for norm weights in [0.5, 2]) except ssm_a (exp of a log), and the
    # HF tensors to float32 rounding
    back = from_gguf(geom, {n: a for n, a, _ in items}, mtp)
    for k, v in back.items():
        if not torch.allclose(v, state[k].reshape(v.shape), rtol=1e-5, atol=1e-6):
            raise SystemExit(f"export: {k} does not round-trip through the GGUF layout")
    missing = [k for k in state if k not in back and not (k.startswith("mtp.") and not mtp)]
    if missing:
        raise SystemExit(f"export: HF tensors not exported: {missing[:8]}")
    for (n1, a1, _), (n2, a2, _) in zip(items, to_gguf(geom, back, mtp)):
        same = np.allclose(a1, a2, rtol=1e-6, atol=0) if n1.endswith("ssm_a") else np.array_equal(a1, a2)
        if n1 != n2 or not same:
            raise SystemExit(f"export: {n1} changes through the inverse mapping")

    log(f"quantizing ({args.quant})")
    written, deq, counts, nbytes = [], {}, {}, 0
    for name, arr, kind in items:
        qt = choose_type(name, arr, kind, args.quant)
        data = encode(arr, qt, args.device)
        written.append((name, data, qt, arr.shape))
        deq[name] = decode(data, qt, arr.shape)
        counts[qt.name] = counts.get(qt.name, 0) + 1
        nbytes += data.nbytes
        if qt != QT.F32:
            err = float(np.sqrt(np.mean((deq[name] - arr) ** 2)) / (np.sqrt(np.mean(arr ** 2)) + 1e-12))
            if err > 0.2:
                raise SystemExit(f"{name}: {qt.name} relative RMS error {err:.3f}")
    log(f"tensor types {counts}, {nbytes / 1e6:.2f} MB of tensor data")

    vocab = qwen_vocab.build()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # LLAMA_FTYPE_ALL_F32, MOSTLY_Q8_0, MOSTLY_Q4_0 / MOSTLY_IQ4_XS (the embedding's type)
    file_type = {"f32": 0, "q8_0": 7}.get(args.quant) or (30 if geom.n_embd % 256 == 0 else 2)
    tmp = out.with_suffix(".tmp")
    write_gguf(tmp, geom, written, mtp, args.name, file_type, vocab)
    os.replace(tmp, out)
    sha = hashlib.sha256(out.read_bytes()).hexdigest()
    log(f"wrote {out}: {out.stat().st_size / 1e6:.2f} MB, sha256 {sha}")

    if args.fixture:
        fx = Path(args.fixture)
        fx.mkdir(parents=True, exist_ok=True)
        tok = vocab.tokenizer()
        prompt = tok.encode(FIXTURE_PROMPT, add_special_tokens=False).ids
        qstate = from_gguf(geom, deq, mtp)
        import transformers
        extra = {
            "model": out.name, "model_sha256": sha, "quant": args.quant, "tensor_types": counts,
            "weights": "transformers Qwen3_5MoeForCausalLM (float32, eager) holding the GGUF's tensors as the gguf "
                       "package dequantizes them, mapped back to the HF layout",
            "geometry": geom.to_dict(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "numpy": np.__version__,
                         "gguf": getattr(gguf, "__version__", "?")},
        }
        if args.ppl_file:
            extra["perplexity"] = perplexity(geom, qstate, tok, Path(args.ppl_file), args.ppl_bytes, args.ppl_ctx)
            log(f"perplexity (transformers, the file's weights): {json.dumps(extra['perplexity'])}")
        if args.samples:
            extra["samples"] = samples(geom, qstate, tok)
            for smp in extra["samples"]:
                log(f"sample: ...{smp['prompt'][-60:]!r} -> {smp['completion']!r}")
        ref = make_fixture(geom, qstate, prompt, args.fixture_gen, fx, args.fixture_cols, extra)
        log(f"fixture -> {fx}: greedy {tok.decode(ref['greedy_ids'])!r}, min greedy margin "
            f"{ref['margins']['greedy_min']:.3g}")
        if "mtp" in ref:
            log(f"MTP head: argmax equals the token two ahead at {ref['mtp']['accuracy_vs_sequence']:.1%} of rows")


if __name__ == "__main__":
    main()
