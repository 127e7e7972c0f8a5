"""Reported failure cases (shared/cases/README.md, C1-C4 and C6-C10) and the seed's parity
scenario, each as a parametrized family. C5 (fully masked rows) is in test_masks.py.

REF = torch.func.jvp / autograd through math SDPA on float64 copies (flash_jvp.reference).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    CUDA,
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    assert_close_rel,
    assert_matches_reference,
    needs_kernels,
    qkv,
    randn,
)
from torch.autograd import forward_ad as fwAD

import flash_jvp
from flash_jvp import _check, _utils, reference
from flash_jvp.reference import math_sdpa

gpu = pytest.mark.gpu
CAUSAL = pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
DTYPE = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)


def _ref_o_t(q, k, v, tangents, **kw):
    return reference.sdpa_outputs(q, k, v, tangents, torch.zeros_like(q), **kw).o_t


def _tol(dtype):
    """Tolerance for checks without a same-dtype torch run: 4x the dtype floor."""
    return 4 * _check.floor(dtype) if dtype != torch.float32 else 1e-5


# ---------------------------------------------------------------- C1: every entry point
@CAUSAL
@DTYPE
def test_c1_func_jvp_and_forward_ad(dtype, is_causal):
    """torch.func.jvp and forward_ad dual tensors through the plain call give REF's o_t."""
    L = 128 if CUDA else 64
    q, k, v, tangents, do = qkv(2, 4, 4, L, L, 64, dtype=dtype)
    assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, is_causal=is_causal)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(x, t) for x, t in zip((q, k, v), tangents)]
        out = fwAD.unpack_dual(flash_jvp.attention(*duals, is_causal=is_causal))
    _, o_t = torch.func.jvp(
        lambda q, k, v: flash_jvp.attention(q, k, v, is_causal=is_causal), (q, k, v), tangents
    )
    torch.testing.assert_close(out.tangent, o_t, rtol=0, atol=0)


def test_c1_dual_level_entered_without_forward_ad_bookkeeping():
    """A forward-AD level entered where ``forward_ad._current_level`` stays -1 still gives the
    fused tangent: the level a Dynamo graph enters at run time around an
    ``allow_in_graph`` call (backend="eager"), and one entered through torch._C. (961f4b7
    skipped reading tangents when that counter said no level existed: None here.)"""
    q, k, v, tangents, _ = qkv(1, 2, 2, 32, 32, 16, dtype=torch.float32)
    _, o_t = torch.func.jvp(flash_jvp.attention, (q, k, v), tangents)

    # a wrapper, not flash_jvp.attention itself: allow_in_graph registers for the process
    @torch.compiler.allow_in_graph
    def attention(q, k, v):
        return flash_jvp.attention(q, k, v)

    def step(q, k, v, q_t, k_t, v_t):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x, t) for x, t in ((q, q_t), (k, k_t), (v, v_t))]
            return fwAD.unpack_dual(attention(*duals)).tangent

    torch._dynamo.reset()
    out = torch.compile(step, backend="eager", fullgraph=True)(q, k, v, *tangents)
    assert out is not None
    torch.testing.assert_close(out, o_t, rtol=0, atol=0)
    level = torch._C._enter_dual_level()
    try:
        duals = [torch._make_dual(x, t, level) for x, t in zip((q, k, v), tangents)]
        out = torch._unpack_dual(flash_jvp.attention(*duals), level).tangent
    finally:
        torch._C._exit_dual_level(level)
    assert out is not None
    torch.testing.assert_close(out, o_t, rtol=0, atol=0)


def _entry_points():
    """(name, fn, primals, tangents) for each public entry point, tangents on every float input."""
    q, k, v, tangents, _ = qkv(1, 2, 2, 24, 20, 16, dtype=torch.float32)
    mask = randn(1, 2, 24, 20)
    yield "attention", lambda q, k, v: flash_jvp.attention(q, k, v), (q, k, v), tangents
    yield (
        "causal_gqa",
        (lambda q, k, v: flash_jvp.attention(q, k, v, is_causal=True, enable_gqa=True)),
        (q, k[:, :1], v[:, :1]),
        (tangents[0], tangents[1][:, :1], tangents[2][:, :1]),
    )
    yield (
        "additive_mask",
        lambda q, k, v, m: flash_jvp.attention(q, k, v, m),
        (q, k, v, mask),
        (*tangents, randn(1, 2, 24, 20)),
    )
    yield ("with_lse", lambda q, k, v: flash_jvp.attention_with_lse(q, k, v), (q, k, v), tangents)
    cu = torch.tensor([0, 5, 13, 20], dtype=torch.int32, device=q.device)
    packed = [x[0].transpose(0, 1)[:20].contiguous() for x in (q, k, v, *tangents)]
    yield (
        "varlen",
        lambda q, k, v: flash_jvp.varlen_attention(q, k, v, cu, cu, 12, 12, is_causal=True),
        packed[:3],
        packed[3:],
    )


