"""attention_with_lse / varlen_attention(return_lse=True): the log-sum-exp, its tangent mu and
its cotangent, against float64 references, on the kernel path and the PyTorch fallback."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, assert_close_rel, randn
from torch.autograd import forward_ad as fwAD
from torch.nn.attention.bias import causal_lower_right

import flash_jvp
from flash_jvp import reference

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def _case(case: str, dtype):
    """q, k, v, their tangents and SDPA keyword arguments; masks leave some rows no key."""
    B, H, Lq, Lk, E = 2, 2, 37, 45, 16
    hkv = 1 if case == "gqa" else H
    q, k, v = (
        randn(B, H, Lq, E, dtype=dtype),
        randn(B, hkv, Lk, E, dtype=dtype),
        randn(B, hkv, Lk, E, dtype=dtype),
    )
    kw = {}
    if case == "causal":
        kw = {"is_causal": True}
    elif case == "gqa":
        kw = {"enable_gqa": True, "scale": 0.2}
    elif case == "key_padding":  # batch 1 keeps 20 keys; its last 5 query rows see none
        mask = torch.ones(B, 1, Lq, Lk, dtype=torch.bool, device=DEVICE)
        mask[1, :, :, 20:] = False
        mask[1, :, -5:] = False
        kw = {"attn_mask": mask}
    elif case == "additive":
        kw = {"attn_mask": randn(1, H, Lq, Lk, dtype=dtype)}
    elif case == "lower_right":
        kw = {"attn_mask": causal_lower_right(Lq, Lk)}
    tangents = tuple(randn(*x.shape, dtype=dtype) for x in (q, k, v))
    return q, k, v, tangents, kw


CASES = ["plain", "causal", "gqa", "key_padding", "additive", "lower_right"]


def _ref(q, k, v, kw):
    """attention_ref with lse, float64 (CausalBias materialised: the reference takes both)."""
    return reference.attention_ref(q, k, v, return_lse=True, **kw)


def _ref_kw(kw):
    """An additive mask in float64 (a CausalBias or boolean mask as it is)."""
    out = dict(kw)
    mask = out.get("attn_mask")
    if type(mask) is torch.Tensor and mask.dtype != torch.bool:
        out["attn_mask"] = mask.double()
    return out


def _assert_lse(name, lse, ref, tol):
    """Same rows at -inf (no visible key), the finite rest within tol (relative)."""
    assert lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(ref)), f"{name}: -inf rows differ"
    assert not lse.isnan().any(), name
    finite = torch.isfinite(ref)
    assert_close_rel(name, lse[finite], ref[finite], tol)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lse_and_its_tangent_match_float64(case, dtype, path):
    """o, lse and, under torch.func.jvp, o_t and mu = rowsum(P o S_t) (lse's tangent)."""
    if path == "fallback" and dtype == torch.bfloat16:
        pytest.skip("the fallback is tested in fp32/fp16")
    q, k, v, tangents, kw = _case(case, dtype)
    (o, lse), (o_t, mu) = torch.func.jvp(
        lambda q, k, v: flash_jvp.attention_with_lse(q, k, v, **kw), (q, k, v), tangents
    )
    d = [x.double() for x in (q, k, v, *tangents)]
    (o_r, lse_r), (o_t_r, mu_r) = torch.func.jvp(
        lambda q, k, v: _ref(q, k, v, _ref_kw(kw)), tuple(d[:3]), tuple(d[3:])
    )
    assert_close_rel("o", o, o_r, TOL[dtype])
    assert_close_rel("o_t", o_t, o_t_r, TOL[dtype])
    _assert_lse("lse", lse, lse_r, 1e-5 if dtype == torch.float32 else 1e-3)
    assert mu.dtype == torch.float32 and not mu.isnan().any()
    assert_close_rel("mu", mu[torch.isfinite(lse_r)], mu_r[torch.isfinite(lse_r)], TOL[dtype])
    assert (mu[torch.isinf(lse_r)] == 0).all() and (o[torch.isinf(lse_r)] == 0).all()


@pytest.mark.parametrize("case", ["plain", "causal", "gqa", "key_padding", "additive"])
@pytest.mark.parametrize("on", ["o and lse", "lse only"])
def test_lse_cotangent_enters_the_backward(case, on, path):
    """Gradients of sum(o * do) + sum(lse * dlse) (or of the lse term alone) w.r.t. q, k, v
    and an additive mask: dS gains P * dlse."""
    q, k, v, _, kw = _case(case, torch.float32)
    do, dlse = randn(*q.shape[:-1], v.shape[-1]), randn(*q.shape[:-1])

    def loss(q, k, v, mask, fn):
        extra = {} if mask is None else {"attn_mask": mask}
        o, lse = fn(q, k, v, **{**kw, **extra})
        lse_term = (torch.where(torch.isfinite(lse), lse, 0.0) * dlse.to(lse.dtype)).sum()
        return lse_term if on == "lse only" else (o * do.to(o.dtype)).sum() + lse_term

    mask = kw.pop("attn_mask", None)
    grads = []
    for fn, cast in ((flash_jvp.attention_with_lse, lambda x: x), (_ref_fn, torch.Tensor.double)):
        leaves = [cast(x).clone().requires_grad_() for x in (q, k, v)]
        m = None
        if mask is not None:
            m = mask if mask.dtype == torch.bool else cast(mask).clone().requires_grad_()
        inputs = leaves + ([m] if m is not None and m.requires_grad else [])
        found = torch.autograd.grad(loss(*leaves, m, fn), inputs, allow_unused=True)
        grads.append([torch.zeros_like(x) if g is None else g for x, g in zip(inputs, found)])
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), *grads):
        if name == "dv" and on == "lse only":  # lse does not depend on v
            assert not a.any(), name
        else:
            assert_close_rel(name, a, b, 1e-4)


