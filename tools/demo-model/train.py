#!/usr/bin/env python3
"""Train the demo model (model.py) on the corpus gather.py wrote, within a wall-clock budget.

Schedule (by training time, so that it fits whatever speed the machine gives):
linear warm-up over `--warmup-steps`, the peak learning rate until the last
`--decay-frac` of this run's budget, then a cosine decay to `--min-lr-frac` of the peak.
The decay phase is also the chat stage: its batches draw `--chat-frac-decay` of their
sequences from the chat data (`--chat-frac` before it). Just before the decay phase the
whole training state is saved to `--ckpt` (also every `--ckpt-every` seconds), so a
second run with `--resume CKPT` continues the constant phase from there and decays again
at the end of its own budget; a run that resumes skips the warm-up.

Writes `--out`/final.pt (the weights, the geometry and the token map that export.py reads)
and prints progress (tokens/s, losses, learning rate) to stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import os
import random
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

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------- data

def read_docs(path: Path, limit: int | None) -> list[str]:
    with lzma.open(path, "rb") as f:
        docs = f.read().decode("utf-8").split("\0")
    return docs[:limit] if limit else docs


GEN_PROMPT = "<|im_start|>assistant\n<think>\n"


def tokenize(tok, docs: list[str], batch: int = 2048, chat: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """One stream of ids (every document followed by <|endoftext|>) and the documents' starts.

    chat: every other conversation is tokenized in pieces cut after each generation prompt
    (`<|im_start|>assistant\n<think>\n`), the way a served prompt ends there and the reply
    follows: "\n\n</think>" then starts with a lone "\n" token where the whole text has "\n\n"."""
    parts, starts, n = [], [], 0
    for i in range(0, len(docs), batch):
        pieces, bounds = [], []
        for j, d in enumerate(docs[i:i + batch]):
            ps = d.split(GEN_PROMPT) if chat and (i + j) % 2 == 1 else [d]
            bounds.append((len(pieces), len(pieces) + len(ps)))
            pieces += [p + GEN_PROMPT if k < len(ps) - 1 else p for k, p in enumerate(ps)]
        encs = tok.encode_batch(pieces, add_special_tokens=False)
        for a, z in bounds:
            ids = np.concatenate([np.asarray(encs[k].ids, dtype=np.int32) for k in range(a, z)])
            starts.append(n)
            parts.append(ids)
            parts.append(np.asarray([qwen_vocab.ENDOFTEXT], dtype=np.int32))
            n += ids.size + 1
    return np.concatenate(parts), np.asarray(starts, dtype=np.int64)


class Data:
    FILES = ("train", "chat", "valid", "chat_valid")

    def __init__(self, args, tok):
        d = Path(args.data)
        t = time.time()
        lim = args.max_docs
        key = "-".join(hashlib.sha256((d / f"{n}.xz").read_bytes()).hexdigest()[:12] for n in self.FILES)
        cache = Path(args.token_cache) / f"{key}-{lim}.npz" if args.token_cache else None
        if cache is not None and cache.exists():
            z = np.load(cache)
            for n in self.FILES:
                setattr(self, n, z[n])
            self.chat_starts, self.chat_valid_starts = z["chat_starts"], z["chat_valid_starts"]
            log(f"token ids from {cache}")
        else:
            self.train, _ = tokenize(tok, read_docs(d / "train.xz", lim))
            self.chat, self.chat_starts = tokenize(tok, read_docs(d / "chat.xz", lim), chat=True)
            self.valid, _ = tokenize(tok, read_docs(d / "valid.xz", lim))
            self.chat_valid, self.chat_valid_starts = tokenize(tok, read_docs(d / "chat_valid.xz", lim), chat=True)
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                np.savez(cache, chat_starts=self.chat_starts, chat_valid_starts=self.chat_valid_starts,
                         **{n: getattr(self, n) for n in self.FILES})
        log(f"tokenized in {time.time() - t:.1f}s: train {self.train.size / 1e6:.2f}M tokens, "
            f"chat {self.chat.size / 1e6:.2f}M, valid {self.valid.size / 1e6:.3f}M, "
            f"chat valid {self.chat_valid.size / 1e6:.3f}M")
        every = np.concatenate([self.train, self.chat, self.valid, self.chat_valid,
                                np.arange(qwen_vocab.N_RANKS, qwen_vocab.N_RANKS + len(qwen_vocab.ADDED)),
                                self.byte_ids()])
        self.keep = np.unique(every)
        self.to_compact = np.full(M.VOCAB_SIZE, -1, dtype=np.int64)
        self.to_compact[self.keep] = np.arange(self.keep.size)
        for name in ("train", "chat", "valid", "chat_valid"):
            setattr(self, name, self.to_compact[getattr(self, name)].astype(np.int32))
        log(f"compact vocabulary: {self.keep.size} tokens have their own row, "
            f"{M.VOCAB_SIZE - self.keep.size} share one")

    @staticmethod
    def byte_ids() -> np.ndarray:
        ranks = qwen_vocab.read_ranks()
        return np.asarray([r for r, t in enumerate(ranks) if len(t) == 1], dtype=np.int32)

    def batch(self, rng: np.random.Generator, n: int, seq: int, chat_frac: float) -> torch.Tensor:
        out = np.empty((n, seq + 1), dtype=np.int64)
        for i in range(n):
            if rng.random() < chat_frac:
                s = int(self.chat_starts[rng.integers(self.chat_starts.size)])
                s = min(s, self.chat.size - seq - 1)
                out[i] = self.chat[s:s + seq + 1]
            else:
                s = int(rng.integers(self.train.size - seq - 1))
                out[i] = self.train[s:s + seq + 1]
        return torch.from_numpy(out)

    def eval_batches(self, seq: int, n: int):
        """Fixed windows: `n` of held-out text and `n` of held-out chat."""
        res = {}
        for name, stream in (("valid", self.valid), ("chat_valid", self.chat_valid)):
            m = min(n, max(1, (stream.size - 1) // (seq + 1)))
            span = (stream.size - seq - 1) // m
            if span <= 0:
                continue
            res[name] = torch.from_numpy(np.stack([stream[i * span:i * span + seq + 1] for i in range(m)]).astype(np.int64))
        return res


# ----------------------------------------------------------------------------- training

def param_groups(model, wd: float):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "norm" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def set_experts_impl(model, impl: str) -> None:
    for m in model.modules():
        if isinstance(m, M.hf.Qwen3_5MoeExperts):
            m.config._experts_implementation = impl


@torch.no_grad()
def evaluate(model, batches: dict, device, amp, args) -> dict:
    model.eval()
    res = {}
    for name, b in batches.items():
        tot, n = 0.0, 0
        for i in range(0, b.shape[0], args.micro_batch):
            x = b[i:i + args.micro_batch].to(device)
            with amp():
                r = model(x, mtp_weight=1.0, aux_weight=0.0, ce_chunk=args.ce_chunk)
            tot += float(r["main"]) * x.shape[0]
            n += x.shape[0]
            res[name + "_mtp"] = res.get(name + "_mtp", 0.0) + float(r.get("mtp", 0.0)) * x.shape[0]
        res[name] = tot / n
        res[name + "_mtp"] /= n
    model.train()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(REPO / ".demo-data"))
    ap.add_argument("--out", required=True, help="folder for final.pt and train-log.json")
    ap.add_argument("--geometry", default="demo", choices=sorted(M.GEOMETRIES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--time-budget", type=float, required=True, help="seconds of training in this run")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: budget only)")
    ap.add_argument("--end-by", type=float, default=0.0,
                    help="unix time by which training, the final evaluation and the save must be done")
    ap.add_argument("--final-reserve", type=float, default=20.0, help="seconds kept for the final evaluation and save")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64, help="sequences per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup-steps", type=int, default=150)
    ap.add_argument("--decay-frac", type=float, default=0.22, help="share of the budget in the decay/chat stage")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--mtp-stride", type=int, default=2, help="MTP loss at every N-th position")
    ap.add_argument("--aux-weight", type=float, default=0.01)
    ap.add_argument("--chat-frac", type=float, default=0.03)
    ap.add_argument("--chat-frac-decay", type=float, default=0.4)
    ap.add_argument("--ce-chunk", type=int, default=16384)
    ap.add_argument("--experts-impl", default="auto", choices=["auto", "eager", "demo_grouped"])
    ap.add_argument("--ckpt", help="training-state checkpoint, written before the decay and every --ckpt-every s")
    ap.add_argument("--ckpt-every", type=float, default=150.0)
    ap.add_argument("--resume", help="a --ckpt file to continue from")
    ap.add_argument("--eval-every", type=float, default=120.0, help="seconds between held-out evaluations")
    ap.add_argument("--eval-seqs", type=int, default=32)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--max-docs", type=int, default=0, help="use only the first N documents of each file")
    ap.add_argument("--token-cache", help="folder that keeps the token ids between runs")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else \
        (lambda: torch.autocast("cpu", enabled=False))
    log(f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(0)})" if device.type == "cuda" else ""))

    tok = qwen_vocab.build().tokenizer()
    data = Data(args, tok)
    geom = M.GEOMETRIES[args.geometry]
    impl = args.experts_impl if args.experts_impl != "auto" else ("demo_grouped" if device.type == "cuda" else "eager")

    state = None
    if args.resume:
        state = torch.load(args.resume, map_location="cpu", weights_only=False)
        if not np.array_equal(state["keep_ids"], data.keep):
            raise SystemExit(f"{args.resume}: made from other data (its token map differs)")
        geom = M.Geometry(**state["geometry"])
        log(f"resuming from {args.resume}: step {state['step']}, {state['tokens'] / 1e6:.1f}M tokens")

    model = M.DemoModel(geom, torch.from_numpy(data.keep), experts_impl=impl).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_emb = model.trunk.embed_tokens.weight.numel()
    log(f"geometry {args.geometry}: {json.dumps(geom.to_dict())}")
    log(f"parameters: {n_params / 1e6:.2f}M trained ({n_emb / 1e6:.2f}M compact embedding, "
        f"{(n_params - n_emb) / 1e6:.2f}M other); exported model "
        f"{(n_params - n_emb + M.VOCAB_SIZE * geom.n_embd) / 1e6:.2f}M with the full embedding")
    opt = torch.optim.AdamW(param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    step, tokens, train_time = 0, 0, 0.0
    rng = np.random.default_rng(args.seed)
    history: list[dict] = []
    if state:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, tokens = state["step"], state["tokens"]
        rng = np.random.default_rng([args.seed, step])
        history = state.get("history", [])
    warm = 0 if state else args.warmup_steps

    eval_sets = data.eval_batches(args.seq_len, args.eval_seqs)
    accum = max(1, args.batch // args.micro_batch)

    def save_ckpt(path, tag):
        t = time.time()
        tmp = path + ".tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "tokens": tokens,
                    "geometry": geom.to_dict(), "keep_ids": data.keep, "history": history}, tmp)
        os.replace(tmp, path)
        log(f"checkpoint ({tag}) -> {path} in {time.time() - t:.1f}s")

    budget = args.time_budget
    if args.end_by:
        # a hard end for the whole process (the caller's wall-clock limit): what is left after
        # loading, less the time the final evaluation and save take
        left = args.end_by - time.time() - args.final_reserve
        if left < budget:
            log(f"--end-by leaves {left:.0f}s of training, not {budget:.0f}s")
            budget = max(left, 1.0)
    decay_at = budget * (1 - args.decay_frac)
    log(f"training for {budget:.0f}s: constant learning rate until {decay_at:.0f}s, then the decay and chat stage")
    saved_stable = False
    last_ckpt = last_eval = 0.0
    t_start = time.time()
    t_log, tok_log = time.time(), tokens
    first_run_step = step
    while True:
        train_time = time.time() - t_start
        if train_time >= budget or (args.max_steps and step - first_run_step >= args.max_steps):
            break
        decaying = train_time >= decay_at
        if decaying and not saved_stable and args.ckpt:
            save_ckpt(args.ckpt, "before the decay: resume from here")
            saved_stable = True
        if warm and step - first_run_step < warm:
            lr = args.lr * (step - first_run_step + 1) / warm
        elif decaying:
            prog = min(1.0, (train_time - decay_at) / max(budget - decay_at, 1e-6))
            lr = args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))
        else:
            lr = args.lr
        for g in opt.param_groups:
            g["lr"] = lr
        chat_frac = args.chat_frac_decay if decaying else args.chat_frac
        batch = data.batch(rng, args.batch, args.seq_len, chat_frac)

        while True:
            try:
                opt.zero_grad(set_to_none=True)
                sums: dict[str, float] = {}
                for i in range(0, batch.shape[0], args.micro_batch):
                    x = batch[i:i + args.micro_batch].to(device, non_blocking=True)
                    with amp():
                        r = model(x, mtp_weight=args.mtp_weight, aux_weight=args.aux_weight, ce_chunk=args.ce_chunk,
                                  mtp_stride=args.mtp_stride)
                    (r["loss"] * x.shape[0] / batch.shape[0]).backward()
                    for k, v in r.items():
                        sums[k] = sums.get(k, 0.0) + v.detach() * x.shape[0] / batch.shape[0]
                break
            except torch.OutOfMemoryError:
                if args.micro_batch == 1:
                    raise
                args.micro_batch //= 2
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                log(f"out of memory: micro-batch now {args.micro_batch}")
            except (RuntimeError, NotImplementedError) as e:
                if impl == "eager" or step > first_run_step:
                    raise
                log(f"grouped experts failed ({str(e).splitlines()[0][:200]}); using transformers' eager loop")
                impl = "eager"
                set_experts_impl(model, impl)
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        tokens += batch.shape[0] * args.seq_len

        if step % args.log_every == 0 or step == first_run_step + 1:
            vals = {k: float(v) for k, v in sums.items()}
            now = time.time()
            tps = (tokens - tok_log) / max(now - t_log, 1e-9)
            t_log, tok_log = now, tokens
            rec = dict(step=step, t=round(train_time, 1), tokens=tokens, tok_s=round(tps), lr=lr,
                       gnorm=round(float(gnorm), 3), chat_frac=chat_frac, **{k: round(v, 4) for k, v in vals.items()})
            history.append(rec)
            log(f"step {step} {'decay' if decaying else 'const'} tok {tokens / 1e6:.1f}M {tps / 1e3:.1f}k tok/s "
                f"loss {vals['main']:.3f} mtp {vals.get('mtp', 0):.3f} aux {vals.get('aux', 0):.3f} "
                f"lr {lr:.2e} gn {float(gnorm):.2f}")
        if args.eval_every and train_time - last_eval >= args.eval_every and step > first_run_step + 1:
            last_eval = train_time
            ev = evaluate(model, eval_sets, device, amp, args)
            history.append(dict(step=step, tokens=tokens, eval=ev))
            log("eval " + " ".join(f"{k} {v:.3f}" for k, v in ev.items()))
        if args.ckpt and not decaying and train_time - last_ckpt >= args.ckpt_every:
            last_ckpt = train_time
            save_ckpt(args.ckpt, "periodic")

    if args.ckpt and not saved_stable:
        save_ckpt(args.ckpt, "end of budget before any decay")
    ev = evaluate(model, eval_sets, device, amp, args)
    history.append(dict(step=step, tokens=tokens, eval=ev, final=True))
    log("final eval " + " ".join(f"{k} {v:.3f} (ppl {math.exp(v):.1f})" for k, v in ev.items()))
    log(f"trained {step} steps, {tokens / 1e6:.1f}M tokens in {train_time:.0f}s this run "
        f"({(tokens - (state['tokens'] if state else 0)) / max(train_time, 1e-9) / 1e3:.1f}k tok/s)")
    torch.save({"model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                "geometry": geom.to_dict(), "keep_ids": data.keep, "step": step, "tokens": tokens,
                "history": history}, out / "final.pt")
    (out / "train-log.json").write_text(json.dumps({"args": vars(args), "history": history}, indent=1) + "\n")
    log(f"wrote {out / 'final.pt'}")


if __name__ == "__main__":
    main()