def _traced(how, fn, primals):
    if how == "compile":
        torch._dynamo.reset()
        return torch.compile(fn, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return torch.jit.trace(fn, tuple(primals), check_trace=False)


@pytest.mark.parametrize("how", ["compile", "jit_trace"])
@pytest.mark.parametrize("entry", list(_entry_points()), ids=lambda e: e[0])
def test_c1_duals_into_a_graph_traced_for_inference(entry, how):
    """Dual inputs into a graph traced with nothing requiring grad (AOTAutograd's inference
    graph, torch.jit.trace) give eager's tangents: the graph keeps ``flash_jvp::attention``,
    whose Autograd kernel reads them. (Before, the graph held ``attn_fwd``, whose custom_op
    autograd ran it below autograd: no tangent, silently.)"""
    _, fn, primals, tangents = entry
    expected = torch.func.jvp(fn, tuple(primals), tuple(tangents))[1]
    traced = _traced(how, fn, primals)
    with fwAD.dual_level():
        out = traced(*(fwAD.make_dual(x, t) for x, t in zip(primals, tangents)))
        got = [fwAD.unpack_dual(o).tangent for o in (out if isinstance(out, tuple) else [out])]
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert all(t is not None for t in got), [t is None for t in got]
    for name, t, e in zip(("o", "lse"), got, expected):
        torch.testing.assert_close(t, e, rtol=1e-6, atol=1e-6, msg=name)


def _lse64(q, k, v):
    """(o, lse) in plain float64 ops: attention_with_lse's reference."""
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return math_sdpa(q, k, v), torch.logsumexp(s, -1)


def _vmapped_entry_points():
    """(name, fn, its plain-op reference, primals, tangents, in_dims): entry points vmapped
    over a leading dim of 2 (a mask and its tangent shared), and the gradient of a loss."""
    q, k, v, tangents, _ = qkv(2, 2, 2, 24, 20, 16)
    q, k, v, *tangents = (x.unsqueeze(1) for x in (q, k, v, *tangents))  # (2, 1, H, L, E)
    mask, mask_t = randn(1, 2, 24, 20), randn(1, 2, 24, 20)
    qkv_args = ((q, k, v), tangents, 0)
    yield "attention", flash_jvp.attention, math_sdpa, *qkv_args
    yield (
        "additive_mask",
        lambda q, k, v, m: flash_jvp.attention(q, k, v, m),
        lambda q, k, v, m: math_sdpa(q, k, v, attn_mask=m),
        (q, k, v, mask),
        (*tangents, mask_t),
        (0, 0, 0, None),
    )
    yield "with_lse", flash_jvp.attention_with_lse, _lse64, *qkv_args
    loss = lambda q, k, v: flash_jvp.attention(q, k, v).square().sum()  # noqa: E731
    loss64 = lambda q, k, v: math_sdpa(q, k, v).square().sum()  # noqa: E731
    grads = (torch.func.grad(f, argnums=(0, 1, 2)) for f in (loss, loss64))
    yield "grad", *grads, *qkv_args


@pytest.mark.parametrize("graph_break", [False, True], ids=["", "graph_break"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("entry", list(_vmapped_entry_points()), ids=lambda e: e[0])
def test_c1_vmap_of_a_compiled_function_on_duals(entry, backend, graph_break):
    """``vmap`` of a compiled function (not fullgraph) called on dual tensors gives the
    uncompiled call's tangents, which match plain float64 ops. (Before, Dynamo compiled our
    Functions' vmap rule as a frame of its own after the graph break and traced it without
    the jvp: no tangent, silently.)"""
    _, fn, ref, primals, tangents, in_dims = entry

    def body(*args):
        if graph_break:
            torch._dynamo.graph_break()
        return fn(*args)

    def tangents_of(f, primals, tangents):
        with fwAD.dual_level():
            out = torch.func.vmap(f, in_dims)(*map(fwAD.make_dual, primals, tangents))
            out = out if isinstance(out, tuple) else (out,)
            return [fwAD.unpack_dual(o).tangent for o in out]

    expected = tangents_of(body, primals, tangents)
    assert all(t is not None for t in expected)
    float64 = tangents_of(ref, _to64(*primals), _to64(*tangents))
    for i, (e, r) in enumerate(zip(expected, float64, strict=True)):
        assert_close_rel(f"eager tangent {i}", e, r, 1e-5)
    torch._dynamo.reset()
    got = tangents_of(torch.compile(body, backend=backend), primals, tangents)
    assert all(t is not None for t in got), [t is None for t in got]
    for i, (t, e) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(t, e, rtol=1e-5, atol=1e-5, msg=f"output {i}")


def _frozen_block():
    """A block of flash_jvp.nn layers (weights frozen: duals into a compiled function with
    trainable weights raise torch's NotImplementedError) and attention, on (B, H, L, E), and
    the same block in plain float64 ops."""
    from flash_jvp import nn as fnn

    norm, act, lin = fnn.LayerNorm(16), fnn.GELU(), fnn.Linear(16, 16)
    for m in (norm, lin):
        m.to(DEVICE).requires_grad_(False)

    def block64(q, k, v):
        w, b = norm.weight.double(), norm.bias.double()
        x = F.gelu(F.layer_norm(math_sdpa(q, k, v), (16,), w, b, norm.eps))
        return F.linear(x, lin.weight.double(), lin.bias.double())

    return lambda q, k, v: lin(act(norm(flash_jvp.attention(q, k, v)))), block64


@pytest.mark.parametrize("block", [False, True], ids=["attention", "nn_block"])
def test_c1_duals_after_a_vmapped_call_of_a_compiled_function(block):
    """A compiled function (aot_eager) called first under vmap, then on plain dual tensors,
    and a second compiled function after it, give the uncompiled call's tangent, which
    matches plain float64 ops. (Before, the vmapped call left our frames marked as skipped
    and Dynamo then compiled our eager helpers as frames of their own, where
    torch._make_dual and torch._unpack_dual lose the tangent: no tangent, silently, or an
    error inside Triton's interpreter.)"""
    fn, ref = _frozen_block() if block else (flash_jvp.attention, math_sdpa)
    q, k, v, tangents, _ = qkv(2, 2, 2, 24, 20, 16)
    q, k, v, *tangents = (x.unsqueeze(1) for x in (q, k, v, *tangents))  # (2, 1, H, L, E)

    def tangent_of(f, args, tans):
        with fwAD.dual_level():
            return fwAD.unpack_dual(f(*map(fwAD.make_dual, args, tans))).tangent

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager")
    batched = tangent_of(torch.func.vmap(compiled), (q, k, v), tangents)
    torch.testing.assert_close(batched, tangent_of(torch.func.vmap(fn), (q, k, v), tangents))
    one = (q[0], k[0], v[0]), [t[0] for t in tangents]
    expected = tangent_of(fn, *one)
    float64 = tangent_of(ref, *(_to64(*x) for x in one))
    assert_close_rel("uncompiled tangent", expected, float64, 1e-5)
    for f in (compiled, torch.compile(lambda *a: fn(*a) * 2, backend="aot_eager")):
        got = tangent_of(f, *one)
        assert got is not None
        torch.testing.assert_close(got, expected * (1 if f is compiled else 2))


def test_c1_cpu_without_interpreter_uses_the_fallback():
    """CPU tensors without TRITON_INTERPRET run the documented PyTorch path (no compile trace)."""
    code = (
        "import torch, flash_jvp\n"
        "from flash_jvp import _check\n"
        "q, k, v, tq, tk, tv, do = (torch.randn(2, 4, 128, 64) for _ in range(7))\n"
        "comps = _check.check_outputs(flash_jvp.attention, q, k, v, (tq, tk, tv), do,"
        " is_causal=True)\n"
        "_check.assert_ok(comps)\n"
        "print('ok', [f'{c.err:.1e}' for c in comps])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr


# ---------------------------------------------------------------- C2: functorch transforms
def _c2_inputs():
    q, k, v, tangents, _ = qkv(1, 2, 2, 32, 32, 16, dtype=torch.float32)
    return q, k, v, tangents


def _to64(*xs):
    return tuple(x.double() for x in xs)


def test_c2_jvp_and_grad():
    q, k, v, tangents = _c2_inputs()
    _, o_t = torch.func.jvp(flash_jvp.attention, (q, k, v), tangents)
    _, ref = torch.func.jvp(math_sdpa, _to64(q, k, v), _to64(*tangents))
    assert_close_rel("o_t", o_t, ref, 1e-5)
    g = torch.func.grad(lambda q: flash_jvp.attention(q, k, v).sum())(q)
    q64, k64, v64 = _to64(q, k, v)
    ref = torch.func.grad(lambda q: math_sdpa(q, k64, v64).sum())(q64)
    assert_close_rel("grad", g, ref, 1e-5)
    leaf = q.clone().requires_grad_()
    flash_jvp.attention(leaf, k, v).sum().backward()
    assert_close_rel("backward", leaf.grad, ref, 1e-5)


@pytest.mark.parametrize("transform", ["jacfwd", "jacrev"])
def test_c2_jacobians(transform):
    q, k, v, _ = _c2_inputs()
    q = q[:, :1, :8]
    k, v = k[:, :1], v[:, :1]
    jac = getattr(torch.func, transform)
    ours = jac(lambda q: flash_jvp.attention(q, k, v))(q)
    k64, v64 = _to64(k, v)
    ref = jac(lambda q: math_sdpa(q, k64, v64))(q.double())
    assert_close_rel(transform, ours, ref, 1e-5)


def test_c2_vmap_around_jvp():
    """Per-sample tangents: vmap over an extra leading dim of 3 wrapped around jvp."""
    q, k, v, tangents, _ = qkv(3, 2, 2, 32, 32, 16)
    stacked = [x.unsqueeze(1) for x in (q, k, v, *tangents)]

    def per_sample(fn):
        return torch.func.vmap(
            lambda q, k, v, tq, tk, tv: torch.func.jvp(fn, (q, k, v), (tq, tk, tv))[1]
        )

    ours = per_sample(flash_jvp.attention)(*stacked)
    ref = per_sample(math_sdpa)(*_to64(*stacked))
    assert_close_rel("vmap(jvp)", ours, ref, 1e-5)
    q0, k0, v0 = stacked[0][0], stacked[1][0], stacked[2][0]
    ours = torch.func.vmap(
        lambda t: torch.func.jvp(flash_jvp.attention, (q0, k0, v0), (t, t, t))[1]
    )(stacked[3])
    ref = torch.func.vmap(lambda t: torch.func.jvp(math_sdpa, _to64(q0, k0, v0), (t, t, t))[1])(
        stacked[3].double()
    )
    assert_close_rel("vmap(jvp), tangents only batched", ours, ref, 1e-5)


# ---------------------------------------------------------------- C3: JVP + training step
class _Block(torch.nn.Module):
    def __init__(self, attn, heads=4, dim=128):
        super().__init__()
        self.attn, self.heads = attn, heads
        self.q, self.k, self.v, self.out = (torch.nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        B, L, C = x.shape

        def split(t):  # non-contiguous (B, H, L, E) views, as models produce them
            return t.view(B, L, self.heads, C // self.heads).transpose(1, 2)

        o = self.attn(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.out(o.transpose(1, 2).reshape(B, L, C))


@pytest.mark.parametrize("dtype", [torch.bfloat16 if CUDA else torch.float32], ids=DTYPE_IDS.get)
def test_c3_jvp_training_step_inside_a_model(dtype):
    """Three Adam steps of the sCM pattern; dpred and weight grads track a float64 twin."""
    torch.manual_seed(1)
    base = _Block(flash_jvp.attention)
    models = {
        "ours": base.to(dtype),
        "math": _Block(math_sdpa).to(dtype),
        "ref64": _Block(math_sdpa).double(),
    }
    for m in models.values():
        m.load_state_dict(
            {k: v.to(next(m.parameters()).dtype) for k, v in base.state_dict().items()}
        )
        m.to(DEVICE)
    opts = {n: torch.optim.Adam(m.parameters(), lr=1e-3) for n, m in models.items()}
    x, t, target = (randn(2, 64, 128, dtype=torch.float64) for _ in range(3))
    for step in range(3):
        res = {}
        for name, m in models.items():
            dt = next(m.parameters()).dtype
            pred, dpred = torch.func.jvp(m, (x.to(dt),), (t.to(dt),))
            loss = F.mse_loss(pred, target.to(dt)) + F.mse_loss(pred, dpred.detach())
            opts[name].zero_grad()
            loss.backward()
            # all weight gradients as one vector: some (the key bias) are zero analytically
            grads = torch.cat([p.grad.flatten().double() for p in m.parameters()])
            res[name] = (dpred.double(), grads)
        for i, what in enumerate(("dpred", "weight grads")):
            ours, math, ref = (res[n][i] for n in ("ours", "math", "ref64"))
            tol = _check.RTOL * _check.rel_err(math, ref) + 2 * _check.floor(dtype)
            assert _check.rel_err(ours, ref) <= tol, (step, what, _check.rel_err(ours, ref), tol)
        for opt in opts.values():
            opt.step()


# ---------------------------------------------------------------- C4: tangent subsets
def _c4_inputs(dtype):
    return qkv(2, 4, 4, 64, 77, 64, dtype=dtype)


@DTYPE
@pytest.mark.parametrize("subset", ["q", "kv", "v", "k"])
def test_c4_tangent_on_a_subset(dtype, subset):
    q, k, v, tangents, do = _c4_inputs(dtype)
    given = tuple(t if name in subset else None for name, t in zip("qkv", tangents))
    originals = [None if t is None else t.clone() for t in given]
    assert_matches_reference(flash_jvp.attention, q, k, v, given, do, names=("o", "o_t"))
    for t, orig in zip(given, originals):  # never written into
        assert t is None or torch.equal(t, orig)


@DTYPE
def test_c4_q_only_three_ways_agree(dtype):
    """(i) jvp w.r.t. q alone, (iv) explicit zero tangents for k, v, (v) only q dual."""
    q, k, v, (q_t, _, _), _ = _c4_inputs(dtype)
    _, a = torch.func.jvp(lambda q: flash_jvp.attention(q, k, v), (q,), (q_t,))
    _, b = torch.func.jvp(flash_jvp.attention, (q, k, v), (q_t, torch.zeros_like(k),
                                                          torch.zeros_like(v)))  # fmt: skip
    with fwAD.dual_level():
        c = fwAD.unpack_dual(flash_jvp.attention(fwAD.make_dual(q, q_t), k, v)).tangent
    ref = _ref_o_t(q, k, v, (q_t, None, None))
    for name, x in (("i", a), ("iv", b), ("v", c)):
        assert_close_rel(name, x, ref, _tol(dtype))
    torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_c4_zero_tangents_give_zero_o_t():
    q, k, v, _, _ = _c4_inputs(torch.float32)
    _, o_t = torch.func.jvp(flash_jvp.attention, (q, k, v), tuple(map(torch.zeros_like, (q, k, v))))
    assert torch.equal(o_t, torch.zeros_like(o_t))


@pytest.mark.parametrize("subset", ["q", "qkv"])
def test_c4_forward_over_reverse(subset):
    """torch.func.jvp(torch.func.grad(mse)) - the tangent of the gradients - matches REF."""
    q, k, v, tangents, _ = qkv(2, 4, 4, 32, 40, 32)
    target = randn(*q.shape)

    def grads(fn, q, k, v):
        def loss(q, k, v):
            return ((fn(q, k, v) - target.to(q.dtype)) ** 2).mean()

        return torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def tangent_of_grads(fn, q, k, v, tangents):
        if subset == "q":
            return torch.func.jvp(lambda q: grads(fn, q, k, v), (q,), tangents[:1])[1]
        return torch.func.jvp(lambda q, k, v: grads(fn, q, k, v), (q, k, v), tangents)[1]

    ours = tangent_of_grads(flash_jvp.attention, q, k, v, tangents)
    ref = tangent_of_grads(math_sdpa, *_to64(q, k, v), tuple(_to64(*tangents)))
    for name, a, b in zip(("dq_t", "dk_t", "dv_t"), ours, ref):
        assert_close_rel(name, a, b, 1e-5)


# ---------------------------------------------------------------- C6: backward
@CAUSAL
@pytest.mark.parametrize("L", [128, pytest.param(1024, marks=gpu)])
def test_c6_backward_through_jvp_primal_and_plain_forward(L, is_causal):
    q, k, v, tangents, do = qkv(1, 2, 2, L, L, 64, dtype=torch.float16)
    ref = reference.sdpa_outputs(q, k, v, tangents, do, is_causal=is_causal)
    same = reference.sdpa_outputs(q, k, v, tangents, do, dtype=None, is_causal=is_causal)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    plain = torch.autograd.grad(flash_jvp.attention(*leaves, is_causal=is_causal), leaves, do)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(x, t) for x, t in zip(leaves, tangents)]
        o = fwAD.unpack_dual(flash_jvp.attention(*duals, is_causal=is_causal)).primal
        through_jvp = torch.autograd.grad(o, leaves, do)
    for grads in (plain, through_jvp):
        ours = reference.Outputs(ref.o, ref.o_t, *grads)
        _check.assert_ok(_check.compare(ours, ref, same, q.dtype, names=("dq", "dk", "dv")))


@CAUSAL
def test_c6_near_one_hot_softmax(is_causal):
    """One query row almost parallel to one key with a huge logit: softmax nearly one-hot."""
    q, k, v, tangents, do = qkv(1, 2, 2, 128, 128, 64, dtype=torch.float16)
    k[:, :, 3] = q[:, :, 100] * 3
    assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, is_causal=is_causal)


# ---------------------------------------------------------------- C7: odd lengths + poison
C7_LENGTHS = [(n, n) for n in (1, 9, 12, 17, 63, 65, 100)] + [(64, 77)]
C7_LENGTHS += [pytest.param((1001, 1001), marks=gpu), pytest.param((1001, 503), marks=gpu)]


def _poisoned_copy(x: torch.Tensor) -> torch.Tensor:
    """x's values inside a larger NaN-filled buffer, so any out-of-bounds read shows."""
    buf = torch.full((x.shape[0] + 1, x.shape[1] + 1, x.shape[2] + 3, x.shape[3] + 8),
                     float("nan"), dtype=x.dtype, device=x.device)  # fmt: skip
    view = buf[1:, 1:, 2:-1, 5:-3]
    view.copy_(x)
    return view


@DTYPE
@pytest.mark.parametrize("lengths", C7_LENGTHS, ids=lambda n: f"Lq{n[0]}-Lk{n[1]}")
def test_c7_odd_lengths_and_poisoned_neighbours(dtype, lengths):
    Lq, Lk = lengths
    q, k, v, tangents, do = qkv(2, 2, 2, Lq, Lk, 64, dtype=dtype)
    assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do)
    clean = reference.run_outputs(flash_jvp.attention, q, k, v, tangents, do, is_causal=True)
    poisoned = reference.run_outputs(
        flash_jvp.attention, *map(_poisoned_copy, (q, k, v)),
        tuple(map(_poisoned_copy, tangents)), _poisoned_copy(do), is_causal=True,
    )  # fmt: skip
    # the kernels read only in-bounds elements, whatever the strides: equal bits. The CPU
    # fallback's BLAS picks its blocking by stride, so there the bits may differ (not NaN).
    exact = _utils.uses_kernels(q.device)
    for name, a in clean.as_dict().items():
        b = getattr(poisoned, name)
        if exact:
            assert torch.equal(a, b), f"{name} differs when neighbouring memory is NaN"
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"{name} (fallback)")


# ---------------------------------------------------------------- C8: head dims, GQA
C8_DIMS = [(e, e) for e in (32, 64, 72, 80, 96, 128, 160, 256)] + [(64, 128)]


@DTYPE
@pytest.mark.parametrize("dims", C8_DIMS, ids=lambda d: f"E{d[0]}-Ev{d[1]}")
def test_c8_head_dims(dtype, dims):
    E, Ev = dims
    L = 128 if CUDA else 40
    q, k, v, tangents, do = qkv(1, 2, 2, L, L, E, Ev, dtype=dtype)
    assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, is_causal=True)


@DTYPE
@CAUSAL
def test_c8_gqa_sums_tangents_and_grads_over_groups(dtype, is_causal):
    q, k, v, tangents, do = qkv(1, 8, 2, 128 if CUDA else 48, 128 if CUDA else 48, 64, dtype=dtype)
    assert_matches_reference(
        flash_jvp.attention, q, k, v, tangents, do, is_causal=is_causal, enable_gqa=True
    )


@needs_kernels
def test_c8_unsupported_head_dim_is_a_clear_error():
    q = randn(1, 2, 16, 320)
    with pytest.raises(NotImplementedError, match="head_dim 320 is not supported"):
        flash_jvp.attention(q, q, q)


# ---------------------------------------------------------------- C9: fp32 means fp32
@CAUSAL
@pytest.mark.parametrize("tangent_scale", [1.0, 1e3])
def test_c9_fp32_is_ieee_fp32(is_causal, tangent_scale):
    q, k, v, tangents, do = qkv(1, 2, 2, 128, 128, 32, dtype=torch.float32)
    tangents = tuple(t * tangent_scale for t in tangents)
    ours = reference.run_outputs(flash_jvp.attention, q, k, v, tangents, do, is_causal=is_causal)
    ref = reference.sdpa_outputs(q, k, v, tangents, do, is_causal=is_causal)
    for name, x in ours.as_dict().items():
        assert_close_rel(name, x, getattr(ref, name), 1e-5)


@gpu
@CAUSAL
def test_c9_tf32_when_allowed(is_causal):
    q, k, v, tangents, do = qkv(1, 2, 2, 128, 128, 32, dtype=torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = True
    ours = reference.run_outputs(flash_jvp.attention, q, k, v, tangents, do, is_causal=is_causal)
    ref = reference.sdpa_outputs(q, k, v, tangents, do, is_causal=is_causal)
    errs = {n: _check.rel_err(x, getattr(ref, n)) for n, x in ours.as_dict().items()}
    assert all(e < 5e-3 for e in errs.values()), errs
    assert max(errs.values()) > 1e-5, f"TF32 allowed but results look IEEE: {errs}"


# ---------------------------------------------------------------- C10: strides and layouts
def _layouts(B, L, H, E, dtype):
    """q, k, v from a fused (B, L, 3, H, E) projection; v from a (B, H, E, L) buffer."""
    qkv_ = randn(B, L, 3, H, E, dtype=dtype)
    q, k, _ = (t.transpose(1, 2) for t in qkv_.unbind(2))
    v = randn(B, H, E, L, dtype=dtype).transpose(2, 3)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16 if CUDA else torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("L", [64, pytest.param(4095, marks=gpu), pytest.param(4096, marks=gpu)])
def test_c10_strided_views_match_contiguous(dtype, L):
    B, H, E = 2, 4, 64
    q, k, v = _layouts(B, L, H, E, dtype)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    tangents = tuple(randn(B, H, L, E, dtype=dtype) for _ in range(3))
    do = randn(B, L, H * E, dtype=dtype)  # the loss sees o.transpose(1, 2).reshape(B, L, H*E)

    def run(q, k, v, tangents):
        def f(q, k, v):
            return flash_jvp.attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, -1)

        _, o_t = torch.func.jvp(f, (q, k, v), tangents)
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        return (o_t, *torch.autograd.grad(f(*leaves), leaves, do))

    strided = run(q, k, v, tangents)
    dense = run(*(x.contiguous() for x in (q, k, v)), tangents)
    for name, a, b in zip(("o_t", "dq", "dk", "dv"), strided, dense):
        assert_close_rel(name, a, b, 1e-6)
    q64 = reference.sdpa_outputs(q, k, v, tangents, torch.zeros_like(q), is_causal=True).o_t
    assert_close_rel("o_t vs REF", strided[0].reshape(B, L, H, E).transpose(1, 2), q64,
                     4 * _check.floor(dtype))  # fmt: skip


@DTYPE
def test_c10_expanded_kv_and_tangent_strides(dtype):
    """K/V broadcast over the batch with stride 0 inside the function; tangents laid out
    unlike their primals."""
    q, _, _, (q_t, _, _), do = qkv(3, 2, 2, 48, 48, 32, dtype=dtype)
    k, v = randn(1, 2, 48, 32, dtype=dtype), randn(1, 2, 48, 32, dtype=dtype)
    k_t = randn(1, 48, 2, 32, dtype=dtype).transpose(1, 2)
    v_t = randn(1, 2, 32, 48, dtype=dtype).transpose(2, 3)

    def expanded(fn):
        return lambda q, k, v: fn(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1))

    assert_matches_reference(
        expanded(flash_jvp.attention), q, k, v, (q_t, k_t, v_t), do, ref_fn=expanded(math_sdpa)
    )


@DTYPE
@pytest.mark.parametrize("width", [72, 100, 75, 64 + 16 * 3])
def test_c10_row_strides_not_multiples_of_16(dtype, width):
    """Inputs and tangents sliced from rows of ``width`` elements: the kernels are told the
    largest power of two dividing every row stride (8, 4, 1, 16 here), so a wrong hint would
    address the wrong rows."""
    B, H, L, E = 2, 2, 40, 64

    def sliced():
        return randn(B, H, L, width, dtype=dtype)[..., 3 : 3 + E]

    q, k, v = sliced(), sliced(), sliced()
    tangents = (sliced(), sliced(), sliced())
    assert_matches_reference(flash_jvp.attention, q, k, v, tangents, sliced(), is_causal=True)


# ---------------------------------------------------------------- seed parity scenario
@DTYPE
def test_seed_parity_dual_tensors_that_require_grad(dtype):
    """shared/seed/jvp_parity.py: fwAD duals that require grad, loss on the output, backward
    inside the dual level; o, o_t, loss and grads match math SDPA (B=1, H=5, L=128, E=64)."""
    q, k, v, tangents, _ = qkv(1, 5, 5, 128, 128, 64, dtype=dtype)
    target = randn(*q.shape, dtype=dtype)

    def run(fn, cast):
        leaves = [cast(x).requires_grad_() for x in (q, k, v)]
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x, cast(t)) for x, t in zip(leaves, tangents)]
            out = fn(*duals)
            o, o_t = fwAD.unpack_dual(out)
            loss = (out - cast(target)).square().mean()
            loss.backward()
        return [o.detach(), o_t, loss.detach()] + [x.grad for x in leaves]

    ours = run(flash_jvp.attention, lambda x: x.clone())
    same = run(math_sdpa, lambda x: x.clone())
    ref = run(math_sdpa, lambda x: x.double())
    for name, a, b, r in zip(("o", "o_t", "loss", "dq", "dk", "dv"), ours, same, ref):
        tol = _check.RTOL * _check.rel_err(b, r) + _check.floor(dtype)
        assert _check.rel_err(a, r) <= tol, (name, _check.rel_err(a, r), tol)