def _ref_fn(q, k, v, **kw):
    return _ref(q, k, v, kw)


def test_merging_key_halves_reproduces_full_attention(path):
    """What ring attention does: (o_b, lse_b) over two halves of the keys, merged by lse in
    plain torch ops (o = sum_b exp(lse_b - lse) o_b, lse = logsumexp_b lse_b), equal the full
    call in o, lse and, through forward AD of the merge, in o_t and mu."""
    q, k, v, tangents, _ = _case("plain", torch.float32)

    def merged(q, k, v):
        parts = [
            flash_jvp.attention_with_lse(q, k[:, :, s], v[:, :, s])
            for s in (slice(0, 20), slice(20, None))
        ]
        lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
        o = sum(torch.exp(lse_b - lse)[..., None] * o_b for o_b, lse_b in parts)
        return o, lse

    full = torch.func.jvp(flash_jvp.attention_with_lse, (q, k, v), tangents)
    split = torch.func.jvp(merged, (q, k, v), tangents)
    for name, a, b in zip(("o", "lse", "o_t", "mu"), (*split[0], *split[1]), (*full[0], *full[1])):
        assert_close_rel(name, a, b, 1e-5)


def test_varlen_return_lse(path):
    """varlen_attention(return_lse=True): lse (H, total_q), each sequence's rows equal to
    attention_with_lse on that sequence alone; a sequence with no keys gives -inf."""
    cu_q = torch.tensor([0, 9, 30, 33], device=DEVICE, dtype=torch.int32)
    cu_k = torch.tensor([0, 12, 40, 40], device=DEVICE, dtype=torch.int32)
    q, k, v = randn(33, 2, 16), randn(40, 2, 16), randn(40, 2, 16)
    tangents = tuple(randn(*x.shape) for x in (q, k, v))

    def fn(q, k, v):
        return flash_jvp.varlen_attention(q, k, v, cu_q, cu_k, 21, 28, True, return_lse=True)

    (o, lse), (o_t, mu) = torch.func.jvp(fn, (q, k, v), tangents)
    assert lse.shape == (2, 33) and mu.shape == (2, 33)
    for i in range(2):
        r, c = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        seq = [x[s].transpose(0, 1).double() for x, s in ((q, r), (k, c), (v, c))]
        seq_t = [x[s].transpose(0, 1).double() for x, s in zip(tangents, (r, c, c))]
        (_, lse_r), (_, mu_r) = torch.func.jvp(
            lambda q, k, v: _ref(q, k, v, {"is_causal": True}), tuple(seq), tuple(seq_t)
        )
        assert_close_rel(f"lse seq {i}", lse[:, r], lse_r, 1e-5)
        assert_close_rel(f"mu seq {i}", mu[:, r], mu_r, 1e-4)
    assert torch.isinf(lse[:, 30:]).all() and (o[30:] == 0).all() and (mu[:, 30:] == 0).all()
    assert not o_t.isnan().any()


