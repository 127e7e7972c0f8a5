"""The pure-PyTorch reference: equal to torch's SDPA, and its closed-form JVP formulas exact."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_rel

from flash_jvp import reference
from flash_jvp._utils import Spec

CAUSAL = pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])


def _inputs(Hq=4, Hkv=2, Lq=7, Lk=9, E=5, Ev=6):
    g = dict(dtype=torch.float64)
    q, k = torch.randn(2, Hq, Lq, E, **g), torch.randn(2, Hkv, Lk, E, **g)
    v = torch.randn(2, Hkv, Lk, Ev, **g)
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))
    return q, k, v, tangents


@CAUSAL
def test_attention_ref_equals_math_sdpa(is_causal):
    q, k, v, tangents = _inputs()
    do = torch.randn(2, 4, 7, 6, dtype=torch.float64)
    kw = dict(is_causal=is_causal, enable_gqa=True, scale=0.7)
    ours = reference.run_outputs(reference.attention_ref, q, k, v, tangents, do, **kw)
    ref = reference.run_outputs(reference.math_sdpa, q, k, v, tangents, do, **kw)
    for name, x in ours.as_dict().items():
        assert_close_rel(name, x, getattr(ref, name), 1e-12)


@CAUSAL
def test_attention_ref_gradcheck(is_causal):
    q, k, v, _ = _inputs(Hq=2, Hkv=1, Lq=3, Lk=4, E=3, Ev=2)
    args = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: reference.attention_ref(q, k, v, is_causal=is_causal, enable_gqa=True),
        args, check_forward_ad=True, check_backward_ad=True,
    )  # fmt: skip


def _spec(scale, is_causal):
    return Spec(scale, 0 if is_causal else None)


@CAUSAL
def test_closed_form_jvp_equals_autodiff(is_causal):
    """attention_jvp (the formulas the kernel implements: o_t and lse's tangent mu) ==
    torch.func.jvp of attention_ref."""
    q, k, v, tangents = _inputs()
    scale = 0.4
    o_t, mu = reference.attention_jvp(q, k, v, *tangents, None, None, _spec(scale, is_causal))
    _, (o_t_ref, mu_ref) = torch.func.jvp(
        lambda q, k, v: reference.attention_ref(
            q, k, v, None, is_causal, scale, enable_gqa=True, return_lse=True
        ),
        (q, k, v), tangents,
    )  # fmt: skip
    assert_close_rel("o_t", o_t, o_t_ref, 1e-12)
    assert_close_rel("mu (lse's tangent)", mu, mu_ref, 1e-12)


@CAUSAL
def test_closed_form_forward_over_reverse_equals_autodiff(is_causal):
    q, k, v, tangents = _inputs()
    do, do_t = torch.randn(2, 2, 4, 7, 6, dtype=torch.float64).unbind(0)
    scale = 0.4

    def grads(q, k, v, do):
        _, vjp = torch.func.vjp(
            lambda q, k, v: reference.attention_ref(q, k, v, None, is_causal, scale, True),
            q, k, v,
        )  # fmt: skip
        return vjp(do)

    _, ref = torch.func.jvp(grads, (q, k, v, do), (*tangents, do_t))
    ours = reference.attention_bwd_jvp(
        q, k, v, do, *tangents, do_t, None, None, _spec(scale, is_causal)
    )
    for name, a, b in zip(("dq_t", "dk_t", "dv_t"), ours, ref):
        assert_close_rel(name, a, b, 1e-12)


# ------------------------------------------------ reverse mode through (o, o_t, lse, mu)
def _scores64(q, k, mask, scale, offset):
    """S with GQA expansion, the causal offset and a boolean/additive mask (float64). An
    additive mask's -inf entries are applied as a boolean mask (masked_fill): autograd of
    the JVP through s + (-inf) gives NaN where the (exact) gradient there is 0."""
    k = reference._expand_kv(k, q.shape[-3])
    if mask is None or mask.dtype == torch.bool:
        return reference._scores(q, k, scale, offset, mask, None)
    keep = mask != float("-inf")
    s = reference._scores(q, k, scale, offset, None, None) + torch.where(keep, mask, 0.0)
    return s.masked_fill(~keep, float("-inf"))


def _attn_with_lse(q, k, v, mask, scale, offset):
    """(o, lse) of plain attention in float64 (lse = -inf -> 0 for fully masked rows)."""
    s = _scores64(q, k, mask, scale, offset)
    p = torch.ops.aten._safe_softmax(s, -1)
    visible = (s != float("-inf")).any(-1)
    lse = torch.logsumexp(torch.where(visible[..., None], s, 0.0), -1)
    return p @ reference._expand_kv(v, q.shape[-3]), torch.where(visible, lse, 0.0)


def _autograd_tangent_bwd(q, k, v, tangents, mask, mask_t, cots, scale, offset):
    """Gradients of sum(o do) + sum(o_t do_t) + sum(lse dlse) + sum(mu dmu) by autograd of
    torch.func.jvp of the plain formula: the oracle of attention_tangent_bwd."""
    additive = mask is not None and mask.dtype != torch.bool
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, *tangents)]
    m_leaves = [m.detach().clone().requires_grad_() for m in (mask, mask_t)] if additive else []
    m, m_t = m_leaves if additive else (mask, None)

    def fn(q, k, v, m):
        return _attn_with_lse(q, k, v, m, scale, offset)

    if additive:
        (o, lse), (o_t, mu) = torch.func.jvp(fn, (*leaves[:3], m), (*leaves[3:], m_t))
    else:
        (o, lse), (o_t, mu) = torch.func.jvp(lambda q, k, v: fn(q, k, v, m), tuple(leaves[:3]),
                                             tuple(leaves[3:]))  # fmt: skip
    do, do_t, dlse, dmu = cots
    loss = (o * do).sum() + (o_t * do_t).sum() + (lse * dlse).sum() + (mu * dmu).sum()
    return torch.autograd.grad(loss, leaves + m_leaves)


TANGENT_BWD_CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "lower_right": dict(offset=2),
    "bool_mask": dict(mask="bool"),
    "additive": dict(mask="additive"),
}


def _case_mask(kind, Hq, Lq, Lk):
    if kind == "bool":  # row 0 sees no key, other rows random keys
        m = torch.rand(2, 1, Lq, Lk) > 0.4
        m[:, :, 0] = False
        return m
    if kind == "additive":  # some keys masked with -inf, a fully masked row
        m = torch.randn(1, Hq, Lq, Lk, dtype=torch.float64)
        m[..., 1, :] = float("-inf")
        return m.masked_fill(torch.rand(1, Hq, Lq, Lk) > 0.7, float("-inf"))
    return None


@pytest.mark.parametrize("case", list(TANGENT_BWD_CASES))
@pytest.mark.parametrize("subset", ["qkv", "q", "kv", "v"])
def test_closed_form_tangent_backward_equals_autodiff(case, subset):
    """attention_tangent_bwd (the formulas the fused kernels implement) == autograd of
    torch.func.jvp of plain attention in float64, for cotangents of o, o_t, lse and mu, with
    GQA, Lq != Lk, masks (a fully masked row included) and tangents on subsets."""
    cfg = TANGENT_BWD_CASES[case]
    q, k, v, tangents = _inputs()
    tangents = tuple(t if n in subset else None for n, t in zip("qkv", tangents))
    Lq, Lk = q.shape[-2], k.shape[-2]
    offset = cfg.get("offset", 0 if cfg.get("is_causal") else None)
    mask = _case_mask(cfg.get("mask"), q.shape[1], Lq, Lk)
    additive = cfg.get("mask") == "additive"
    mask_t = torch.randn_like(mask) if additive else None
    o_shape = (*q.shape[:-1], v.shape[-1])
    cots = (torch.randn(o_shape, dtype=torch.float64), torch.randn(o_shape, dtype=torch.float64),
            torch.randn(q.shape[:-1], dtype=torch.float64),
            torch.randn(q.shape[:-1], dtype=torch.float64))  # fmt: skip
    scale = 0.4
    full = tuple(torch.zeros_like(x) if t is None else t for x, t in zip((q, k, v), tangents))
    ref = _autograd_tangent_bwd(q, k, v, full, mask, mask_t, cots, scale, offset)
    ours = reference.attention_tangent_bwd(
        q, k, v, *tangents, mask, mask_t, cots[0], cots[1], Spec(scale, offset), *cots[2:],
        mask_grad=additive, mask_t_grad=additive,
    )  # fmt: skip
    names = ("dq", "dk", "dv", "dq_t", "dk_t", "dv_t", "dmask", "dmask_t")
    for name, a, b in zip(names, ours, ref + (None, None)):
        if name in ("dmask", "dmask_t") and not additive:
            continue
        if name[:2] in ("dq", "dk", "dv") and name.endswith("_t") and a is None:
            assert name[1] not in subset
            continue
        assert_close_rel(name, a, b, 1e-12)


def test_issue_form_of_tangent_backward_equals_centred_form():
    """The derivation as issue #18 wrote it (dP with S_t rowsum(G o O), dS subtracting
    rowsum(G o O_t) - mu rowsum(G o O)) gives the same dS as the centred form."""
    q, k, v, (q_t, k_t, v_t) = _inputs(Hq=2, Hkv=2)
    do, do_t = torch.randn(2, 2, 2, 7, 6, dtype=torch.float64).unbind(0)
    scale = 0.4
    p = reference._softmax_probs(q, k, scale)
    s_t = reference._tangent_scores(q, k, q_t, k_t, None, scale)
    mu = (p * s_t).sum(-1, keepdim=True)
    o, o_t = p @ v, (p * (s_t - mu)) @ v + p @ v_t
    gvt = do_t @ v.transpose(-2, -1)
    g_o, g_ot = (do_t * o).sum(-1, keepdim=True), (do_t * o_t).sum(-1, keepdim=True)
    dp = do @ v.transpose(-2, -1) + gvt * (s_t - mu) + do_t @ v_t.transpose(-2, -1) - s_t * g_o
    ds_issue = p * (dp - (do * o).sum(-1, keepdim=True) - (g_ot - mu * g_o))
    cots = torch.zeros(2, 2, 7, dtype=torch.float64)
    grads = reference.attention_tangent_bwd(q, k, v, q_t, k_t, v_t, None, None, do, do_t,
                                            Spec(scale), cots, cots)  # fmt: skip
    ds_t = p * (gvt - g_o)
    assert_close_rel("dq via the issue's dS", scale * (ds_issue @ k + ds_t @ k_t), grads[0], 1e-12)


@CAUSAL
def test_closed_form_tangent_backward_varlen(is_causal):
    """Packed sequences: each sequence's gradients as the dense closed form on it alone."""
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q, do, do_t, q_t = torch.randn(4, 8, 2, 5, dtype=torch.float64).unbind(0)
    k, v, k_t, v_t = torch.randn(4, 11, 1, 5, dtype=torch.float64).unbind(0)
    offset = 0 if is_causal else None
    spec = Spec(0.4, offset, cu, cu_k, 5, 5)
    ours = reference.attention_tangent_bwd(q, k, v, q_t, k_t, v_t, None, None, do, do_t, spec)
    for i in range(3):
        r, c = slice(cu[i], cu[i + 1]), slice(cu_k[i], cu_k[i + 1])
        rows = [x[r].transpose(0, 1) for x in (q, q_t, do, do_t)]
        keys = [x[c].transpose(0, 1) for x in (k, v, k_t, v_t)]
        ref = reference.attention_tangent_bwd(rows[0], *keys[:2], rows[1], *keys[2:], None, None,
                                              *rows[2:], Spec(0.4, offset))  # fmt: skip
        for name, a, b, sl in zip(("dq", "dk", "dv", "dq_t", "dk_t", "dv_t"), ours, ref,
                                  (r, c, c, r, c, c)):  # fmt: skip
            assert_close_rel(f"{name} seq {i}", a[sl], b.transpose(0, 1), 1e-12)


def test_autograd_of_jvp_gradcheck():
    """The oracle itself: autograd of torch.func.jvp's o_t and mu (float64) against finite
    differences, with GQA and a causal mask."""
    q, k, v, tangents = _inputs(Hq=2, Hkv=1, Lq=3, Lk=4, E=3, Ev=2)
    args = [x.requires_grad_() for x in (q, k, v, *tangents)]

    def o_t_and_mu(q, k, v, q_t, k_t, v_t):
        fn = lambda q, k, v: _attn_with_lse(q, k, v, None, 0.4, 0)  # noqa: E731
        return torch.func.jvp(fn, (q, k, v), (q_t, k_t, v_t))[1]

    assert torch.autograd.gradcheck(o_t_and_mu, args, fast_mode=True)
