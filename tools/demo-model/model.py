"""The demo model: transformers' own Qwen3.5-MoE text model plus the MTP head as Qwen3.5
defines it, with a training-time vocabulary of the tokens the corpus uses.

* Trunk: `transformers.Qwen3_5MoeTextModel` (Gated DeltaNet and gated-attention layers,
  routed + shared experts), untouched, so the parity fixture is transformers itself.
* MTP (`MTP` below, the HF checkpoint layout `mtp.*`): the next token's embedding and the
  trunk's final (post-norm) hidden state, each RMS-normed (`pre_fc_norm_embedding`,
  `pre_fc_norm_hidden`), concatenated [embedding | hidden], projected by `fc` (2d -> d),
  one full-attention decoder layer with MoE (`layers.0`), the final norm `norm`, then the
  shared LM head. Position p pairs token x_p with the trunk's hidden state at p-1 and
  predicts x_{p+1}, i.e. the trunk's hidden state at t predicts x_{t+2}.
* Tied embeddings: the LM head is the embedding matrix.
* Compact vocabulary: only tokens that occur in the training data (and the chat
  template's special tokens) get their own row while training; every other token of the
  248,320-row Qwen3.5 vocabulary shares one learned row `other`. The "other" class's logit
  is h·other + log(n_other), which is exactly the total probability those tokens get in the
  full model where each of their rows equals `other`. `full_embedding()` writes that full
  matrix, so the exported model's full-vocabulary softmax equals the training softmax.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from transformers import Qwen3_5MoeTextConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

VOCAB_SIZE = 248_320


@dataclass
class Geometry:
    n_embd: int = 256
    n_layer: int = 8            # trunk layers; every 4th is full attention
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    rope_dim: int = 16          # rotated dims per head (partial_rotary_factor = rope_dim / head_dim)
    lin_k_heads: int = 2
    lin_v_heads: int = 4
    lin_head_dim: int = 64
    conv_kernel: int = 4
    n_expert: int = 32
    n_expert_used: int = 4
    expert_ff: int = 128
    shared_ff: int = 256
    rope_theta: float = 1.0e7
    rms_eps: float = 1e-6
    context_length: int = 4096
    mtp: bool = True

    def text_config(self, vocab_size: int, **extra) -> Qwen3_5MoeTextConfig:
        layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(self.n_layer)]
        # mrope sections over the rope_dim/2 frequencies, split as Qwen3.5's [11, 11, 10] splits 32
        # (text positions are equal in all three, so the split never changes a text logit)
        half = self.rope_dim // 2
        a = -(-half // 3)
        sections = [a, a, half - 2 * a]
        cfg = Qwen3_5MoeTextConfig(
            vocab_size=vocab_size, hidden_size=self.n_embd, num_hidden_layers=self.n_layer,
            num_attention_heads=self.n_head, num_key_value_heads=self.n_head_kv, head_dim=self.head_dim,
            linear_num_key_heads=self.lin_k_heads, linear_num_value_heads=self.lin_v_heads,
            linear_key_head_dim=self.lin_head_dim, linear_value_head_dim=self.lin_head_dim,
            linear_conv_kernel_dim=self.conv_kernel, full_attention_interval=4, layer_types=layer_types,
            moe_intermediate_size=self.expert_ff, shared_expert_intermediate_size=self.shared_ff,
            num_experts=self.n_expert, num_experts_per_tok=self.n_expert_used,
            rms_norm_eps=self.rms_eps, max_position_embeddings=self.context_length,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.rope_dim / self.head_dim,
                             "mrope_section": sections, "mrope_interleaved": True},
            tie_word_embeddings=True, attention_bias=False, initializer_range=0.02,
            use_cache=False, pad_token_id=None, bos_token_id=None,
            eos_token_id=248046 if vocab_size == VOCAB_SIZE else None, **extra)
        return cfg

    def to_dict(self) -> dict:
        return asdict(self)


GEOMETRIES = {
    # the committed demo model: ~40 MB as GGUF with export.py --quant demo
    # (the vocabulary's metadata alone is 10.9 MB and token_embd 17.9 MB at Q4_0: hidden size 128)
    "demo": Geometry(n_embd=128, n_layer=8, n_head=4, n_head_kv=2, head_dim=64, rope_dim=16, lin_k_heads=2,
                     lin_v_heads=4, lin_head_dim=64, n_expert=32, n_expert_used=4, expert_ff=128, shared_ff=256),
    # the CPU smoke test: every feature, minutes on two cores
    # the CPU smoke test: every feature and every tensor type of "demo" (IQ4_XS needs 256-long rows)
    "smoke": Geometry(n_embd=256, n_layer=4, n_head=2, n_head_kv=1, head_dim=64, rope_dim=16, lin_k_heads=2,
                      lin_v_heads=4, lin_head_dim=32, n_expert=8, n_expert_used=2, expert_ff=32, shared_ff=64),
}


# ----------------------------------------------------------------------------- experts on the GPU

def grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Routed experts as two grouped GEMMs (bf16 on CUDA, as `torch.nn.functional.grouped_mm`
    requires; float32 elsewhere). Same math as transformers' eager loop."""
    n_tok, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // k
    dt = torch.bfloat16 if hidden_states.is_cuda else torch.float32
    x = hidden_states[tok].to(dt)
    counts = torch.bincount(flat, minlength=self.num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gu = F.grouped_mm(x, self.gate_up_proj.to(dt).transpose(-2, -1), offs=offs)
    gate, up = gu.chunk(2, dim=-1)
    y = F.grouped_mm(self.act_fn(gate) * up, self.down_proj.to(dt).transpose(-2, -1), offs=offs)
    y = y.float() * top_k_weights.reshape(-1)[order].float().unsqueeze(-1)
    out = torch.empty_like(y)
    out[order] = y
    return out.view(n_tok, k, -1).sum(1).to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register("demo_grouped", grouped_experts_forward)


# ----------------------------------------------------------------------------- MTP

class MTP(nn.Module):
    def __init__(self, cfg: Qwen3_5MoeTextConfig):
        super().__init__()
        mcfg = Qwen3_5MoeTextConfig(**{**cfg.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]})
        mcfg._experts_implementation = cfg._experts_implementation
        mcfg._attn_implementation = cfg._attn_implementation
        d = cfg.hidden_size
        self.pre_fc_norm_embedding = hf.Qwen3_5MoeRMSNorm(d, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = hf.Qwen3_5MoeRMSNorm(d, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList([hf.Qwen3_5MoeDecoderLayer(mcfg, 0)])
        self.norm = hf.Qwen3_5MoeRMSNorm(d, eps=cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rotary, first_pos: int = 1) -> torch.Tensor:
        """embeds: embeddings of x_{p} (p = first_pos..), hidden: the trunk's final hidden state at p-1;
        returns the MTP's post-norm hidden state (what the LM head reads)."""
        b, t, _ = embeds.shape
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        pos = torch.arange(first_pos, first_pos + t, device=x.device).view(1, 1, -1).expand(3, b, -1)
        pe = rotary(x, pos)
        # causal: sdpa takes no mask as is_causal; eager needs the additive mask spelled out
        mask = None
        if self.layers[0].self_attn.config._attn_implementation != "sdpa":
            mask = torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=pe, attention_mask=mask, position_ids=pos[0])
        return self.norm(x)


# ----------------------------------------------------------------------------- loss

class LinearCrossEntropy(torch.autograd.Function):
    """mean cross-entropy of softmax(h·Wᵀ + b) against `target` (-100 = ignore), computed in
    token chunks with the gradients formed in the forward pass, so the [tokens, vocab]
    logits never exist whole. Matmuls in bf16 on CUDA, float32 elsewhere; softmax in float32."""

    @staticmethod
    def forward(ctx, h, w, b, target, chunk: int):
        dt = torch.bfloat16 if h.is_cuda else torch.float32
        hq, wq = h.to(dt), w.to(dt)
        valid = target >= 0
        n = valid.sum().clamp(min=1)
        loss = torch.zeros((), device=h.device, dtype=torch.float32)
        gh = torch.empty(h.shape, device=h.device, dtype=torch.float32)
        gw = torch.zeros(w.shape, device=h.device, dtype=torch.float32)
        gb = torch.zeros(b.shape, device=h.device, dtype=torch.float32)
        need = ctx.needs_input_grad
        bf = b.float()
        bias_cols = torch.nonzero(bf).flatten().tolist()  # the head's bias is zero but for a column or so
        for s in range(0, h.shape[0], chunk):
            hc, tc, vc = hq[s:s + chunk], target[s:s + chunk], valid[s:s + chunk]
            # the [chunk, vocab] passes are what this costs on a GPU: in place where possible
            logits = (hc @ wq.t()).float()
            for c in bias_cols:
                logits[:, c] += bf[c]
            lse = torch.logsumexp(logits, dim=-1)
            tcl = tc.clamp(min=0)
            loss += ((lse - logits.gather(1, tcl[:, None])[:, 0]) * vc).sum()
            if need[0] or need[1] or need[2]:
                p = logits.sub_(lse[:, None]).exp_()
                p[torch.arange(p.shape[0], device=p.device), tcl] -= 1.0
                if need[2]:
                    gb += (p * (vc.float() / n)[:, None]).sum(0)
                pq = p.to(dt)
                del logits, p
                scale = (vc.float() / n)[:, None]
                gh[s:s + chunk] = (pq @ wq).float() * scale
                gw += (pq.t() @ (hc.float() * scale).to(dt)).float()
        ctx.save_for_backward(gh, gw, gb)
        ctx.dtypes = (h.dtype, w.dtype, b.dtype)
        return loss / n

    @staticmethod
    def backward(ctx, g):
        gh, gw, gb = ctx.saved_tensors
        return ((gh * g).to(ctx.dtypes[0]), (gw * g).to(ctx.dtypes[1]), (gb * g).to(ctx.dtypes[2]), None, None)


def balance_loss(router_logits: list[torch.Tensor], n_expert: int, k: int) -> torch.Tensor:
    """Switch-style load-balancing loss, averaged over layers: E · Σ_e f_e · P_e, where f_e is
    the share of routed slots that went to expert e and P_e its mean router probability."""
    total = 0.0
    for lg in router_logits:
        p = torch.softmax(lg.float(), dim=-1)
        top = torch.topk(p, k, dim=-1).indices
        f = torch.zeros(n_expert, device=lg.device).scatter_add_(
            0, top.reshape(-1), torch.ones(top.numel(), device=lg.device)) / top.numel()
        total = total + n_expert * (f * p.mean(0)).sum()
    return total / max(len(router_logits), 1)


# ----------------------------------------------------------------------------- the model

class DemoModel(nn.Module):
    def __init__(self, geom: Geometry, keep_ids: torch.Tensor, experts_impl: str = "eager", attn_impl: str = "sdpa"):
        """keep_ids: the full-vocabulary ids that get their own row (sorted, unique)."""
        super().__init__()
        self.geom = geom
        self.register_buffer("keep_ids", keep_ids.to(torch.long), persistent=True)
        self.n_other = VOCAB_SIZE - keep_ids.numel()
        cfg = geom.text_config(vocab_size=keep_ids.numel())
        cfg._experts_implementation = experts_impl
        cfg._attn_implementation = attn_impl
        self.cfg = cfg
        self.trunk = hf.Qwen3_5MoeTextModel(cfg)
        self.other = nn.Parameter(torch.randn(geom.n_embd) * cfg.initializer_range)
        self.mtp = MTP(cfg) if geom.mtp else None
        self._init_weights()
        self._routers: list[torch.Tensor] = []
        for m in self.modules():
            if isinstance(m, hf.Qwen3_5MoeTopKRouter):
                m.register_forward_hook(lambda mod, inp, out: self._routers.append(out[0]))

    @torch.no_grad()
    def _init_weights(self):
        std = self.cfg.initializer_range
        n_layers = self.geom.n_layer + (1 if self.mtp is not None else 0)
        for name, p in self.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif "conv1d" in name:
                nn.init.normal_(p, std=0.2)
            elif name.endswith("norm.weight") or "layernorm" in name or "pre_fc_norm" in name:
                # zero-centred norms (1 + w) start at 0; the gated DeltaNet norm stores w itself
                p.fill_(1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
            elif name.endswith(("o_proj.weight", "out_proj.weight", "down_proj", "down_proj.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * n_layers))
            elif p.ndim >= 2:
                nn.init.normal_(p, std=std)

    # the LM head: [compact rows | other], logit bias log(n_other) on the last column
    def head(self):
        w = torch.cat([self.trunk.embed_tokens.weight, self.other[None]], dim=0)
        b = torch.zeros(w.shape[0], device=w.device, dtype=torch.float32)
        b[-1] = math.log(self.n_other) if self.n_other > 0 else -1e4
        return w, b

    def forward(self, ids: torch.Tensor, mtp_weight: float = 0.3, aux_weight: float = 0.01,
                ce_chunk: int = 8192, mtp_stride: int = 1) -> dict:
        """ids: [B, T] compact ids (the targets are the ids shifted by one, and two for MTP).
        The MTP loss is taken at every `mtp_stride`-th position (a random phase each call):
        its LM head is most of its cost."""
        self._routers.clear()
        out = self.trunk(input_ids=ids, use_cache=False)
        h = out.last_hidden_state
        w, b = self.head()
        d = h.shape[-1]
        tgt = ids[:, 1:]
        main = LinearCrossEntropy.apply(h[:, :-1].reshape(-1, d), w, b, tgt.reshape(-1), ce_chunk)
        res = {"main": main}
        loss = main
        if self.mtp is not None and mtp_weight > 0:
            e = self.trunk.embed_tokens(ids[:, 1:-1])
            hm = self.mtp(e, h[:, :-2], self.trunk.rotary_emb, first_pos=1).reshape(-1, d)
            tm = ids[:, 2:].reshape(-1)
            if mtp_stride > 1:
                rows = torch.arange(int(torch.randint(mtp_stride, ())), hm.shape[0], mtp_stride, device=hm.device)
                hm, tm = hm[rows], tm[rows]
            mtp = LinearCrossEntropy.apply(hm, w, b, tm, ce_chunk)
            res["mtp"] = mtp
            loss = loss + mtp_weight * mtp
        if aux_weight > 0:
            aux = balance_loss(self._routers, self.geom.n_expert, self.geom.n_expert_used)
            res["aux"] = aux
            loss = loss + aux_weight * aux
        self._routers.clear()
        res["loss"] = loss
        return res

    # ---- export helpers
    @torch.no_grad()
    def full_embedding(self) -> torch.Tensor:
        """[VOCAB_SIZE, d] float32: the compact rows at their ids, `other` everywhere else."""
        e = self.other.detach().float()[None].repeat(VOCAB_SIZE, 1)
        e[self.keep_ids] = self.trunk.embed_tokens.weight.detach().float()
        return e

    @torch.no_grad()
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under the HF Qwen3.5-MoE checkpoint's names (`model.*`, `mtp.*`;
        `lm_head` is tied), full vocabulary, float32."""
        sd = {}
        for k, v in self.trunk.state_dict().items():
            sd["model." + k] = v.detach().float()
        sd["model.embed_tokens.weight"] = self.full_embedding()
        if self.mtp is not None:
            for k, v in self.mtp.state_dict().items():
                sd["mtp." + k] = v.detach().float()
        return sd


def hf_causal_lm(geom: Geometry, state: dict[str, torch.Tensor]):
    """transformers' Qwen3_5MoeForCausalLM (full vocabulary, tied head, float32, eager experts)
    holding `state` (HF names; `mtp.*` ignored, as transformers does)."""
    cfg = geom.text_config(vocab_size=VOCAB_SIZE)
    cfg._experts_implementation = "eager"
    cfg._attn_implementation = "eager"
    m = hf.Qwen3_5MoeForCausalLM(cfg).float().eval()
    missing, unexpected = m.load_state_dict({k: v for k, v in state.items() if not k.startswith("mtp.")},
                                            strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"HF state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    m.lm_head.weight = m.model.embed_tokens.weight
    return m


def mtp_logits_hf(geom: Geometry, state: dict[str, torch.Tensor], hf_model, ids: torch.Tensor) -> torch.Tensor:
    """The MTP head's logits over the full vocabulary for a [1, T] prompt, computed from the HF
    state (row p: token ids[p+1] with the trunk's hidden state at p; predicts ids[p+2])."""
    cfg = hf_model.config
    mtp = MTP(cfg).float().eval()
    mtp.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("mtp.")})
    with torch.no_grad():
        h = hf_model.model(input_ids=ids, use_cache=False).last_hidden_state
        e = hf_model.model.embed_tokens(ids[:, 1:])
        hm = mtp(e, h[:, :-1], hf_model.model.rotary_emb, first_pos=1)
        return hm @ hf_model.model.embed_tokens.weight.t()
