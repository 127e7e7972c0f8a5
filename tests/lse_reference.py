"""The float64 oracle of the distributed tests: ``attention_with_lse`` in plain PyTorch,
written apart from flash_jvp (its fallback included), with the semantics of
``flash_jvp.attention_with_lse``: (o, lse), lse the natural-log log-sum-exp of the scaled
scores in float32 (float64 for float64 inputs), -inf (and o 0) for rows that see no key.

Plain torch ops, so reverse mode and forward mode differentiate it (the tangent of lse is
rowsum(P o S_t); its cotangent enters as dS += P dlse).
"""

from __future__ import annotations

import math

import torch


def attention_with_lse_ref(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    if attn_mask is not None or dropout_p:
        raise NotImplementedError("attention_with_lse_ref: no attn_mask, no dropout")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    q, k, v = (x.to(dtype) for x in (query, key, value))
    if k.shape[-3] != q.shape[-3]:
        k, v = (x.repeat_interleave(q.shape[-3] // x.shape[-3], dim=-3) for x in (k, v))
    s = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    m = m.masked_fill(m == -math.inf, 0.0)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    seen = total > 0
    total = torch.where(seen, total, 1.0)
    o = ((e / total) @ v).to(query.dtype)
    lse = torch.where(seen, m + torch.log(total), -math.inf).squeeze(-1)
    return o, lse