def test_forward_over_reverse_with_lse_cotangent(path):
    """torch.func.jvp of torch.func.grad of a loss using lse: the composite path's dlse terms
    (reference.attention_bwd_jvp) against float64 autodiff."""
    q, k, v, (q_t, _, _), _ = _case("causal", torch.float32)
    w = randn(*q.shape[:-1])

    def tangent_of_grad(fn, q, k, v, q_t):
        def loss(q):
            o, lse = fn(q, k, v, is_causal=True)
            return o.square().sum() + (lse * w.to(lse.dtype)).sum()

        return torch.func.jvp(torch.func.grad(loss), (q,), (q_t,))[1]

    ours = tangent_of_grad(flash_jvp.attention_with_lse, q, k, v, q_t)
    ref = tangent_of_grad(_ref_fn, *(x.double() for x in (q, k, v, q_t)))
    assert_close_rel("dq_t", ours, ref, 1e-4)


def test_compiled_jvp_of_attention_with_lse(path):
    """torch.compile (aot_eager, fullgraph) of a jvp through attention_with_lse: o, lse,
    o_t and mu equal eager."""
    q, k, v, tangents, _ = _case("causal", torch.float32)

    def fn(q, k, v, q_t, k_t, v_t):
        return torch.func.jvp(
            lambda q, k, v: flash_jvp.attention_with_lse(q, k, v, is_causal=True),
            (q, k, v), (q_t, k_t, v_t),
        )  # fmt: skip

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, *tangents)
    eager = fn(q, k, v, *tangents)
    for name, a, b in zip(("o", "lse", "o_t", "mu"), (*compiled[0], *compiled[1]),
                          (*eager[0], *eager[1])):  # fmt: skip
        assert torch.equal(a, b) if path == "kernels" else torch.allclose(a, b), name


def _jvp_with_lse(mode: str, q, k, v, tangents, kw):
    """((o, lse), (o_t, mu)) of attention_with_lse by torch.func.jvp or forward_ad."""
    if mode == "torch.func.jvp":
        return torch.func.jvp(
            lambda q, k, v: flash_jvp.attention_with_lse(q, k, v, **kw), (q, k, v), tangents
        )
    with fwAD.dual_level():
        duals = [fwAD.make_dual(x, t) for x, t in zip((q, k, v), tangents)]
        o, lse = (fwAD.unpack_dual(y) for y in flash_jvp.attention_with_lse(*duals, **kw))
        return (o.primal, lse.primal), (o.tangent, lse.tangent)


@pytest.mark.parametrize("mode", ["torch.func.jvp", "forward_ad"])
@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "inputs requiring grad"])
def test_jvp_with_and_without_reverse_mode(mode, grad, path):
    """The forward-mode call that nothing differentiates in reverse mode (the launcher alone)
    and the one whose inputs require grad (through the autograd.Function) give the same o,
    lse, o_t and mu, against float64; only the latter's results carry a backward, whose
    gradients (of sum(o * do) + sum(o_t * do_t)) match float64 too."""
    q, k, v, tangents, kw = _case("key_padding", torch.float32)
    q, k, v = (x.clone().requires_grad_(grad) for x in (q, k, v))
    (o, lse), (o_t, mu) = _jvp_with_lse(mode, q, k, v, tangents, kw)
    d = [x.detach().double().requires_grad_(grad) for x in (q, k, v)]
    (o_r, lse_r), (o_t_r, mu_r) = torch.func.jvp(
        lambda q, k, v: _ref(q, k, v, kw), tuple(d), tuple(t.double() for t in tangents)
    )
    for name, a, b in (("o", o, o_r), ("o_t", o_t, o_t_r)):
        assert_close_rel(name, a, b, TOL[torch.float32])
    _assert_lse("lse", lse, lse_r, 1e-5)
    finite = torch.isfinite(lse_r)
    assert_close_rel("mu", mu[finite], mu_r[finite], TOL[torch.float32])
    assert o.requires_grad == o_t.requires_grad == grad
    if grad:
        do, do_t = randn(*o.shape), randn(*o.shape)
        ours = torch.autograd.grad((o * do).sum() + (o_t * do_t).sum(), (q, k, v))
        ref = torch.autograd.grad((o_r * do).sum() + (o_t_r * do_t).sum(), d)
        for name, a, b in zip(("dq", "dk", "dv"), ours, ref):
            assert_close_rel(name, a, b, 1e-4)
