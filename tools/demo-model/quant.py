"""An IQ4_XS quantizer (the `gguf` package only dequantizes this type).

Block layout (ggml's block_iq4_xs, 256 values, 136 bytes): f16 d; u16 scales_h (2 high
bits of each sub-block's 6-bit scale); u8 scales_l[4] (4 low bits, two sub-blocks a byte,
even sub-block in the low nibble); u8 qs[128] (sub-block ib's 16 bytes hold value j in the
low nibble and value j+16 in the high nibble of byte j). Value = d · (ls − 32) · K[q] with
K the 16-entry non-linear grid below.

Search (ours): for each 32-value sub-block, candidate scales that put its largest |x| on
either end of the grid, each stretched by −20%..+20%; each candidate's nearest-grid codes,
then the least-squares scale for those codes; the candidate with the least squared error
wins. The block scale d is the largest |sub-scale| / 31 (rounded to f16), sub-scales are
rounded to d's multiples, and the codes are chosen again for the rounded scales. Runs in
torch, on the GPU when there is one.
"""

from __future__ import annotations

import numpy as np
import torch

KVALUES = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
QK = 256
BLOCK_BYTES = 136


def _nearest(y: torch.Tensor, k: torch.Tensor, mids: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(y.contiguous(), mids)


def _quantize_blocks(x: torch.Tensor) -> torch.Tensor:
    """x: [n, 256] float32 -> [n, 136] uint8."""
    dev = x.device
    n = x.shape[0]
    k = torch.tensor(KVALUES, dtype=torch.float32, device=dev)
    mids = (k[1:] + k[:-1]) / 2
    xs = x.view(n, 8, 32)
    amax_idx = xs.abs().argmax(-1, keepdim=True)
    xm = torch.gather(xs, -1, amax_idx)  # signed value of largest magnitude [n, 8, 1]
    best_err = torch.full((n, 8), float("inf"), device=dev)
    best_s = torch.zeros((n, 8), device=dev)
    for target in (KVALUES[0], KVALUES[-1]):
        for stretch in torch.linspace(-0.2, 0.2, 9).tolist():
            s = xm[..., 0] / (target * (1.0 + stretch))  # [n, 8]
            safe = torch.where(s.abs() > 1e-30, s, torch.ones_like(s))
            q = _nearest(xs / safe[..., None], k, mids)
            kv = k[q]
            s2 = (xs * kv).sum(-1) / (kv * kv).sum(-1).clamp(min=1e-12)
            err = ((xs - s2[..., None] * kv) ** 2).sum(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s = torch.where(better, s2, best_s)
    amax_s = best_s.abs().max(-1).values  # [n]
    d = (amax_s / 31.0).to(torch.float16)
    df = d.float()
    safe_d = torch.where(df > 0, df, torch.ones_like(df))
    ls = torch.clamp(torch.round(best_s / safe_d[:, None]), -32, 31)
    ls = torch.where(df[:, None] > 0, ls, torch.zeros_like(ls))
    dl = df[:, None] * ls  # [n, 8]
    safe_dl = torch.where(dl.abs() > 0, dl, torch.ones_like(dl))
    q = _nearest(xs / safe_dl[..., None], k, mids).to(torch.uint8)  # [n, 8, 32]
    q = torch.where(dl[..., None].abs() > 0, q, torch.full_like(q, 8))
    lsu = (ls + 32).to(torch.int32)  # 0..63
    out = torch.zeros((n, BLOCK_BYTES), dtype=torch.uint8, device=dev)
    out[:, 0:2] = d.view(torch.uint8).view(n, 2) if d.dim() == 1 else d.view(torch.uint8)
    sh = torch.zeros(n, dtype=torch.int32, device=dev)
    for ib in range(8):
        sh |= ((lsu[:, ib] >> 4) & 3) << (2 * ib)
    out[:, 2] = (sh & 0xFF).to(torch.uint8)
    out[:, 3] = ((sh >> 8) & 0xFF).to(torch.uint8)
    for i in range(4):
        out[:, 4 + i] = ((lsu[:, 2 * i] & 0xF) | ((lsu[:, 2 * i + 1] & 0xF) << 4)).to(torch.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, 128)
    out[:, 8:] = qs
    return out


def quantize_iq4_xs(arr: np.ndarray, device: str = "cpu", chunk: int = 65536) -> np.ndarray:
    """float32 array whose last dimension is a multiple of 256 -> uint8 [..., row_bytes]."""
    if arr.shape[-1] % QK:
        raise ValueError(f"IQ4_XS needs rows that are a multiple of {QK} long, got {arr.shape[-1]}")
    flat = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(-1, QK)
    parts = []
    for s in range(0, flat.shape[0], chunk):
        parts.append(_quantize_blocks(flat[s:s + chunk].to(device)).cpu())
    blocks = torch.cat(parts).numpy()
    return blocks.reshape(*arr.shape[:-1], arr.shape[-1] // QK * BLOCK_BYTES)
