"""flash_jvp.nn: the fused norms (LayerNorm / RMSNorm, affine, adaLN modulation) against a
float64 reference of the same math in plain ops; y, its tangent, the backward through y and
through the tangent; convert / revert; the paths that fall back to plain ops."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import CUDA, DEVICE, DTYPE_IDS, DTYPES, randn
from torch import nn

import flash_jvp.nn as fnn
from flash_jvp import _check, _utils
from flash_jvp.nn import _activation, _linear, _norm, _residual
from flash_jvp.nn import functional as FN

FLOOR = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
WIDTHS = [1152, 37] if CUDA else [37, 64]


@pytest.fixture
def launches(monkeypatch):
    """Counts of the fused forward and backward launches (norms; "act": activations)."""
    count = {"fwd": 0, "bwd": 0, "act": 0}
    for name, module, attr in (("fwd", _norm, "fwd"), ("bwd", _norm, "bwd"),
                               ("act", _activation, "fwd")):  # fmt: skip
        real = getattr(module, attr)

        def counted(*args, _real=real, _name=name, **kwargs):
            count[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, attr, counted)
    return count


@pytest.fixture(params=["fused", "plain"])
def norm_path(request, monkeypatch):
    """The fused Function (CUDA or the interpreter) or the plain-op path (forced)."""
    if request.param == "fused" and not _utils.uses_kernels(torch.device(DEVICE)):
        pytest.skip("the fused kernels run on CUDA or under TRITON_INTERPRET=1")
    if request.param == "plain":  # what decides, for the norms and the activations
        monkeypatch.setattr(_norm, "_fusable", lambda *a: False)
        monkeypatch.setattr(_activation, "fusable_context", lambda: False)
    return request.param


def _case(kind, affine, mod, shape, dtype):
    """Inputs of one norm call: x, params, shift / scale, their tangents, cotangents."""
    D = shape[-1]
    x = randn(*shape, dtype=dtype)
    w = randn(D, dtype=dtype) if affine else None
    b = randn(D, dtype=dtype) if affine == "weight+bias" and kind == "layer" else None
    # "(T,1,D)": x (B, T, N, D), the modulation aligned with x's trailing dims as (1, T, 1, D)
    mshape = {"none": None, "(B,1,D)": (shape[0], *(1,) * (len(shape) - 2), D),
              "(D,)": (D,), "(B,L,D)": shape, "(T,1,D)": (shape[1], 1, D)}[mod]  # fmt: skip
    shift = None if mshape is None else randn(*mshape, dtype=dtype)
    scale = None if mshape is None else randn(*mshape, dtype=dtype, std=0.5)
    return x, w, b, shift, scale


def _call(kind, x, w, b, shift, scale, eps=1e-5):
    if kind == "layer":
        return FN.layer_norm(x, x.shape[-1], w, b, eps, shift=shift, scale=scale)
    return FN.rms_norm(x, x.shape[-1], w, eps, shift=shift, scale=scale)


def _reference(kind, x, w, b, shift, scale, dtype, eps=1e-5):
    return _norm.reference(x, w, b, shift, scale, kind == "rms", eps, 1, dtype)


def _everything(fn, kind, inputs, tangents, dy, dy_t):
    """y, y_t (torch.func.jvp over x, shift, scale), the gradients of <y, dy> of every input,
    and those of <y, dy> + <y_t, dy_t> (tangents included)."""
    x, w, b, shift, scale = inputs
    moving = [i for i, t in enumerate((x, shift, scale)) if t is not None]
    leaves = [t.detach().requires_grad_() if t is not None else None for t in inputs]
    tans = [t.detach().requires_grad_() for t in tangents]

    def f(*ps):
        args = [leaves[0], leaves[3], leaves[4]]
        for i, p in zip(moving, ps):
            args[i] = p
        return fn(kind, args[0], leaves[1], leaves[2], args[1], args[2])

    primals = tuple([leaves[0], leaves[3], leaves[4]][i] for i in moving)
    y, y_t = torch.func.jvp(f, primals, tuple(tans))
    wrt = [t for t in leaves if t is not None]
    g1 = torch.autograd.grad((y.double() * dy).sum(), wrt, retain_graph=True)
    g2 = torch.autograd.grad((y.double() * dy).sum() + (y_t.double() * dy_t).sum(), wrt + tans)
    return [y, y_t, *g1, *g2]


def _tolerances(kind, inputs, tangents, dy, dy_t, dtype):
    """Per output: 2x the error of the plain-op path in ``dtype`` against float64, + floor."""
    ref = _everything(_ref64, kind, [_f64(t) for t in inputs], [_f64(t) for t in tangents],
                      dy, dy_t)  # fmt: skip
    same = _everything(_plain_same, kind, inputs, tangents, dy, dy_t)
    return ref, [2 * _check.rel_err(s, r) + FLOOR[dtype] for s, r in zip(same, ref)]


def _f64(t):
    return None if t is None else t.detach().double()


def _ref64(kind, x, w, b, shift, scale):
    return _reference(kind, x, w, b, shift, scale, torch.float64)


def _plain_same(kind, x, w, b, shift, scale):
    dtype = _norm.out_dtype(x, shift, scale)
    return _reference(kind, x, w, b, shift, scale, dtype)


def _assert_all(name, got, ref, tols):
    for i, (g, r, tol) in enumerate(zip(got, ref, tols)):
        err = _check.rel_err(g, r)
        assert err <= tol, f"{name}: output {i}: rel err {err:.3e} > {tol:.1e}"


CASES = [
    ("layer", "weight+bias", "(B,1,D)", (2, 5)),
    ("layer", None, "(B,1,D)", (3, 4)),
    ("layer", "weight", "none", (2, 6)),
    ("layer", None, "(D,)", (7,)),
    ("rms", "weight", "(B,1,D)", (2, 5)),
    ("rms", None, "(B,L,D)", (2, 3)),
    ("rms", "weight", "none", (2, 2, 3)),
    # a modulation of fewer dims than x that varies over a middle dim, with B == T (where a
    # left-aligned reading passes unnoticed) and B != T
    ("layer", "weight+bias", "(T,1,D)", (3, 3, 4)),
    ("rms", None, "(T,1,D)", (2, 3, 4)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("kind,affine,mod,lead", CASES)
def test_norm_matches_float64(kind, affine, mod, lead, width, dtype, norm_path, launches):
    if dtype not in _utils.kernel_dtypes(torch.device(DEVICE)) and norm_path == "fused":
        pytest.skip("the interpreter computes bfloat16 wrongly")
    shape = (*lead, width)
    inputs = _case(kind, affine, mod, shape, dtype)
    x, _, _, shift, scale = inputs
    tangents = [randn(*t.shape, dtype=dtype) for t in (x, shift, scale) if t is not None]
    out_dtype = _norm.out_dtype(x, shift, scale)
    dy = randn(*shape, dtype=torch.float64)
    dy_t = randn(*shape, dtype=torch.float64)
    ref, tols = _tolerances(kind, inputs, tangents, dy, dy_t, dtype)
    got = _everything(_call, kind, inputs, tangents, dy, dy_t)
    assert got[0].dtype == got[1].dtype == out_dtype
    _assert_all(f"{kind} {affine} {mod} {shape} {dtype}", got, ref, tols)
    if norm_path == "fused":  # y and y_t in one pass; the backward through y alone in one
        assert launches == {"fwd": 1, "bwd": 1, "act": 0}
    else:
        assert launches == {"fwd": 0, "bwd": 0, "act": 0}


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_forward_ad_and_no_tangent(kind, norm_path, launches):
    """torch.autograd.forward_ad duals give torch.func.jvp's tangent; without tangents the
    output and its gradients are the same as with them."""
    import torch.autograd.forward_ad as fwAD

    x, w, b, shift, scale = _case(kind, "weight+bias", "(B,1,D)", (2, 9, 40), torch.float32)
    x_t, shift_t = randn(*x.shape), randn(*shift.shape)
    y_ref, y_t_ref = torch.func.jvp(
        lambda x, s: _call(kind, x, w, b, s, scale), (x, shift), (x_t, shift_t)
    )
    with fwAD.dual_level():
        y, y_t = fwAD.unpack_dual(
            _call(kind, fwAD.make_dual(x, x_t), w, b, fwAD.make_dual(shift, shift_t), scale)
        )
    assert y_t is not None
    assert torch.equal(y, y_ref) and torch.equal(y_t, y_t_ref)
    assert torch.equal(_call(kind, x, w, b, shift, scale), y_ref)


def test_double_backward_matches_float64(norm_path):
    """A backward that builds a graph (create_graph) goes through the plain ops: second
    derivatives right."""
    x, w, b, shift, scale = _case("layer", "weight+bias", "(B,1,D)", (2, 3, 16), torch.float32)
    v = randn(*x.shape, dtype=torch.float64)

    def hvp(x, w, b, shift, scale, fn):
        x = x.detach().requires_grad_()
        y = fn("layer", x, w, b, shift, scale)
        (g,) = torch.autograd.grad((y.double() ** 3).sum(), x, create_graph=True)
        return torch.autograd.grad((g.double() * v).sum(), x)[0]

    ref = hvp(*(t.double() for t in (x, w, b, shift, scale)), _ref64)
    got = hvp(x, w, b, shift, scale, _call)
    assert _check.rel_err(got, ref) < 1e-4


def test_transforms_take_the_plain_ops(launches):
    """vmap, a jvp of a jvp and torch.func.grad around the call: plain ops, right values."""
    x, w, b, shift, scale = _case("layer", "weight", "(B,1,D)", (3, 4, 16), torch.float32)
    x_t = randn(*x.shape)

    def f(x):
        return _call("layer", x, w, b, shift, scale)

    def ref(x):
        return _ref64("layer", x.double(), w.double(), None, shift.double(), scale.double())

    got = torch.vmap(lambda x, s, c: _call("layer", x, w, b, s, c))(x, shift, scale)
    assert _check.rel_err(got, ref(x)) < 1e-5
    second = torch.func.jvp(lambda x: torch.func.jvp(f, (x,), (x_t,))[1], (x,), (x_t,))[1]
    second_ref = torch.func.jvp(lambda x: torch.func.jvp(ref, (x,), (x_t.double(),))[1],
                                (x.double(),), (x_t.double(),))[1]  # fmt: skip
    assert _check.rel_err(second, second_ref) < 1e-4
    grad = torch.func.grad(lambda x: f(x).square().sum())(x)
    grad_ref = torch.func.grad(lambda x: ref(x).square().sum())(x.double())
    assert _check.rel_err(grad, grad_ref) < 1e-5
    assert launches == {"fwd": 0, "bwd": 0, "act": 0}


ACTIVATIONS = {
    "gelu": lambda x: FN.gelu(x),
    "gelu_tanh": lambda x: FN.gelu(x, approximate="tanh"),
    "silu": FN.silu,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("kind", list(ACTIVATIONS))
def test_activation_matches_float64(kind, dtype, norm_path, launches):
    """y, y_t, the backward through y and through (y, y_t) against float64, on a strided
    input of an odd size; wide inputs (|x| up to 12) reach the saturated tails."""
    if dtype not in _utils.kernel_dtypes(torch.device(DEVICE)) and norm_path == "fused":
        pytest.skip("the interpreter computes bfloat16 wrongly")
    x = (randn(3, 41, 7) * 4).clamp(-12, 12).to(dtype).transpose(0, 1)
    x_t = randn(*x.shape, dtype=dtype)
    dy, dy_t = randn(*x.shape, dtype=torch.float64), randn(*x.shape, dtype=torch.float64)

    def run(fn, x, x_t):
        x, x_t = x.detach().requires_grad_(), x_t.detach().requires_grad_()
        y, y_t = torch.func.jvp(fn, (x,), (x_t,))
        g1 = torch.autograd.grad((y.double() * dy).sum(), x, retain_graph=True)
        g2 = torch.autograd.grad((y.double() * dy).sum() + (y_t.double() * dy_t).sum(), (x, x_t))
        return [y, y_t, *g1, *g2]

    def plain(x):
        return _activation.reference(x, kind)

    ref = run(plain, x.double(), x_t.double())
    tols = [2 * _check.rel_err(s, r) + FLOOR[dtype] for s, r in zip(run(plain, x, x_t), ref)]
    got = run(ACTIVATIONS[kind], x, x_t)
    assert got[0].dtype == got[1].dtype == dtype
    _assert_all(f"{kind} {dtype}", got, ref, tols)
    fused = norm_path == "fused"
    assert launches == {"fwd": 0, "bwd": 0, "act": int(fused)}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize(
    "gate_shape",
    ["(B,1,D)", "(D,)", "(B,L,D)", "(L,D)", "(B,L,1) plain", "(T,1,D)", "(T,1,D) B!=T"],
)
def test_gated_residual_matches_float64(gate_shape, dtype, norm_path, monkeypatch):
    """x + gate * y with the residual stream in float32 and gate, y in ``dtype`` (a DiT
    under autocast): out, out_t and both backward passes against float64; a gate varying
    along the rows only ((B, L, 1)) takes the plain ops; "(T,1,D)": x (B, T, N, D), the gate
    aligned with its trailing dims."""
    if dtype not in _utils.kernel_dtypes(torch.device(DEVICE)) and norm_path == "fused":
        pytest.skip("the interpreter computes bfloat16 wrongly")
    if norm_path == "plain":
        monkeypatch.setattr(_residual, "fusable_context", lambda: False)
    calls = []
    real = _residual.dual_apply
    monkeypatch.setattr(_residual, "dual_apply", lambda *a: calls.append(1) or real(*a))
    B, L, D = 3, 7, 40
    xshape = {"(T,1,D)": (3, 3, 5, D), "(T,1,D) B!=T": (2, 3, 5, D)}.get(gate_shape, (B, L, D))
    gshape = {"(B,1,D)": (B, 1, D), "(D,)": (D,), "(B,L,D)": (B, L, D), "(L,D)": (L, D),
              "(B,L,1) plain": (B, L, 1), "(T,1,D)": (3, 1, D),
              "(T,1,D) B!=T": (3, 1, D)}  # fmt: skip
    inputs = [randn(*xshape), randn(*gshape[gate_shape], dtype=dtype),
              randn(*xshape, dtype=dtype)]  # fmt: skip
    tangents = [randn(*t.shape, dtype=t.dtype) for t in inputs]
    dout, dout_t = randn(*xshape, dtype=torch.float64), randn(*xshape, dtype=torch.float64)

    def run(fn, inputs, tangents):
        xs = [t.detach().requires_grad_() for t in inputs]
        ts = [t.detach().requires_grad_() for t in tangents]
        out, out_t = torch.func.jvp(fn, tuple(xs), tuple(ts))
        g1 = torch.autograd.grad((out.double() * dout).sum(), xs, retain_graph=True)
        g2 = torch.autograd.grad((out.double() * dout).sum() + (out_t.double() * dout_t).sum(),
                                 xs + ts)  # fmt: skip
        return [out, out_t, *g1, *g2]

    def plain(x, g, y):
        return x + g * y

    ref = run(plain, [_f64(t) for t in inputs], [_f64(t) for t in tangents])
    tols = [2 * _check.rel_err(s, r) + FLOOR[dtype]
            for s, r in zip(run(plain, inputs, tangents), ref)]  # fmt: skip
    got = run(FN.gated_residual, inputs, tangents)
    assert got[0].dtype == got[1].dtype == torch.float32
    _assert_all(f"gated residual {gate_shape} {dtype}", got, ref, tols)
    assert len(calls) == (norm_path == "fused" and gate_shape != "(B,L,1) plain")


def _one_input_layers():
    """Every fused layer as a function of one input x (its other operands fixed, no
    tangents), with the same function in plain float64 ops."""
    D = 24
    w, shift, scale = randn(7, D), randn(2, 1, D), randn(2, 1, D, std=0.5)
    gate, update = randn(2, 1, D), randn(2, 5, D)
    f64 = torch.float64
    return {
        "layer_norm": (lambda x: FN.layer_norm(x, D, shift=shift, scale=scale),
                       lambda x: _ref64("layer", x, None, None, shift.to(f64), scale.to(f64))),
        "rms_norm": (lambda x: FN.rms_norm(x, D, eps=1e-5),
                     lambda x: _ref64("rms", x, None, None, None, None)),
        "gelu": (FN.gelu, torch.nn.functional.gelu),
        "silu": (FN.silu, torch.nn.functional.silu),
        "gated_residual": (lambda x: FN.gated_residual(x, gate, update * x),
                           lambda x: x + gate.to(f64) * update.to(f64) * x),
        "linear": (lambda x: FN.linear(x, w), lambda x: x @ w.to(f64).T),
    }  # fmt: skip


@pytest.fixture
def fused_calls(monkeypatch):
    """How many fused Functions ran (dual_apply of every layer module)."""
    calls = []
    for module in (_norm, _activation, _residual, _linear):
        real = module.dual_apply
        monkeypatch.setattr(module, "dual_apply", lambda *a, _r=real: calls.append(1) or _r(*a))
    return calls


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("layer", list(_one_input_layers()))
def test_gradients_wrt_the_tangent_only(layer, create_graph, fused_calls):
    """Reverse mode into the tangent alone (the primal needs no gradient, as for a frozen
    layer applied to data): the gradient of <y, dy> + <y_t, dy_t> with respect to x_t, as
    plain ops give it (the fused Function's backward once failed on y having no graph)."""
    fn, ref = _one_input_layers()[layer]
    x, x_t = randn(2, 5, 24), randn(2, 5, 24)
    dy, dy_t = (
        randn(2, 5, 24 if layer != "linear" else 7),
        randn(2, 5, 24 if layer != "linear" else 7),
    )

    def grad(fn, x, x_t):
        x_t = x_t.detach().requires_grad_()
        y, y_t = torch.func.jvp(fn, (x,), (x_t,))
        loss = (y.double() * dy.double()).sum() + (y_t.double() * dy_t.double()).sum()
        return torch.autograd.grad(loss, x_t, create_graph=create_graph)[0]

    expected = grad(ref, x.double(), x_t.double())
    assert _check.rel_err(grad(fn, x, x_t), expected) < 1e-5
    assert len(fused_calls) == _fused_count(layer)


def _fused_count(layer: str) -> int:
    """Fused Functions one call of ``layer`` runs under a jvp: Linear's has no kernel."""
    return int(layer == "linear" or _utils.uses_kernels(torch.device(DEVICE)))


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("layer", list(_one_input_layers()))
def test_backward_inside_forward_ad_level(layer, create_graph, fused_calls):
    """A backward through the tangent (or one that builds a graph) taken inside
    ``forward_ad.dual_level`` (torch.func.jvp there would open a second forward-AD level,
    which torch refuses): the gradient of <y_t, dy_t> + <y, dy> with respect to x."""
    import torch.autograd.forward_ad as fwAD

    if layer == "silu" and not _fused_count(layer):
        pytest.skip("plain ops: torch's silu_backward has no forward-AD formula, so a "
                    "backward inside the level fails in torch itself")  # fmt: skip
    fn, ref = _one_input_layers()[layer]
    x, x_t = randn(2, 5, 24), randn(2, 5, 24)
    out = 24 if layer != "linear" else 7
    dy, dy_t = randn(2, 5, out, dtype=torch.float64), randn(2, 5, out, dtype=torch.float64)

    def loss(y, y_t):
        return (y.double() * dy).sum() + (y_t.double() * dy_t).sum()

    x64 = x.double().requires_grad_()
    expected = torch.autograd.grad(loss(*torch.func.jvp(ref, (x64,), (x_t.double(),))), x64)[0]
    leaf = x.detach().requires_grad_()
    with fwAD.dual_level():
        y, y_t = fwAD.unpack_dual(fn(fwAD.make_dual(leaf, x_t)))
        got = torch.autograd.grad(loss(y, y_t), leaf, create_graph=create_graph)[0]
    assert _check.rel_err(got, expected) < 1e-5
    assert len(fused_calls) == _fused_count(layer)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_float64(bias, dtype, monkeypatch):
    """y, y_t and the backward through y and through (y, y_t) against float64, through the
    one Function (counted), on a strided input."""
    calls = []
    real = _linear.dual_apply
    monkeypatch.setattr(_linear, "dual_apply", lambda *a: calls.append(1) or real(*a))
    x = randn(5, 3, 24, dtype=dtype).transpose(0, 1)
    w, b = randn(17, 24, dtype=dtype), randn(17, dtype=dtype) if bias else None
    x_t = randn(*x.shape, dtype=dtype)
    dy, dy_t = randn(3, 5, 17, dtype=torch.float64), randn(3, 5, 17, dtype=torch.float64)

    def run(fn, x, x_t, w, b):
        leaves = [t if t is None else t.detach().requires_grad_() for t in (x, w, b)]
        x, w, b = leaves
        x_t = x_t.detach().requires_grad_()
        y, y_t = torch.func.jvp(lambda x: fn(x, w, b), (x,), (x_t,))
        wrt = [t for t in leaves if t is not None]
        g1 = torch.autograd.grad((y.double() * dy).sum(), wrt, retain_graph=True)
        g2 = torch.autograd.grad((y.double() * dy).sum() + (y_t.double() * dy_t).sum(),
                                 [*wrt, x_t])  # fmt: skip
        return [y, y_t, *g1, *g2]

    ref = run(torch.nn.functional.linear, *(_f64(t) for t in (x, x_t, w, b)))
    same = run(torch.nn.functional.linear, x, x_t, w, b)
    tols = [2 * _check.rel_err(s, r) + FLOOR[dtype] for s, r in zip(same, ref)]
    assert not calls
    got = run(FN.linear, x, x_t, w, b)
    assert calls == [1]
    assert got[0].dtype == got[1].dtype == dtype
    _assert_all(f"linear {dtype} bias {bias}", got, ref, tols)
    assert torch.equal(FN.linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_tracing_and_fake_tensors_take_the_plain_ops(launches):
    """torch.jit.trace records plain ops (replayable on new inputs); under FakeTensorMode
    (what torch.compile's tracing uses) no kernel is launched on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device(DEVICE):
        model = fnn.convert(nn.Sequential(nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8)))
    traced = torch.jit.trace(model, (randn(4, 16),), check_trace=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = model(torch.empty(3, 16, device=DEVICE))
    assert y.shape == (3, 8)
    assert launches == {"fwd": 0, "bwd": 0, "act": 0}
    x = randn(5, 16)
    assert _check.rel_err(traced(x), model(x).double()) < 1e-6


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_strided_input(layout, norm_path):
    """Inputs whose rows are not contiguous (a transposed view, a slice of the width)."""
    base = randn(4, 33, 20) if layout == "transposed" else randn(4, 6, 50)
    x = base.transpose(1, 2) if layout == "transposed" else base[..., 5:38]
    w = randn(x.shape[-1])
    x_t = randn(*x.shape)
    y, y_t = torch.func.jvp(lambda x: _call("rms", x, w, None, None, None), (x,), (x_t,))
    y64, y_t64 = torch.func.jvp(lambda x: _ref64("rms", x, w.double(), None, None, None),
                                (x.double(),), (x_t.double(),))  # fmt: skip
    assert _check.rel_err(y, y64) < 1e-5 and _check.rel_err(y_t, y_t64) < 1e-5


def test_review_cases(norm_path):
    """Strided weight / bias, 0-dim modulation and gate, RMSNorm's default eps for fp16,
    output dtypes under CPU autocast and for float64 (torch's own rules)."""
    x = randn(2, 3, 8)
    w, b = randn(16)[::2], randn(16)[::2]
    ref = torch.nn.functional.layer_norm(x, (8,), w, b)
    assert _check.rel_err(FN.layer_norm(x, 8, w, b), ref.double()) < 1e-5
    ref = torch.nn.functional.rms_norm(x, (8,), w, 1e-5)
    assert _check.rel_err(FN.rms_norm(x, 8, w, 1e-5), ref.double()) < 1e-5
    half = torch.tensor(0.5)
    assert _check.rel_err(FN.gated_residual(x, half, x), (1.5 * x).double()) < 1e-6
    shifted = torch.nn.functional.layer_norm(x, (8,)) + 0.5
    assert _check.rel_err(FN.layer_norm(x, 8, shift=half), shifted.double()) < 1e-5
    small = randn(4, 16, dtype=torch.float16, std=1e-2)
    norm = nn.RMSNorm(16).to(DEVICE, torch.float16)
    ref = norm(small)
    assert _check.rel_err(fnn.convert(norm)(small), ref.double()) < 2e-3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for t in (randn(2, 8, dtype=torch.float16), randn(2, 8, dtype=torch.float64)):
            assert FN.layer_norm(t, 8).dtype == torch.nn.functional.layer_norm(t, (8,)).dtype
            assert FN.rms_norm(t, 8).dtype == t.dtype


def test_inputs_left_from_a_finished_transform(norm_path):
    """A tensor kept from a finished torch.func.grad (a dead wrapper) and closed over in a new
    torch.func.jvp is taken as its value by every fused layer (the unwrapping at the jvp's
    level once asserted inside torch)."""
    x, z, w = randn(2, 3, 16), randn(2, 3, 16), randn(8, 16)
    gate, gate_t = randn(2, 1, 16), randn(2, 1, 16)
    kept = []
    torch.func.grad(lambda x: kept.append(x * 1.0) or x.sum())(x)
    x64, z64, w64 = x.double(), z.double(), w.double()
    calls = {
        "gated_residual": (lambda g: FN.gated_residual(kept[0], g, z), lambda g: x64 + g * z64),
        "layer_norm": (lambda s: FN.layer_norm(kept[0], 16, shift=s),
                       lambda s: torch.nn.functional.layer_norm(x64, (16,)) + s),
        "linear": (lambda g: FN.linear(kept[0] * g, w), lambda g: (x64 * g) @ w64.T),
        "gelu": (lambda g: FN.gelu(kept[0] + g), lambda g: torch.nn.functional.gelu(x64 + g)),
    }  # fmt: skip
    for name, (fn, ref) in calls.items():
        y, y_t = torch.func.jvp(fn, (gate,), (gate_t,))
        y64, y_t64 = torch.func.jvp(ref, (gate.double(),), (gate_t.double(),))
        assert _check.rel_err(y, y64) < 1e-5 and _check.rel_err(y_t, y_t64) < 1e-5, name


class _Block(nn.Module):
    """A small adaLN block of every fused layer: modulated LayerNorm, GELU, SiLU, Linear and
    the gated residual."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(d, 3 * d))
        self.norm = fnn.LayerNorm(d, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU("tanh"), nn.Linear(2 * d, d))
        self.res = fnn.GatedResidual()

    def forward(self, x, c):
        shift, scale, gate = self.ada(c)[:, None].chunk(3, -1)
        return self.res(x, gate, self.mlp(self.norm(x, shift, scale)))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_jvp_values(backend):
    """torch.compile(fullgraph=True) of torch.func.jvp through a converted block (the
    plain-op path) gives the eager tangent and parameter gradients and float64's: not the
    zero tangent Dynamo gives for an autograd.Function's jvp."""
    torch.manual_seed(0)
    with torch.device(DEVICE):
        block = fnn.convert(_Block())
    ref64 = copy.deepcopy(block).double()
    x, c, x_t, c_t = randn(2, 5, 16), randn(2, 16), randn(2, 5, 16), randn(2, 16)

    def step(model, x, c, x_t, c_t):
        y, y_t = torch.func.jvp(model, (x, c), (x_t, c_t))
        return y, y_t, (y * y_t.detach()).sum()

    def run(fn, model, *args):
        y, y_t, loss = fn(model, *args)
        return [y, y_t, *torch.autograd.grad(loss, list(model.parameters()))]

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    got = run(compiled, block, x, c, x_t, c_t)
    eager = run(step, block, x, c, x_t, c_t)
    ref = run(step, ref64, *(t.double() for t in (x, c, x_t, c_t)))
    assert got[1].abs().max() > 0
    for g, e, r in zip(got, eager, ref):
        assert _check.rel_err(g, r) < 1e-5 and _check.rel_err(e, r) < 1e-5


def test_convert_edge_cases():
    """A module parametrized after convert survives revert (left converted); converting
    twice, or with a fused class in types, still reverts; a bare class as types."""
    lin = fnn.convert(nn.Linear(8, 4, device=DEVICE))
    torch.nn.utils.parametrizations.weight_norm(lin)
    fnn.revert(lin)
    assert lin(randn(3, 8)).shape == (3, 4)
    model = nn.Sequential(nn.LayerNorm(8), _PlainLayerNorm(8))
    fnn.convert(model)
    fnn.convert(model, types=(fnn.LayerNorm, _PlainLayerNorm))
    fnn.convert(model, types=_PlainLayerNorm)
    assert type(model[0]) is fnn.LayerNorm and isinstance(model[1], _PlainLayerNorm)
    fnn.revert(model)
    assert [type(m) for m in model] == [nn.LayerNorm, _PlainLayerNorm]


def test_errors():
    x = randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"normalized_shape \[6\].*size \[2, 3, 8\]"):
        FN.layer_norm(x, 6)
    with pytest.raises(ValueError, match=r"expected weight of shape \[8\], but got \[4\]"):
        FN.layer_norm(x, 8, randn(4))
    with pytest.raises(ValueError, match=r"shift of shape \[3, 1, 8\] does not broadcast"):
        FN.rms_norm(x, 8, shift=randn(3, 1, 8))
    with pytest.raises(TypeError, match="floating-point input"):
        FN.rms_norm(torch.ones(2, 8, dtype=torch.int64), 8)
    with pytest.raises(TypeError, match="expected scale to be a Tensor or None, but got float"):
        FN.layer_norm(x, 8, scale=0.5)
    with pytest.raises(TypeError, match=r"normalized_shape to be an int or a sequence of ints"):
        FN.layer_norm(x, 8.0)
    with pytest.raises(TypeError, match=r"expected eps to be a float, but got None"):
        FN.layer_norm(x, 8, eps=None)
    with pytest.raises(TypeError, match=r"expected eps to be a float, but got 'a'"):
        FN.rms_norm(x, 8, eps="a")
    with pytest.raises(TypeError, match=r"floating-point weight, but got torch.int64"):
        FN.layer_norm(x, 8, torch.ones(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh', but got 'erf'"):
        FN.gelu(x, approximate="erf")
    with pytest.raises(TypeError, match="silu: expected input to be a Tensor, but got list"):
        FN.silu([1.0])
    with pytest.raises(
        TypeError, match="subclasses of nn.LayerNorm, .* or flash_jvp.nn.GatedResidual, got .*ReLU"
    ):
        fnn.convert(nn.ReLU(), types=(nn.ReLU,))
    for fn in (fnn.convert, fnn.revert):
        with pytest.raises(TypeError, match="expected model to be a torch.nn.Module, but got"):
            fn(None)
    with pytest.raises(TypeError, match="argument 'weight' .* must be Tensor, not str"):
        torch.func.jvp(lambda x: FN.linear(x, "w"), (x,), (x,))


def test_what_torch_takes_the_layers_take(norm_path):
    """Arguments torch.nn's layers accept, through the converted layers and the functional
    forms: NumPy scalars as normalized_shape and eps; Linear with no input or no output
    features (its backward through the tangent too); F.linear's 1-D weight."""
    import numpy as np

    x = randn(2, 3, 8)
    for norm in (nn.LayerNorm(np.int64(8), eps=np.float32(1e-6), device=DEVICE),
                 nn.RMSNorm((np.int32(8),), eps=np.float64(1e-6), device=DEVICE)):  # fmt: skip
        ref = norm(x)
        assert _check.rel_err(fnn.convert(norm)(x), ref.double()) < 1e-5
    ref = torch.nn.functional.layer_norm(x, (8,))
    assert _check.rel_err(FN.layer_norm(x, np.int64(8), eps=np.float32(1e-5)), ref.double()) < 1e-5
    for n_in, n_out in ((0, 5), (5, 0)):
        lin = nn.Linear(n_in, n_out, device=DEVICE)
        x, x_t = randn(3, n_in), randn(3, n_in)
        grads = []
        for layer in (lin, fnn.convert(copy.deepcopy(lin))):
            y, y_t = torch.func.jvp(layer, (x,), (x_t,))
            loss = y.sum() + y_t.square().sum()
            grads.append(torch.autograd.grad(loss, (layer.weight, layer.bias)))
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    w, x, x_t = randn(8).requires_grad_(), randn(3, 8), randn(3, 8)
    grads = []
    for fn in (torch.nn.functional.linear, FN.linear):
        y, y_t = torch.func.jvp(lambda x, fn=fn: fn(x, w), (x,), (x_t,))
        grads.append(torch.autograd.grad(y.square().sum() + y_t.sum(), w)[0])
    assert y.shape == (3,) and torch.equal(*grads)


class _PlainLayerNorm(nn.LayerNorm):
    """A subclass computing the same function (a user's own, listed in ``types``)."""

    def forward(self, x):
        return super().forward(x)

    def same(self):
        return "kept"


class _OtherNorm(nn.LayerNorm):
    """A subclass with a different function: never converted unless listed."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_convert_and_revert(norm_path):
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = nn.Sequential(nn.Linear(24, 24), nn.LayerNorm(24), nn.GELU("tanh"),
                              nn.RMSNorm(24), _PlainLayerNorm(24), _OtherNorm(24), nn.SiLU(),
                              nn.Linear(24, 24))  # fmt: skip
    for m in model.modules():  # non-trivial affine parameters
        if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            with torch.no_grad():
                m.weight.add_(torch.randn_like(m.weight))
    params = list(model.parameters())
    x, x_t = randn(3, 5, 24), randn(3, 5, 24)
    y0, y0_t = torch.func.jvp(model, (x,), (x_t,))
    g0 = torch.autograd.grad((y0 * y0_t.detach()).sum(), params)
    classes = [type(m) for m in model]
    assert fnn.convert(model, types=(_PlainLayerNorm,)) is model
    fused = [fnn.Linear, fnn.LayerNorm, fnn.GELU, fnn.RMSNorm, None, _OtherNorm, fnn.SiLU,
             fnn.Linear]  # fmt: skip
    assert [type(m) for i, m in enumerate(model) if i != 4] == fused[:4] + fused[5:]
    # a subclass named in types keeps its class (and methods), with the fused forward
    assert isinstance(model[4], _PlainLayerNorm) and model[4].same() == "kept"
    assert type(model[4]).forward is fnn.LayerNorm.forward
    assert list(model.parameters()) == params  # the same Parameter objects
    y1, y1_t = torch.func.jvp(model, (x,), (x_t,))
    g1 = torch.autograd.grad((y1 * y1_t.detach()).sum(), params)
    for a, b in zip((y1, y1_t, *g1), (y0, y0_t, *g0)):
        assert _check.rel_err(a, b.double()) < 1e-5
    assert fnn.revert(model) is model
    assert [type(m) for m in model] == classes


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_autocast_cuda_graph_and_compile(kind):
    """bf16 autocast (float32 out, as autocast runs norms), a CUDA graph replay equal to the
    eager call, and torch.compile of torch.func.jvp (the plain-op path) with the same
    tangent as eager."""
    x, w, b, shift, scale = _case(kind, "weight+bias", "(B,1,D)", (4, 64, 1152), torch.float32)
    x, x_t, scale_t = x.bfloat16(), randn(*x.shape, dtype=torch.bfloat16), randn(*scale.shape)

    def step(x, x_t, scale_t):
        with torch.autocast("cuda", torch.bfloat16):
            return torch.func.jvp(lambda x, s: _call(kind, x, w, b, shift, s), (x, scale),
                                  (x_t, scale_t))  # fmt: skip

    y, y_t = step(x, x_t, scale_t)
    assert y.dtype == y_t.dtype == torch.float32
    y64, y_t64 = torch.func.jvp(
        lambda x, s: _ref64(kind, x, *(_f64(t) for t in (w, b, shift)), s),
        (x.double(), scale.double()), (x_t.double(), scale_t.double()),
    )  # fmt: skip
    assert _check.rel_err(y, y64) < 1e-5 and _check.rel_err(y_t, y_t64) < 1e-5
    graph = torch.cuda.CUDAGraph()
    step(x, x_t, scale_t)  # warm-up outside the capture (compiles the kernels)
    with torch.cuda.graph(graph):
        static = step(x, x_t, scale_t)
    graph.replay()
    assert torch.equal(static[0], y) and torch.equal(static[1], y_t)
    compiled = torch.compile(step, fullgraph=True)(x, x_t, scale_t)
    assert _check.rel_err(compiled[1], y_t64) < 1e-5


@pytest.mark.gpu
def test_linear_under_autocast_equals_torch():
    """bf16 autocast with fp32 weights: y, y_t in bf16 and the fp32 gradients of W, b and
    x equal torch's own autocast linear (the same casts and GEMMs)."""
    x, x_t = randn(64, 300, 1152), randn(64, 300, 1152)
    w, b = randn(3456, 1152, std=0.03).requires_grad_(), randn(3456).requires_grad_()
    dy = randn(64, 300, 3456, dtype=torch.bfloat16)

    def run(fn):
        x_ = x.clone().requires_grad_()
        with torch.autocast("cuda", torch.bfloat16):
            y, y_t = torch.func.jvp(lambda x: fn(x, w, b), (x_,), (x_t,))
        return [y, y_t, *torch.autograd.grad((y * dy).sum(), (x_, w, b))]

    got, ref = run(FN.linear), run(torch.nn.functional.linear)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype
        assert _check.rel_err(g, r.double()) < 1e-2