# ---------------------------------------------------------------- nested transforms, empties
def test_nested_forward_mode_is_exact():
    """jvp of jvp and jacfwd of jacfwd: second-order tangents (taken by the PyTorch path)."""
    q, k, v, (t1, t2, _), _ = qkv(1, 1, 1, 8, 8, 16)
    k64, v64 = k.double(), v.double()

    def inner(fn, k, v, t1):
        return lambda a: torch.func.jvp(lambda x: fn(x, k, v), (a,), (t1,))[1]

    ours = torch.func.jvp(inner(flash_jvp.attention, k, v, t1), (q,), (t2,))[1]
    ref = torch.func.jvp(inner(math_sdpa, k64, v64, t1.double()), (q.double(),), (t2.double(),))[1]
    assert_close_rel("jvp(jvp)", ours, ref, 1e-5)
    hess = torch.func.jacfwd(torch.func.jacfwd(lambda a: flash_jvp.attention(a, k, v).sum()))(q)
    ref = torch.func.jacfwd(torch.func.jacfwd(lambda a: math_sdpa(a, k64, v64).sum()))(q.double())
    assert_close_rel("jacfwd(jacfwd)", hess, ref, 1e-5)


def test_jvp_of_vmap():
    q, k, v, _, _ = qkv(3, 1, 1, 8, 8, 16)
    qs, ts = q.unsqueeze(1), randn(3, 1, 1, 8, 16)

    def run(fn, k, v, qs, ts):
        return torch.func.jvp(torch.func.vmap(lambda a: fn(a, k[:1], v[:1])), (qs,), (ts,))[1]

    ours = run(flash_jvp.attention, k, v, qs, ts)
    ref = run(math_sdpa, k.double(), v.double(), qs.double(), ts.double())
    assert_close_rel("jvp(vmap)", ours, ref, 1e-5)


@pytest.mark.parametrize(
    "q_shape,k_shape",
    [((1, 2, 0, 16), (1, 2, 9, 16)), ((1, 0, 8, 16), (1, 0, 9, 16)), ((0, 8, 16), (0, 9, 16))],
    ids=["Lq0", "H0", "3d-N0"],
)
def test_empty_inputs_give_empty_outputs(q_shape, k_shape):
    q, k = randn(*q_shape).requires_grad_(), randn(*k_shape)
    o = flash_jvp.attention(q, k, k)
    assert o.shape == q_shape
    o.sum().backward()
    assert q.grad.shape == q_shape
