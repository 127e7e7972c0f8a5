"""Pure-PyTorch attention: the CPU fallback, the test oracle, and forward-over-reverse.

Everything here is made of differentiable torch ops, so reverse mode, forward mode and every
``torch.func`` transform work through it natively. It materialises the (Lq, Lk) score matrix:
memory grows with Lq * Lk, which is why the Triton kernels exist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

Tensor = torch.Tensor


def _expand_kv(x: Tensor, n_q_heads: int) -> Tensor:
    """(..., Hkv, L, E) -> (..., Hq, L, E): query head h uses kv head h // (Hq // Hkv)."""
    return x.repeat_interleave(n_q_heads // x.shape[-3], dim=-3)


def _sum_groups(x: Tensor, n_kv_heads: int) -> Tensor:
    """(..., Hq, L, E) -> (..., Hkv, L, E): sum each kv head's query group."""
    *lead, hq, l, e = x.shape
    return x.reshape(*lead, n_kv_heads, hq // n_kv_heads, l, e).sum(-3)


def _causal_keep(lq: int, lk: int, device: torch.device) -> Tensor:
    """SDPA's top-left causal mask: query i attends keys j <= i."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    upcast: bool = True,
) -> Tensor:
    """softmax(scale * q k^T [+ causal mask]) v in plain torch ops (the CPU fallback).

    Shapes as SDPA: q (..., Hq, Lq, E), k (..., Hkv, Lk, E), v (..., Hkv, Lk, Ev) ->
    (..., Hq, Lq, Ev). With ``upcast`` the math runs in float32 (float64 stays float64) and
    the result is cast back to q's dtype. Rows with no visible key give zeros.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = _compute_dtype(q.dtype) if upcast else q.dtype
    qc, kc, vc = (x.to(dtype) for x in (q, k, v))
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        kc, vc = _expand_kv(kc, q.shape[-3]), _expand_kv(vc, q.shape[-3])
    p = _softmax_probs(qc, kc, scale, is_causal)
    return (p @ vc).to(q.dtype)


def _softmax_probs(q: Tensor, k: Tensor, scale: float, is_causal: bool) -> Tensor:
    s = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        s = s.masked_fill(~_causal_keep(s.shape[-2], s.shape[-1], s.device), -math.inf)
    # The softmax math SDPA uses (torch >= 2.5): rows with every key masked give zeros.
    return torch.ops.aten._safe_softmax(s, -1)


def _tangents(dtype, hq, pairs):
    """Cast tangents to ``dtype`` (None -> zeros like the primal), expanding kv heads to hq."""
    out = []
    for t, like, is_kv in pairs:
        t = torch.zeros_like(like) if t is None else t.to(dtype)
        out.append(_expand_kv(t, hq) if is_kv and t.shape[-3] != hq else t)
    return out


def attention_jvp(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_t: Tensor | None,
    k_t: Tensor | None,
    v_t: Tensor | None,
    scale: float,
    is_causal: bool,
) -> Tensor:
    """Tangent o_t of attention for tangents of q, k, v (None = zero), in closed form.

    S_t = scale (q_t k^T + q k_t^T), P_t = P o (S_t - rowsum(P o S_t)), o_t = P_t v + P v_t,
    in float32 (float64 stays float64), cast to q's dtype. Shapes as :func:`attention_ref`.
    Used where the fused kernel cannot run (tensors wrapped by an enclosing torch.func
    transform, e.g. ``torch.func.jvp(torch.func.grad(f))``).
    """
    dtype = _compute_dtype(q.dtype)
    hq = q.shape[-3]
    q_, k_, v_ = q.to(dtype), _expand_kv(k.to(dtype), hq), _expand_kv(v.to(dtype), hq)
    q_t_, k_t_, v_t_ = _tangents(dtype, hq, ((q_t, q_, False), (k_t, k_, True), (v_t, v_, True)))
    p = _softmax_probs(q_, k_, scale, is_causal)
    s_t = scale * (q_t_ @ k_.transpose(-2, -1) + q_ @ k_t_.transpose(-2, -1))
    p_t = p * (s_t - (p * s_t).sum(-1, keepdim=True))
    return (p_t @ v_ + p @ v_t_).to(q.dtype)


def attention_bwd_jvp(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    q_t: Tensor | None,
    k_t: Tensor | None,
    v_t: Tensor | None,
    do_t: Tensor | None,
    scale: float,
    is_causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Tangents of (dq, dk, dv) — forward-over-reverse — for tangents of q, k, v and do.

    Differentiates the backward formulas (P = softmax(S), dV = P^T dO, dP = dO V^T,
    delta = rowsum(P o dP), dS = P o (dP - delta), dQ = s dS K, dK = s dS^T Q) along the
    tangents, in closed form, in float32 (float64 stays float64); None tangents count as zero.
    Shapes as :func:`attention_ref`; returns tensors shaped and typed like q, k, v.
    """
    dtype = _compute_dtype(q.dtype)
    hq, hkv = q.shape[-3], k.shape[-3]
    q_, do_ = q.to(dtype), do.to(dtype)
    k_, v_ = _expand_kv(k.to(dtype), hq), _expand_kv(v.to(dtype), hq)
    q_t_, k_t_, v_t_, do_t_ = _tangents(
        dtype, hq, ((q_t, q_, False), (k_t, k_, True), (v_t, v_, True), (do_t, do_, False))
    )

    p = _softmax_probs(q_, k_, scale, is_causal)
    s_t = scale * (q_t_ @ k_.transpose(-2, -1) + q_ @ k_t_.transpose(-2, -1))
    p_t = p * (s_t - (p * s_t).sum(-1, keepdim=True))
    dp = do_ @ v_.transpose(-2, -1)
    dp_t = do_t_ @ v_.transpose(-2, -1) + do_ @ v_t_.transpose(-2, -1)
    delta = (p * dp).sum(-1, keepdim=True)
    delta_t = (p_t * dp + p * dp_t).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    ds_t = p_t * (dp - delta) + p * (dp_t - delta_t)

    dq_t = scale * (ds_t @ k_ + ds @ k_t_)
    dk_t = scale * (ds_t.transpose(-2, -1) @ q_ + ds.transpose(-2, -1) @ q_t_)
    dv_t = p_t.transpose(-2, -1) @ do_ + p.transpose(-2, -1) @ do_t_
    return dq_t.to(q.dtype), _sum_groups(dk_t, hkv).to(k.dtype), _sum_groups(dv_t, hkv).to(v.dtype)


@dataclass
class Outputs:
    """o, its tangent o_t and the gradients of sum(o * do) for one input set."""

    o: Tensor
    o_t: Tensor
    dq: Tensor
    dk: Tensor
    dv: Tensor

    def as_dict(self) -> dict[str, Tensor]:
        return {"o": self.o, "o_t": self.o_t, "dq": self.dq, "dk": self.dk, "dv": self.dv}


def run_outputs(fn, q, k, v, tangents, do, **kwargs) -> Outputs:
    """Evaluate ``fn(q, k, v, **kwargs)`` with ``torch.func.jvp`` (missing tangents = zeros)
    and its gradients with ``torch.autograd.grad`` for the cotangent ``do``."""
    tangents = tuple(torch.zeros_like(x) if t is None else t for x, t in zip((q, k, v), tangents))
    o, o_t = torch.func.jvp(lambda q, k, v: fn(q, k, v, **kwargs), (q, k, v), tangents)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with torch.enable_grad():
        out = fn(*leaves, **kwargs)
        dq, dk, dv = torch.autograd.grad(out, leaves, do)
    return Outputs(o.detach(), o_t.detach(), dq, dk, dv)


def math_sdpa(q, k, v, **kwargs) -> Tensor:
    """torch's own scaled_dot_product_attention on the math backend (forward AD works there)."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def sdpa_outputs(
    q, k, v, tangents, do, dtype: torch.dtype | None = torch.float64, fn=math_sdpa, **kwargs
):
    """The oracle: :func:`run_outputs` of math SDPA (or ``fn``, a function of it) on copies
    in ``dtype`` (None: as given).

    With float64 this is the reference every result is measured against; with the inputs'
    own dtype it measures what PyTorch itself gets, which sets the tolerance.
    """

    def cast(x):
        return None if x is None else x.detach().to(dtype or x.dtype)

    return run_outputs(
        fn, cast(q), cast(k), cast(v), tuple(cast(t) for t in tangents), cast(do), **kwargs
    )
