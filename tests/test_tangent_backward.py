"""Reverse mode through the JVP (o_t, and mu, lse's tangent) and double backward (issue #18),
against float64 math SDPA under autograd.

The quantity checked: the gradients of L = <o, do> + <o_t, do_t> (torch.func.jvp, then
torch.autograd.grad) with respect to q, k, v, their tangents and an additive mask and its
tangent, for flash_jvp and for math SDPA on float64 copies (the reference) and in the inputs'
own dtype (PyTorch's error, which sets the tolerance: the rule of flash_jvp._check, 2x
PyTorch's error + a floor per dtype). Every launcher buffer starts as NaN (conftest), so an
unwritten gradient cannot pass. CPU: the kernels through Triton's interpreter (small shapes)
and the PyTorch fallback; GPU tier (marker ``gpu``): every head dim, bf16, L = 1000, configs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from helpers import (
    CUDA,
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    assert_close_rel,
    force_candidate,
    needs_kernels,
    randn,
    slow_if,
)
from torch.nn.attention.bias import CausalBias, CausalVariant, causal_lower_right

import flash_jvp
from flash_jvp import _check, _plans, reference

gpu = pytest.mark.gpu
GROUPS = (("dq", "dk", "dv"), ("dq_t", "dk_t", "dv_t"), ("dmask", "dmask_t"))
NAMES = tuple(n for g in GROUPS for n in g)


# ------------------------------------------------------------------------------ oracle
def _cast(x, dtype):
    return None if x is None or dtype is None else x.detach().to(dtype)


def tangent_grads(fn, q, k, v, tangents, do, do_t, mask=None, mask_t=None, dtype=None, **kw):
    """{name: gradient} of <o, do> + <o_t, do_t> for ``fn`` (SDPA signature) under
    torch.func.jvp, on copies cast to ``dtype`` (None: as given). Tangents that are None
    stay absent (zero); ``mask``/``mask_t``: an additive attn_mask and its tangent, both
    differentiated; do None: a loss on o_t alone."""
    cast = (lambda x: _cast(x, dtype)) if dtype else (lambda x: None if x is None else x.detach())
    prim = [cast(x).requires_grad_() for x in (q, k, v)]
    tans = [None if t is None else cast(t).requires_grad_() for t in tangents]
    m = None if mask is None else cast(mask).requires_grad_()
    m_t = None if mask_t is None else cast(mask_t).requires_grad_()
    present = [i for i, t in enumerate(tans) if t is not None]

    def f(*xs):
        args = list(prim)
        for i, x in zip(present, xs):
            args[i] = x
        extra = {} if m is None else {"attn_mask": xs[len(present)] if m_t is not None else m}
        return fn(*args, **kw, **extra)

    def g(*xs):  # the tangent inputs' primals, then the mask's (with a tangent)
        return f(*xs)

    primals = tuple(prim[i] for i in present) + ((m,) if m_t is not None else ())
    tangent_in = tuple(tans[i] for i in present) + ((m_t,) if m_t is not None else ())
    o, o_t = torch.func.jvp(g, primals, tangent_in)
    loss = (o_t * cast(do_t)).sum()
    if do is not None:
        loss = loss + (o * cast(do)).sum()
    leaves = {"dq": prim[0], "dk": prim[1], "dv": prim[2]}
    leaves.update({f"d{n}_t": t for n, t in zip("qkv", tans) if t is not None})
    if m is not None:
        leaves["dmask"] = m
    if m_t is not None:
        leaves["dmask_t"] = m_t
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return dict(zip(leaves, grads))


def _ref_same_dtype(q, k, v, **kw):
    return reference.attention_ref(q, k, v, upcast=False, **kw)


def assert_tangent_grads(fn, q, k, v, tangents, do, do_t, mask=None, mask_t=None, **kw):
    """fn's gradients pass the float64 rule of flash_jvp._check against math SDPA. Where a
    mask leaves a row no key, math SDPA's own second derivatives are NaN (torch 2.13:
    autograd of the JVP of its masked softmax); there attention_ref, equal to it elsewhere
    (tests/test_reference.py), is the oracle (and its run in the inputs' dtype the
    yardstick)."""
    args = (q, k, v, tangents, do, do_t, mask, mask_t)
    empty_rows = _has_empty_rows(kw.get("attn_mask"))
    ref_fn = reference.attention_ref if empty_rows else reference.math_sdpa
    ours = tangent_grads(fn, *args, **kw)
    ref64 = tangent_grads(ref_fn, *args, dtype=torch.float64, **kw)
    same = tangent_grads(_ref_same_dtype if empty_rows else ref_fn, *args, **kw)
    assert set(ours) == set(ref64)
    bad = []
    for group in GROUPS:
        names = [n for n in group if n in ref64]
        scale = max((_check._rms(ref64[n]) for n in names), default=0.0)
        for n in names:
            t_err = _check.rel_err(same[n], ref64[n], scale)
            t_err = t_err if math.isfinite(t_err) else 0.0
            tol = _check.RTOL * t_err + _check.floor(q.dtype)
            err = _check.rel_err(ours[n], ref64[n], scale)
            if not err <= tol:
                bad.append(f"{n}: rel err {err:.3e} > tol {tol:.3e} (PyTorch: {t_err:.3e})")
    assert not bad, f"q {tuple(q.shape)} {q.dtype} k {tuple(k.shape)} {kw}\n" + "\n".join(bad)
    return ours


def _has_empty_rows(mask) -> bool:
    """Whether an attn_mask leaves some query row no key: a boolean mask with an all-False
    row, or causal_lower_right with more queries than keys (its first rows see none)."""
    if isinstance(mask, CausalBias):
        return mask.variant == CausalVariant.LOWER_RIGHT and mask.seq_len_q > mask.seq_len_kv
    return type(mask) is torch.Tensor and mask.dtype == torch.bool and not mask.any(-1).all()


# ------------------------------------------------------------------------------- inputs
def _inputs(B=1, Hq=2, Hkv=1, Lq=37, Lk=45, E=16, Ev=24, dtype=torch.float32):
    q = randn(B, Hq, Lq, E, dtype=dtype)
    k, v = randn(B, Hkv, Lk, E, dtype=dtype), randn(B, Hkv, Lk, Ev, dtype=dtype)
    tangents = tuple(randn(*x.shape, dtype=dtype) for x in (q, k, v))
    do, do_t = (randn(B, Hq, Lq, Ev, dtype=dtype) for _ in range(2))
    return q, k, v, tangents, do, do_t


def _key_padding(B, Lq, Lk):
    """Boolean (B, 1, Lq, Lk): batch 1 keeps 20 keys, and its last 5 rows see none."""
    mask = torch.ones(B, 1, Lq, Lk, dtype=torch.bool, device=DEVICE)
    mask[-1, :, :, 20:] = False
    mask[-1, :, -5:] = False
    return mask


def _case_kwargs(case, q, k):
    B, Hq, Lq, Lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    return {
        "plain": {},
        "causal": {"is_causal": True},
        "lower_right": {"attn_mask": causal_lower_right(Lq, Lk)},
        "key_padding": {"attn_mask": _key_padding(B, Lq, Lk)},
        "additive": {"attn_mask": randn(1, Hq, Lq, Lk, dtype=q.dtype)},
    }[case]


CASES = ["plain", "causal", "lower_right", "key_padding", "additive"]


# ---------------------------------------------------------------------- CPU: main cases
@pytest.mark.parametrize("case", CASES)
def test_tangent_backward_matches_float64(case, path):
    """GQA, Lq != Lk, Ev != E, every mask kind; an additive mask with a tangent gets the
    gradients of both."""
    q, k, v, tangents, do, do_t = _inputs(B=2)
    kw = dict(_case_kwargs(case, q, k), enable_gqa=True)
    mask = kw.pop("attn_mask") if case == "additive" else None
    mask_t = None if mask is None else randn(*mask.shape)
    assert_tangent_grads(flash_jvp.attention, q, k, v, tangents, do, do_t, mask, mask_t, **kw)


@pytest.mark.parametrize("case", ["lower_right", "key_padding"])
def test_rows_without_keys(case, path):
    """More queries than keys under causal_lower_right (the first rows see no key), and
    key padding that hides every key from some rows: those rows give zero gradients
    through o and o_t, never NaN, and the rest match float64."""
    q, k, v, tangents, do, do_t = _inputs(B=2, Lq=45, Lk=37)
    kw = dict(_case_kwargs(case, q, k), enable_gqa=True)
    assert _has_empty_rows(kw["attn_mask"])
    ours = assert_tangent_grads(flash_jvp.attention, q, k, v, tangents, do, do_t, **kw)
    for name in ("dq", "dq_t"):  # rows [0, 8) see no key under causal_lower_right(45, 37)
        rows = ours[name][:, :, :8] if case == "lower_right" else ours[name][-1, :, -5:]
        assert torch.equal(rows, torch.zeros_like(rows)), name


@pytest.mark.parametrize("subset", ["q", "kv", "v", "k"])
def test_tangents_on_subsets(subset, path):
    """Tangents on some inputs only: the others are absent, not zero tensors."""
    q, k, v, tangents, do, do_t = _inputs()
    tangents = tuple(t if n in subset else None for n, t in zip("qkv", tangents))
    ours = assert_tangent_grads(flash_jvp.attention, q, k, v, tangents, do, do_t,
                                is_causal=True, enable_gqa=True)  # fmt: skip
    assert {n for n in ours if n.endswith("_t")} == {f"d{n}_t" for n in subset}


@pytest.mark.parametrize("dtype", [torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("case", ["plain", "key_padding"])
def test_tangent_backward_fp16(case, dtype, path):
    q, k, v, tangents, do, do_t = _inputs(B=2, dtype=dtype)
    kw = dict(_case_kwargs(case, q, k), enable_gqa=True)
    assert_tangent_grads(flash_jvp.attention, q, k, v, tangents, do, do_t, **kw)


@pytest.mark.parametrize("E", [8, 72])  # 72: split head-dim tiles (64 + 16 columns)
def test_head_dims(E, path):
    q, k, v, tangents, do, do_t = _inputs(Lq=20, Lk=33, E=E, Ev=E)
    assert_tangent_grads(flash_jvp.attention, q, k, v, tangents, do, do_t, is_causal=True,
                         enable_gqa=True)  # fmt: skip


@pytest.mark.parametrize("lengths", [(1, 77), (77, 1), (77, 77)], ids=str)
def test_lengths(lengths, path):
    Lq, Lk = lengths
    q, k, v, tangents, do, do_t = _inputs(Lq=Lq, Lk=Lk)
    assert_tangent_grads(flash_jvp.attention, q, k, v, tangents, do, do_t, enable_gqa=True)


def test_loss_on_o_t_only_and_strided_inputs(path):
    """No cotangent of o (a loss on o_t alone), and q, k, v, tangents and cotangents as
    non-contiguous views (B, L, H, E).transpose(1, 2)."""

    def view(x):
        return x.transpose(1, 2).contiguous().transpose(1, 2)

    q, k, v, tangents, _, do_t = _inputs(B=2, Hq=2, Hkv=2)
    q, k, v, do_t = (view(x) for x in (q, k, v, do_t))
    tangents = tuple(view(t) for t in tangents)
    assert not q.is_contiguous()
    assert_tangent_grads(flash_jvp.attention, q, k, v, tangents, None, do_t, is_causal=True)


@pytest.mark.parametrize("subset", ["qkv", "k", "v"])
def test_varlen(path, subset, monkeypatch):
    """Packed sequences (one of length 0), causal, tangents on all or one of the inputs:
    per-sequence math SDPA in float64. No buffer exceeds a packed gradient's size (the
    kernels write dk with dv: where one is not wanted it lands in a packed-sized scratch,
    not one per sequence)."""
    cu = torch.tensor([0, 7, 7, 30], device=DEVICE, dtype=torch.int32)
    q, k, v, q_t, k_t, v_t, do, do_t = (randn(30, 2, 16) for _ in range(8))
    present = ["qkv".index(c) for c in subset]

    def grads(varlen, dtype):
        prim = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        tans = [(q_t, k_t, v_t)[i].detach().to(dtype).requires_grad_() for i in present]

        def run(*xs):
            args = list(prim)
            for i, x in zip(present, xs):
                args[i] = x
            return varlen(*args, cu, cu, 23, 23, is_causal=True)

        o, o_t = torch.func.jvp(run, tuple(prim[i] for i in present), tuple(tans))
        loss = (o * do.to(dtype)).sum() + (o_t * do_t.to(dtype)).sum()
        return torch.autograd.grad(loss, [prim[i] for i in present] + tans)

    def math_varlen(q, k, v, cu_q, cu_k, mq, mk, is_causal):
        return reference.varlen_math_sdpa(q, k, v, cu_q, cu_k, is_causal)

    sizes = []

    def empty(shape, device, dtype):
        sizes.append(math.prod(shape))
        return torch.empty(shape, device=device, dtype=dtype)

    monkeypatch.setattr(_plans, "allocate", empty)  # replayed launch plans allocate here too
    ours = grads(flash_jvp.varlen_attention, torch.float32)
    assert max(sizes, default=0) <= q.numel(), f"a buffer of {max(sizes)} elements for {q.numel()}"
    ref = grads(math_varlen, torch.float64)
    names = [f"d{'qkv'[i]}" for i in present] + [f"d{'qkv'[i]}_t" for i in present]
    for name, a, b in zip(names, ours, ref):
        assert_close_rel(name, a, b, 2e-5)


def test_lse_and_mu_cotangents(path):
    """attention_with_lse under jvp, a loss on o, o_t, lse and mu (lse's tangent): the
    gradients of q, k, v and their tangents against float64 attention_ref."""
    q, k, v, tangents, do, do_t = _inputs()
    dlse, dmu = randn(*q.shape[:-1]), randn(*q.shape[:-1])

    def grads(fn, dtype):
        prim = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, *tangents)]
        f = lambda q, k, v: fn(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        (o, lse), (o_t, mu) = torch.func.jvp(f, tuple(prim[:3]), tuple(prim[3:]))
        terms = ((o, do), (o_t, do_t), (lse, dlse), (mu, dmu))
        return torch.autograd.grad(sum((x * c.to(x.dtype)).sum() for x, c in terms), prim)

    def ref(q, k, v, **kw):
        return reference.attention_ref(q, k, v, return_lse=True, **kw)

    ours = grads(flash_jvp.attention_with_lse, torch.float32)
    for name, a, b in zip(NAMES, ours, grads(ref, torch.float64)):
        assert_close_rel(name, a, b, 2e-5)


@pytest.mark.parametrize(
    "q_shape,k_shape",
    [
        ((1, 2, 0, 16), (1, 2, 9, 16)),
        ((1, 0, 8, 16), (1, 0, 9, 16)),
        ((0, 2, 8, 16), (0, 2, 9, 16)),
    ],
    ids=["Lq0", "H0", "N0"],
)
def test_empty_inputs_give_zero_gradients(q_shape, k_shape, path):
    q, k, v = randn(*q_shape), randn(*k_shape), randn(*k_shape)
    leaves = [x.requires_grad_() for x in (q, k, v, *(randn(*x.shape) for x in (q, k, v)))]
    o, o_t = torch.func.jvp(flash_jvp.attention, tuple(leaves[:3]), tuple(leaves[3:]))
    for x, g in zip(leaves, torch.autograd.grad(o.sum() + o_t.sum(), leaves)):
        assert g.shape == x.shape and not g.any()


# ------------------------------------------------------------------ differentiation APIs
def _small():
    q, k, v, tangents, do, do_t = _inputs(Lq=12, Lk=17, E=16, Ev=16)
    return q, k, v, tangents, do, do_t


def _ref64(fn_of_attention):
    """fn_of_attention(math SDPA) on float64 copies of its tensor arguments."""

    def run(*args):
        return fn_of_attention(reference.math_sdpa, *(_cast(a, torch.float64) for a in args))

    return run


def test_forward_ad_duals_then_backward(path):
    """forward_ad dual tensors, a loss on the unpacked tangent, .backward(), on the kernels
    and the fallback alike."""
    q, k, v, tangents, do, do_t = _small()

    def run(attention, q, k, v, q_t, k_t, v_t, do, do_t):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, q_t, k_t, v_t)]
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x, t) for x, t in zip(leaves[:3], leaves[3:])]
            out = fwAD.unpack_dual(attention(*duals, enable_gqa=True))
            loss = (out.primal * do).sum() + (out.tangent * do_t).sum()
        loss.backward()
        return [x.grad for x in leaves]

    ours = run(flash_jvp.attention, q, k, v, *tangents, do, do_t)
    # the oracle through torch.func.jvp: torch's forward AD of softmax breaks its own backward
    # (an in-place error, pytorch/pytorch#162350), with math SDPA or torch.softmax alike; the
    # fallback's softmax is in plain ops (reference._softmax_lse), so it runs here too
    ref = tangent_grads(reference.math_sdpa, q, k, v, tangents, do, do_t, dtype=torch.float64,
                        enable_gqa=True)  # fmt: skip
    for name, a in zip(NAMES, ours):
        assert_close_rel(name, a, ref[name], 2e-5)


@needs_kernels
def test_backward_through_o_t_inside_dual_level():
    """.backward()-style autograd.grad through o_t while the forward_ad level is still open:
    forward AD then also differentiates the backward through o_t (a third derivative, by
    the PyTorch composite); the gradients and their tangents against float64 (torch.func
    jvp of grad of the loss, on attention_ref)."""
    q, k, v, tangents, do, do_t = _small()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *tangents)]
    with fwAD.dual_level():
        duals = [fwAD.make_dual(x, t) for x, t in zip(leaves[:3], leaves[3:])]
        out = fwAD.unpack_dual(flash_jvp.attention(*duals, enable_gqa=True))
        loss = (out.primal * do).sum() + (out.tangent * do_t).sum()
        grads = [fwAD.unpack_dual(g) for g in torch.autograd.grad(loss, leaves)]

    def ref_loss(q, k, v, q_t, k_t, v_t):
        f = lambda q, k, v: reference.attention_ref(q, k, v, enable_gqa=True)  # noqa: E731
        o, o_t = torch.func.jvp(f, (q, k, v), (q_t, k_t, v_t))
        return (o * do.double()).sum() + (o_t * do_t.double()).sum()

    x64 = tuple(x.detach().double() for x in (q, k, v, *tangents))
    dirs = tuple(t.double() for t in tangents) + tuple(torch.zeros_like(t) for t in x64[3:])
    grad = torch.func.grad(ref_loss, argnums=tuple(range(6)))
    ref, ref_t = torch.func.jvp(grad, x64, dirs)
    for name, g, r, r_t in zip(NAMES, grads, ref, ref_t):
        assert_close_rel(name, g.primal, r, 2e-5)
        assert_close_rel(f"{name}'s tangent", g.tangent, r_t, 2e-5)


def test_func_grad_vjp_of_a_loss_with_jvp(path):
    """torch.func.grad and torch.func.vjp of functions whose outputs contain jvp outputs."""
    q, k, v, (q_t, k_t, v_t), do, do_t = _small()

    def loss(attention, q, k, v, q_t, k_t, v_t, do, do_t):
        f = lambda q, k, v: attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        o, o_t = torch.func.jvp(f, (q, k, v), (q_t, k_t, v_t))
        return (o * do).sum() + (o_t * do_t).sum()

    def grad(attention, *args):
        return torch.func.grad(lambda *x: loss(attention, *x, *args[6:]), argnums=tuple(range(6)))(
            *args[:6]
        )

    def vjp(attention, q, k, v, q_t, k_t, v_t, do, do_t):
        def f(q, k, v, q_t, k_t, v_t):
            a = lambda q, k, v: attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
            return torch.func.jvp(a, (q, k, v), (q_t, k_t, v_t))

        return torch.func.vjp(f, q, k, v, q_t, k_t, v_t)[1]((do, do_t))

    args = (q, k, v, q_t, k_t, v_t, do, do_t)
    for name, fn in (("grad", grad), ("vjp", vjp)):
        ours = fn(flash_jvp.attention, *args)
        ref = _ref64(fn)(*args)
        for n, a, b in zip(NAMES, ours, ref):
            assert_close_rel(f"{name} {n}", a, b, 2e-5)


def test_jacrev_through_the_tangent(path):
    """torch.func.jacrev of o_t with respect to q and q_t (vmap over the backward)."""
    q, k, v, (q_t, k_t, v_t), _, _ = _inputs(Hq=1, Lq=5, Lk=6, E=16, Ev=16)

    def o_t(attention, q, q_t, k, v, k_t, v_t):
        return torch.func.jvp(lambda q: attention(q, k, v), (q,), (q_t,))[1]

    def jac(attention, *args):
        return torch.func.jacrev(lambda q, q_t: o_t(attention, q, q_t, *args[2:]),
                                 argnums=(0, 1))(*args[:2])  # fmt: skip

    ours = jac(flash_jvp.attention, q, q_t, k, v, k_t, v_t)
    ref = _ref64(jac)(q, q_t, k, v, k_t, v_t)
    for name, a, b in zip(("d o_t / dq", "d o_t / dq_t"), ours, ref):
        assert_close_rel(name, a, b, 2e-5)


def test_jvp_of_vmap_then_backward_through_o_t(path):
    """jvp outside vmap: FlashAttnJVP.jvp gets the tangents itself (not the forward's);
    the o_t it computes is differentiable too."""
    q, k, v, (q_t, _, _), _, do_t = _inputs(B=3, Hq=1, Lq=8, Lk=8, E=16, Ev=16)

    def run(attention, q, k, v, q_t, do_t):
        q = q.clone().requires_grad_()
        fn = torch.func.vmap(lambda a: attention(a, k[:1], v[:1]))
        o_t = torch.func.jvp(fn, (q.unsqueeze(1),), (q_t.unsqueeze(1),))[1]
        return torch.autograd.grad((o_t.squeeze(1) * do_t).sum(), q)[0]

    ours = run(flash_jvp.attention, q, k, v, q_t, do_t)
    assert_close_rel("dq", ours, _ref64(run)(q, k, v, q_t, do_t), 2e-5)


# ----------------------------------------------------------------------- double backward
@pytest.mark.parametrize("case", ["plain", "causal", "additive"])
def test_double_backward(case, path):
    """torch.autograd.grad(create_graph=True), then the gradient of a loss on the gradients
    (a gradient penalty) with respect to q, k, v, do (and an additive mask)."""
    q, k, v, _, do, _ = _inputs(B=2)
    kw = dict(_case_kwargs(case, q, k), enable_gqa=True)
    mask = kw.pop("attn_mask", None)
    w = [randn(*x.shape) for x in (q, k, v)]

    def run(attention, q, k, v, do, mask, *w):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, do)]
        m = None if mask is None else mask.clone().requires_grad_()
        o = attention(*leaves[:3], **kw, **({} if m is None else {"attn_mask": m}))
        g = torch.autograd.grad(o, leaves[:3], leaves[3], create_graph=True)
        penalty = sum((gi * wi).sum() for gi, wi in zip(g, w)) + (g[0] * g[0]).sum()
        return torch.autograd.grad(penalty, leaves + ([] if m is None else [m]))

    ours = run(flash_jvp.attention, q, k, v, do, mask, *w)
    ref = _ref64(run)(q, k, v, do, mask, *w)
    for name, a, b in zip(("dq", "dk", "dv", "ddo", "dmask"), ours, ref):
        assert_close_rel(name, a, b, 5e-5)


def test_forward_over_reverse_is_fused(path, monkeypatch):
    """A Hessian-vector product by forward AD over autograd.grad(create_graph=True) (the
    tangent of the gradients) on the kernel path runs the fused kernels, not the composite
    (which materialises the scores), with an additive mask carrying a tangent too."""
    q, k, v, tangents, do, _ = _small()
    mask, mask_t = randn(1, 2, 12, 17), randn(1, 2, 12, 17)
    if path == "kernels":
        monkeypatch.setattr(reference, "attention_bwd_jvp", _refused)

    def hvp(attention, q, k, v, q_t, k_t, v_t, mask, mask_t, do):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x.clone().requires_grad_(), t)
                     for x, t in zip((q, k, v, mask), (q_t, k_t, v_t, mask_t))]  # fmt: skip
            o = attention(*duals[:3], attn_mask=duals[3], enable_gqa=True)
            grads = torch.autograd.grad(o, duals, do, create_graph=True)
            return [fwAD.unpack_dual(g).tangent for g in grads]

    def jvp_of_grad(attention, q, k, v, q_t, k_t, v_t, mask, mask_t, do):
        def grad(q, k, v, mask):
            def f(q, k, v, mask):
                return attention(q, k, v, attn_mask=mask, enable_gqa=True)

            return torch.func.vjp(f, q, k, v, mask)[1](do)

        return torch.func.jvp(grad, (q, k, v, mask), (q_t, k_t, v_t, mask_t))[1]

    args = (q, k, v, *tangents, mask, mask_t, do)
    ref = _ref64(jvp_of_grad)(*args)
    names = ("dq_t", "dk_t", "dv_t", "dmask_t")
    if path == "kernels":
        for name, a, b in zip(names, hvp(flash_jvp.attention, *args), ref):
            assert_close_rel(f"{name} (forward_ad)", a, b, 2e-5)
        monkeypatch.undo()
    # torch.func.jvp of torch.func.vjp: functorch hands the Function wrapped tensors, so the
    # composite serves it (exact, but it materialises the scores)
    for name, a, b in zip(names, jvp_of_grad(flash_jvp.attention, *args), ref):
        assert_close_rel(f"{name} (torch.func)", a, b, 2e-5)


def _refused(*args, **kwargs):
    raise AssertionError("the composite ran where the fused kernels should")


@needs_kernels
def test_third_order_is_refused_clearly():
    """Differentiating the backward through o_t once more (or the double backward) raises
    NotImplementedError naming third order; never silent zeros."""
    q, k, v, tangents, do, do_t = _small()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *tangents)]
    o, o_t = torch.func.jvp(lambda q, k, v: flash_jvp.attention(q, k, v, enable_gqa=True),
                            tuple(leaves[:3]), tuple(leaves[3:]))  # fmt: skip
    g = torch.autograd.grad((o_t * do_t).sum(), leaves, create_graph=True)
    with pytest.raises(NotImplementedError, match="third-order"):
        torch.autograd.grad(g[0].sum(), leaves[:3])
    o = flash_jvp.attention(*leaves[:3], enable_gqa=True)
    g = torch.autograd.grad(o, leaves[:3], do, create_graph=True)
    g2 = torch.autograd.grad(g[0].square().sum(), leaves[:3], create_graph=True)
    with pytest.raises(NotImplementedError, match="third-order"):
        torch.autograd.grad(g2[1].sum(), leaves[:3])


# ------------------------------------------------------------------------------ GPU tier
# Every mask case at every head dim in bf16; fp16 and fp32 at one padded (72) and one
# power-of-two (128) head dim in the fast GPU tier, the rest of the cross product in the slow one.
GPU_HEAD_DIM_CASES = [
    pytest.param(case, E, dtype, id=f"{case}-{E}-{DTYPE_IDS[dtype]}",
                 marks=slow_if(dtype != torch.bfloat16 and E not in (72, 128)))
    for case in CASES for E in (8, 72, 80, 96, 128, 160, 256) for dtype in DTYPES
]  # fmt: skip


@gpu
@pytest.mark.parametrize("case,E,dtype", GPU_HEAD_DIM_CASES)
def test_gpu_head_dims_and_masks(case, E, dtype):
    q, k, v, tangents, do, do_t = _inputs(B=2, Hq=4, Hkv=2, Lq=1000, Lk=777, E=E, Ev=E,
                                          dtype=dtype)  # fmt: skip
    kw = dict(_case_kwargs(case, q, k), enable_gqa=True)
    mask = kw.pop("attn_mask") if case == "additive" else None
    mask_t = None if mask is None else randn(*mask.shape, dtype=dtype)
    assert_tangent_grads(flash_jvp.attention, q, k, v, tangents, do, do_t, mask, mask_t, **kw)


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("E", [64, 72, 128, 256])
@pytest.mark.parametrize("index", range(3))
def test_gpu_tangent_candidate_configs(monkeypatch, dtype, E, index):
    """Every launch config the launchers can pick for the tangent backward is correct."""
    force_candidate(monkeypatch, index, kernels=("bwd_dkdv", "bwd_dq"))
    q, k, v, tangents, do, do_t = _inputs(B=2, Hq=3, Hkv=3, Lq=300, Lk=333, E=E, Ev=E,
                                          dtype=dtype)  # fmt: skip
    for is_causal in (False, True):
        try:
            assert_tangent_grads(flash_jvp.attention, q, k, v, tangents, do, do_t,
                                 is_causal=is_causal)  # fmt: skip
        except NotImplementedError as err:  # does not fit this GPU: the launcher says so
            assert "no launch configuration" in str(err)


@gpu
def test_gpu_varlen_and_double_backward_bf16():
    cu = torch.tensor([0, 300, 300, 1000, 1001], device=DEVICE, dtype=torch.int32)
    x = [randn(1001, 4, 64, dtype=torch.bfloat16) for _ in range(8)]
    q, k, v, q_t, k_t, v_t, do, do_t = x

    def grads(varlen, dtype):
        prim = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, q_t, k_t, v_t)]
        f = lambda q, k, v: varlen(q, k, v, cu, cu, 700, 700, is_causal=True)  # noqa: E731
        o, o_t = torch.func.jvp(f, tuple(prim[:3]), tuple(prim[3:]))
        loss = (o * do.to(dtype)).sum() + (o_t * do_t.to(dtype)).sum()
        return torch.autograd.grad(loss, prim)

    def math_varlen(q, k, v, cu_q, cu_k, mq, mk, is_causal):
        return reference.varlen_math_sdpa(q, k, v, cu_q, cu_k, is_causal)

    ref = grads(math_varlen, torch.float64)
    same = grads(math_varlen, torch.bfloat16)
    for name, a, r, s in zip(NAMES, grads(flash_jvp.varlen_attention, torch.bfloat16), ref, same):
        tol = _check.RTOL * _check.rel_err(s, r) + _check.floor(torch.bfloat16)
        assert _check.rel_err(a, r) <= tol, (name, _check.rel_err(a, r), tol)


@pytest.mark.skipif(not CUDA, reason="the fused path's memory is measured on CUDA")
@gpu
def test_gpu_tangent_backward_memory_is_linear():
    """The backward through o_t allocates O(L) beyond its inputs and gradients: at L = 8192,
    B*H = 16, E = 64, bf16 it stays far below one (L, L) score matrix per head."""
    q, k, v, tangents, do, do_t = _inputs(B=1, Hq=16, Hkv=16, Lq=8192, Lk=8192, E=64, Ev=64,
                                          dtype=torch.bfloat16)  # fmt: skip
    leaves = [x.requires_grad_() for x in (q, k, v, *tangents)]
    o, o_t = torch.func.jvp(flash_jvp.attention, tuple(leaves[:3]), tuple(leaves[3:]))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.autograd.grad((o * do).sum() + (o_t * do_t).sum(), leaves)
    # beyond the six gradients it returns (16 MiB each): O(L) buffers and autograd's
    # cotangents of the loss's products, far below one (L, L) score matrix per head
    extra = torch.cuda.max_memory_allocated() - base - sum(g.nbytes for g in grads)
    scores = 16 * 8192 * 8192 * 2
    assert extra < 0.05 * scores, f"{extra / 2**20:.0f} MiB"


def test_hessians(path):
    """jacrev(jacrev) (double backward under vmap) and torch.func.hessian (jacfwd of
    jacrev: forward-over-reverse under vmap) of a scalar loss."""
    q, k, v = (randn(1, 1, 4, 16) for _ in range(3))

    def loss(attention):
        return lambda q: attention(q, k.to(q.dtype), v.to(q.dtype)).square().sum()

    for name, transform in (("jacrev(jacrev)", lambda g: torch.func.jacrev(torch.func.jacrev(g))),
                            ("hessian", torch.func.hessian)):  # fmt: skip
        ours = transform(loss(flash_jvp.attention))(q)
        assert_close_rel(name, ours, transform(loss(reference.math_sdpa))(q.double()), 2e-5)
