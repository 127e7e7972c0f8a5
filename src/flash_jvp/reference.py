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
from torch.nn.attention.bias import CausalBias, CausalVariant

from ._utils import Spec

Tensor = torch.Tensor


def _expand_kv(x: Tensor, n_q_heads: int) -> Tensor:
    """(..., Hkv, L, E) -> (..., Hq, L, E): query head h uses kv head h // (Hq // Hkv)."""
    return x.repeat_interleave(n_q_heads // x.shape[-3], dim=-3)


def _sum_groups(x: Tensor, n_kv_heads: int) -> Tensor:
    """(..., Hq, L, E) -> (..., Hkv, L, E): sum each kv head's query group."""
    *lead, hq, l, e = x.shape
    return x.reshape(*lead, n_kv_heads, hq // n_kv_heads, l, e).sum(-3)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def causal_offset(is_causal: bool, attn_mask, lq: int, lk: int) -> int | None:
    """The causal diagonal as an offset (query i sees keys j <= i + offset), or None.

    ``is_causal`` and ``causal_upper_left`` objects are top-left (0);
    ``causal_lower_right`` is bottom-right (lk - lq).
    """
    if isinstance(attn_mask, CausalBias):
        return 0 if attn_mask.variant == CausalVariant.UPPER_LEFT else lk - lq
    return 0 if is_causal else None


def canonical_mask(attn_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """An additive mask with entries <= finfo(dtype).min set to -inf (the masking rule of
    flash_jvp: such keys are masked out exactly); boolean masks and None pass through."""
    if attn_mask is None or attn_mask.dtype == torch.bool:
        return attn_mask
    return attn_mask.masked_fill(attn_mask <= torch.finfo(dtype).min, -math.inf)


def _scores(q: Tensor, k: Tensor, scale: float, offset: int | None, mask, mask_min) -> Tensor:
    s = (q @ k.transpose(-2, -1)) * scale
    if offset is not None:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(offset)
        s = s.masked_fill(~keep, -math.inf)
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, -math.inf)
        else:
            # hidden entries filled after the sum: adding -inf would pass gradients (and
            # tangents) into them, NaN once a whole row is hidden (found by an adversarial run)
            hidden = mask <= mask_min
            s = (s + mask.to(s.dtype).masked_fill(hidden, 0.0)).masked_fill(hidden, -math.inf)
    return s


def _softmax_probs(q, k, scale, offset=None, mask=None, mask_min=-math.inf) -> Tensor:
    return _softmax_lse(_scores(q, k, scale, offset, mask, mask_min))[0]


def _softmax_lse(s: Tensor) -> tuple[Tensor, Tensor]:
    """(P, lse): softmax of the scores over the last dim and their log-sum-exp, as math SDPA
    (torch >= 2.5) has them: a row with every key masked (-inf) gives P = 0, lse = -inf.

    In plain ops: torch's forward-AD formulas of softmax, _safe_softmax and logsumexp write
    into a tensor that reverse mode saved, so a backward through a ``forward_ad`` tangent
    failed (pytorch/pytorch#162350). The row max is a shift both results are invariant to,
    so it is detached (and 0 where no key exists: amax refuses an empty dim); masked rows
    divide by and take the log of 1, not 0 (no NaN in the backward of the branch
    ``torch.where`` drops)."""
    visible = (s != -math.inf).any(-1, keepdim=True)
    row_max = s.amax(-1, keepdim=True) if s.shape[-1] else torch.zeros_like(visible, dtype=s.dtype)
    shift = torch.where(visible, row_max, 0.0).detach()
    e = torch.exp(s - shift)
    total = torch.where(visible, e.sum(-1, keepdim=True), 1.0)
    lse = torch.where(visible, shift + torch.log(total), -math.inf)
    return e / total, lse.squeeze(-1)


def attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    upcast: bool = True,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """softmax(scale * q k^T [+ mask]) v in plain torch ops (the CPU fallback); with
    ``return_lse`` also the scores' log-sum-exp (..., Hq, Lq), float32 (float64 stays float64),
    -inf for rows with no visible key.

    Arguments and shapes as SDPA: q (..., Hq, Lq, E), k (..., Hkv, Lk, E), v (..., Hkv, Lk,
    Ev) -> (..., Hq, Lq, Ev); ``attn_mask`` boolean, additive, or a ``CausalBias``. With
    ``upcast`` the math runs in float32 (float64 stays float64) and the result is cast back
    to q's dtype. Additive entries <= finfo(q.dtype).min mask their key out exactly; rows with
    no visible key give zeros. Key/value heads fewer than query heads are shared by groups of
    query heads whether or not ``enable_gqa`` is set (it is taken for SDPA's signature; the
    callers validate it).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    offset = causal_offset(is_causal, attn_mask, q.shape[-2], k.shape[-2])
    mask = None if isinstance(attn_mask, CausalBias) else attn_mask
    dtype = _compute_dtype(q.dtype) if upcast else q.dtype
    o, lse = _attend(q, k, v, mask, scale, offset, dtype)
    return (o, lse) if return_lse else o


def _attend(q, k, v, mask, scale: float, offset: int | None, dtype: torch.dtype):
    """(o, lse): o = softmax(scale q k^T [+ causal] [+ mask]) v computed in ``dtype``, cast to
    q's dtype, and lse the scores' log-sum-exp in ``dtype`` (-inf for rows with no visible
    key, whose o is 0); k and v with fewer heads than q are shared by groups of query heads
    (GQA)."""
    qc, kc, vc = (x.to(dtype) for x in (q, k, v))
    if k.shape[-3] != q.shape[-3]:
        kc, vc = _expand_kv(kc, q.shape[-3]), _expand_kv(vc, q.shape[-3])
    s = _scores(qc, kc, scale, offset, mask, torch.finfo(q.dtype).min)
    p, lse = _softmax_lse(s)
    return (p @ vc).to(q.dtype), lse


def attention_spec(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: Spec):
    """(o, lse) as :func:`attention_ref` computes them, on the launchers' arguments: q, k, v
    (B, H, L, E), or packed (total, H, E) with ``spec.varlen`` (lse then (H, total_q)), a
    boolean/additive ``mask`` broadcasting to the scores, scale and causal offset from
    ``spec``; computed in float32 (float64 stays float64)."""
    if spec.varlen:
        is_causal = spec.causal_offset is not None
        return varlen_attention_dense(
            q, k, v, spec.cu_seqlens_q, spec.cu_seqlens_k, is_causal, spec.scale, with_lse=True
        )
    return _attend(q, k, v, mask, spec.scale, spec.causal_offset, _compute_dtype(q.dtype))


def varlen_attention_dense(
    q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=False, scale=None, with_lse: bool = False
):
    """:func:`flash_jvp.varlen_attention` as one dense attention over all packed tokens with a
    block-diagonal mask (:func:`varlen_mask`): no host copy of ``cu_seqlens`` and no
    data-dependent shapes, so it traces under torch.compile. Materialises (total_q, total_k)
    scores per head; computed in float32 (float64 stays float64). Returns o (total_q, Hq, Ev)
    and, with ``with_lse``, lse (Hq, total_q)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = varlen_mask(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], is_causal)
    o, lse = _attend(*(x.transpose(0, 1) for x in (q, k, v)), mask, scale, None,
                     _compute_dtype(q.dtype))  # fmt: skip
    return (o.transpose(0, 1), lse) if with_lse else o.transpose(0, 1)


def varlen_mask(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, is_causal: bool):
    """(total_q, total_k) boolean: packed query i sees the keys of its own sequence, with
    ``is_causal`` those at most its own position in it (top-left aligned)."""
    seq_q, pos_q = _seq_positions(cu_seqlens_q, total_q)
    seq_k, pos_k = _seq_positions(cu_seqlens_k, total_k)
    mask = seq_q[:, None] == seq_k[None, :]
    return mask & (pos_k[None, :] <= pos_q[:, None]) if is_causal else mask


def _seq_positions(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Per packed token: the index of its sequence and its position within it."""
    tokens = torch.arange(total, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens, tokens, right=True) - 1
    return seq, tokens - cu_seqlens.long()[seq]


def varlen_attention_ref(
    q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=False, scale=None, fn=attention_ref
):
    """:func:`flash_jvp.varlen_attention` one sequence at a time through ``fn`` (an SDPA-like
    function, :func:`attention_ref` by default): packed q (total_q, Hq, E), k/v
    (total_k, Hkv, E|Ev) -> (total_q, Hq, Ev)."""
    outs = [
        fn(qs, ks, vs, is_causal=is_causal, scale=scale, enable_gqa=True)
        for qs, ks, vs in _sequences(cu_seqlens_q, cu_seqlens_k, (q,), (k, v))
    ]
    return _pack(outs, q, v.shape[-1])


def _sequences(cu_seqlens_q, cu_seqlens_k, rows: tuple, keys: tuple):
    """Per packed sequence: the tensors of ``rows`` (indexed by query) and ``keys`` (by key)
    cut to that sequence, as (H, L, E) views (None stays None)."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        r, c = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        cut = [None if x is None else x[r].transpose(0, 1) for x in rows]
        cut += [None if x is None else x[c].transpose(0, 1) for x in keys]
        yield cut


def _pack(outs: list[Tensor], q: Tensor, ev: int) -> Tensor:
    if not outs:
        return q.new_zeros(*q.shape[:-1], ev)
    return torch.cat([o.transpose(0, 1) for o in outs], dim=0)


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
    mask: Tensor | None,
    mask_t: Tensor | None,
    spec: Spec,
) -> tuple[Tensor, Tensor]:
    """Tangents (o_t, mu) of attention's output and log-sum-exp for tangents of q, k, v and
    an additive mask (None = zero), in closed form.

    S_t = scale (q_t k^T + q k_t^T) + mask_t, mu = rowsum(P o S_t) (the tangent of lse),
    P_t = P o (S_t - mu), o_t = P_t v + P v_t, in float32 (float64 stays float64); o_t cast
    to q's dtype. Shapes as :func:`attention_ref`, or packed with ``spec.varlen`` (mu then
    (H, total_q), like lse). Used where the fused kernel cannot run (tensors wrapped by an
    enclosing torch.func transform).
    """
    if spec.varlen:  # one dense problem with a block-diagonal mask, (H, total, E)
        mask = varlen_mask(spec.cu_seqlens_q, spec.cu_seqlens_k, q.shape[0], k.shape[0],
                           spec.causal_offset is not None)  # fmt: skip
        rows = [None if x is None else x.transpose(0, 1) for x in (q, k, v, q_t, k_t, v_t)]
        o_t, mu = attention_jvp(*rows[:3], *rows[3:], mask, None, Spec(spec.scale))
        return o_t.transpose(0, 1), mu
    dtype = _compute_dtype(q.dtype)
    hq = q.shape[-3]
    q_, k_, v_ = q.to(dtype), _expand_kv(k.to(dtype), hq), _expand_kv(v.to(dtype), hq)
    q_t_, k_t_, v_t_ = _tangents(dtype, hq, ((q_t, q_, False), (k_t, k_, True), (v_t, v_, True)))
    p = _softmax_probs(q_, k_, spec.scale, spec.causal_offset, mask, torch.finfo(q.dtype).min)
    p_s_t = p * _tangent_scores(q_, k_, q_t_, k_t_, mask_t, spec.scale)
    mu = p_s_t.sum(-1)
    p_t = p_s_t - p * mu[..., None]
    return (p_t @ v_ + p @ v_t_).to(q.dtype), mu


def _tangent_scores(q, k, q_t, k_t, mask_t, scale) -> Tensor:
    s_t = scale * (q_t @ k.transpose(-2, -1) + q @ k_t.transpose(-2, -1))
    return s_t if mask_t is None else s_t + mask_t.to(s_t.dtype)


def attention_bwd_jvp(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    q_t: Tensor | None,
    k_t: Tensor | None,
    v_t: Tensor | None,
    do_t: Tensor | None,
    mask: Tensor | None,
    mask_t: Tensor | None,
    spec: Spec,
    mask_grad: bool = False,
    dlse: Tensor | None = None,
    dlse_t: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """Tangents of (dq, dk, dv[, dmask]) — forward-over-reverse — for tangents of q, k, v,
    do, an additive mask and the log-sum-exp's cotangent.

    Differentiates the backward formulas (P = softmax(S), dV = P^T dO, dP = dO V^T,
    delta = rowsum(P o dP), dS = P o (dP - delta + dlse), dQ = s dS K, dK = s dS^T Q,
    dmask = dS) along the tangents, in closed form, in float32 (float64 stays float64); None
    tangents (and a None dlse) count as zero. Returns tensors shaped and typed like q, k, v
    (and the mask with ``mask_grad``, summed over its broadcast dims). Packed
    (``spec.varlen``) inputs are one dense problem with a block-diagonal mask.
    """
    if spec.varlen:
        mask = varlen_mask(spec.cu_seqlens_q, spec.cu_seqlens_k, q.shape[0], k.shape[0],
                           spec.causal_offset is not None)  # fmt: skip
        rows = [
            None if x is None else x.transpose(0, 1) for x in (q, k, v, do, q_t, k_t, v_t, do_t)
        ]
        grads = attention_bwd_jvp(*rows, mask, None, Spec(spec.scale), False, dlse, dlse_t)
        return tuple(g.transpose(0, 1) for g in grads)
    dtype = _compute_dtype(q.dtype)
    hq, hkv = q.shape[-3], k.shape[-3]
    q_, do_ = q.to(dtype), do.to(dtype)
    k_, v_ = _expand_kv(k.to(dtype), hq), _expand_kv(v.to(dtype), hq)
    q_t_, k_t_, v_t_, do_t_ = _tangents(
        dtype, hq, ((q_t, q_, False), (k_t, k_, True), (v_t, v_, True), (do_t, do_, False))
    )

    p = _softmax_probs(q_, k_, spec.scale, spec.causal_offset, mask, torch.finfo(q.dtype).min)
    s_t = _tangent_scores(q_, k_, q_t_, k_t_, mask_t, spec.scale)
    p_t = p * (s_t - (p * s_t).sum(-1, keepdim=True))
    dp = do_ @ v_.transpose(-2, -1)
    dp_t = do_t_ @ v_.transpose(-2, -1) + do_ @ v_t_.transpose(-2, -1)
    delta = (p * dp).sum(-1, keepdim=True)
    delta_t = (p_t * dp + p * dp_t).sum(-1, keepdim=True)
    if dlse is not None:  # lse's cotangent: dS gains P * dlse
        delta = delta - dlse.to(dtype)[..., None]
    if dlse_t is not None:
        delta_t = delta_t - dlse_t.to(dtype)[..., None]
    ds = p * (dp - delta)
    ds_t = p_t * (dp - delta) + p * (dp_t - delta_t)

    scale = spec.scale
    dq_t = scale * (ds_t @ k_ + ds @ k_t_)
    dk_t = scale * (ds_t.transpose(-2, -1) @ q_ + ds.transpose(-2, -1) @ q_t_)
    dv_t = p_t.transpose(-2, -1) @ do_ + p.transpose(-2, -1) @ do_t_
    out = (dq_t.to(q.dtype), _sum_groups(dk_t, hkv).to(k.dtype), _sum_groups(dv_t, hkv).to(v.dtype))
    if mask_grad:
        out += (ds_t.sum_to_size(mask.shape).to(mask.dtype),)
    return out


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


def varlen_math_sdpa(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=False, scale=None):
    """The varlen oracle: math SDPA on each packed sequence separately."""
    return varlen_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal, scale, math_sdpa)


def sdpa_outputs(
    q, k, v, tangents, do, dtype: torch.dtype | None = torch.float64, fn=math_sdpa, **kwargs
):
    """The oracle: :func:`run_outputs` of math SDPA (or ``fn``, a function of it) on copies
    in ``dtype`` (None: as given).

    With float64 this is the reference every result is measured against; with the inputs'
    own dtype it measures what PyTorch itself gets, which sets the tolerance. An additive
    ``attn_mask`` goes through :func:`canonical_mask` (flash_jvp's masking rule) and is cast
    too; ``CausalBias`` objects are materialised.
    """

    def cast(x):
        return None if x is None else x.detach().to(dtype or x.dtype)

    mask = kwargs.get("attn_mask")
    if isinstance(mask, CausalBias):
        kwargs["attn_mask"] = mask._materialize(q.device)
    elif isinstance(mask, Tensor) and mask.dtype != torch.bool:
        kwargs["attn_mask"] = cast(canonical_mask(mask, q.dtype))
    return run_outputs(
        fn, cast(q), cast(k), cast(v), tuple(cast(t) for t in tangents), cast(do), **kwargs
    )


def attention_tangent_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_t: Tensor | None,
    k_t: Tensor | None,
    v_t: Tensor | None,
    mask: Tensor | None,
    mask_t: Tensor | None,
    do: Tensor | None,
    do_t: Tensor | None,
    spec: Spec,
    dlse: Tensor | None = None,
    dmu: Tensor | None = None,
    mask_grad: bool = False,
    mask_t_grad: bool = False,
) -> tuple[Tensor | None, ...]:
    """Reverse mode through attention and its JVP: the gradients of
    ``sum(o * do) + sum(o_t * do_t) + sum(lse * dlse) + sum(mu * dmu)`` with respect to q, k,
    v, their tangents and (an additive) mask and its tangent, in closed form.

    Here o = P v, lse = logsumexp(S), P = softmax(S), S = scale q k^T [+ mask], and along the
    tangents S_t = scale (q_t k^T + q k_t^T) [+ mask_t], mu = rowsum(P o S_t) (the tangent
    of lse), P_t = P o (S_t - mu), o_t = P_t v + P v_t (see :func:`attention_jvp`). With the
    per-row statistics

        delta = rowsum(do o o) + rowsum(do_t o o_t) - dlse,
        gamma = rowsum(do_t o o) - dmu,

    the score gradients are

        dS_t = P o (do_t v^T - gamma),
        dS   = P o (do v^T + do_t v_t^T - delta) + dS_t o (S_t - mu),

    and the inputs' gradients follow from S and S_t being bilinear in (q, k) and (q_t, k_t):

        dq   = scale (dS k + dS_t k_t),     dq_t = scale dS_t k,
        dk   = scale (dS^T q + dS_t^T q_t), dk_t = scale dS_t^T q,
        dv   = P^T do + P_t^T do_t,         dv_t = P^T do_t,
        dmask = dS, dmask_t = dS_t (summed over the mask's broadcast dims).

    Derivation (ours, checked against float64 autograd in tests/test_reference.py): from
    o_t = P_t v + P v_t, dP_t = do_t v^T and dP gains do_t v_t^T; P_t = P o (S_t - mu) gives
    dS_t = P o (dP_t - rowsum(P o dP_t)), where rowsum(P o do_t v^T) = rowsum(do_t o o),
    and dP gains dP_t o (S_t - mu) - S_t rowsum(do_t o o) (mu = rowsum(P o S_t) depends on
    P). The softmax backward dS = P o (dP - rowsum(P o dP)) then subtracts, beside the
    usual rowsum(do o o), rowsum(do_t o o_t) - mu rowsum(do_t o o) (the first two terms of dP
    sum to o_t against do_t). Collecting dP_t o (S_t - mu) - S_t gamma + mu gamma =
    (dP_t - gamma) o (S_t - mu) turns the issue's form into the centred one above: no
    product of S_t with a row constant is left to cancel against another. A cotangent of
    lse adds P dlse to dS; one of mu adds P dmu to dS_t (and so dS_t o (S_t - mu) to dS).

    Computed in float32 (float64 stays float64); None tangents and cotangents count as zero.
    Returns (dq, dk, dv, dq_t, dk_t, dv_t, dmask, dmask_t): dq..dv_t shaped and typed like q,
    k, v (GQA: summed over each kv head's group), dq_t/dk_t/dv_t None where the tangent is
    None, dmask/dmask_t None unless ``mask_grad`` / ``mask_t_grad``. Shapes as
    :func:`attention_ref`, or packed (total, H, E) with ``spec.varlen`` (dlse, dmu then
    (H, total_q)). Materialises the (Lq, Lk) scores: the fused kernels' oracle and the path
    for tensors wrapped by torch.func transforms.
    """
    if spec.varlen:
        return _varlen_tangent_bwd(q, k, v, q_t, k_t, v_t, do, do_t, spec, dlse, dmu)
    dtype = _compute_dtype(q.dtype)
    hq, hkv = q.shape[-3], k.shape[-3]
    q_, k_, v_ = q.to(dtype), _expand_kv(k.to(dtype), hq), _expand_kv(v.to(dtype), hq)
    q_t_, k_t_, v_t_ = _tangents(dtype, hq, ((q_t, q_, False), (k_t, k_, True), (v_t, v_, True)))
    o_shape = (*q.shape[:-1], v.shape[-1])
    do_ = q_.new_zeros(o_shape) if do is None else do.to(dtype)
    do_t_ = q_.new_zeros(o_shape) if do_t is None else do_t.to(dtype)

    p = _softmax_probs(q_, k_, spec.scale, spec.causal_offset, mask, torch.finfo(q.dtype).min)
    s_t = _tangent_scores(q_, k_, q_t_, k_t_, mask_t, spec.scale)
    s_t = torch.where(p == 0, 0.0, s_t)  # masked keys: keep inf/NaN of a mask_t out
    mu = (p * s_t).sum(-1, keepdim=True)
    p_t = p * (s_t - mu)
    o, o_t = p @ v_, p_t @ v_ + p @ v_t_
    delta = (do_ * o).sum(-1, keepdim=True) + (do_t_ * o_t).sum(-1, keepdim=True)
    gamma = (do_t_ * o).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(dtype)[..., None]
    if dmu is not None:
        gamma = gamma - dmu.to(dtype)[..., None]
    ds_t = p * (do_t_ @ v_.transpose(-2, -1) - gamma)
    dp = do_ @ v_.transpose(-2, -1) + do_t_ @ v_t_.transpose(-2, -1)
    ds = p * (dp - delta) + ds_t * (s_t - mu)

    scale = spec.scale
    dq = scale * (ds @ k_ + ds_t @ k_t_)
    dk = scale * (ds.transpose(-2, -1) @ q_ + ds_t.transpose(-2, -1) @ q_t_)
    dv = p.transpose(-2, -1) @ do_ + p_t.transpose(-2, -1) @ do_t_
    dq_t = scale * (ds_t @ k_)
    dk_t = scale * (ds_t.transpose(-2, -1) @ q_)
    dv_t = p.transpose(-2, -1) @ do_t_
    kv = (k.dtype, hkv)
    out = (
        dq.to(q.dtype), _kv_grad(dk, *kv), _kv_grad(dv, v.dtype, hkv),
        None if q_t is None else dq_t.to(q.dtype),
        None if k_t is None else _kv_grad(dk_t, *kv),
        None if v_t is None else _kv_grad(dv_t, v.dtype, hkv),
        ds.sum_to_size(mask.shape).to(mask.dtype) if mask_grad else None,
        ds_t.sum_to_size(mask.shape).to(mask.dtype) if mask_t_grad else None,
    )  # fmt: skip
    return out


def _kv_grad(x: Tensor, dtype: torch.dtype, hkv: int) -> Tensor:
    return _sum_groups(x, hkv).to(dtype)


def _varlen_tangent_bwd(q, k, v, q_t, k_t, v_t, do, do_t, spec: Spec, dlse, dmu):
    """:func:`attention_tangent_bwd` of packed (total, H, E) sequences: one dense problem
    over all tokens with a block-diagonal mask, (H, total, E) views."""
    mask = varlen_mask(spec.cu_seqlens_q, spec.cu_seqlens_k, q.shape[0], k.shape[0],
                       spec.causal_offset is not None)  # fmt: skip
    rows = [None if x is None else x.transpose(0, 1) for x in (q, k, v, q_t, k_t, v_t, do, do_t)]
    grads = attention_tangent_bwd(*rows[:6], mask, None, *rows[6:], Spec(spec.scale), dlse, dmu)
    return tuple(None if g is None else g.transpose(0, 1) for g in grads[:6]) + (None, None)
