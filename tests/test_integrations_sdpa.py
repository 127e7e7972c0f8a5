"""flash_jvp.patch_sdpa: which calls it routes, what it hands back, and how it restores."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from helpers import DEVICE
from integration_helpers import count_served, randn
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_jvp
from flash_jvp import _utils
from flash_jvp.integrations import sdpa as sdpa_patch

# float64 where the CPU fallback serves it; the kernels (interpreter, CUDA) take float32
DTYPE = torch.float32 if _utils.uses_kernels(torch.device(DEVICE)) else torch.float64
TOL = 1e-5 if DTYPE == torch.float32 else 1e-12


@pytest.fixture(autouse=True)
def _no_patch_left():
    yield
    assert not sdpa_patch._active, "a test left a patch in force"


def _qkv(B=2, H=2, Lq=6, Lk=6, E=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn(B, H, n, E, gen=gen).to(DEVICE, DTYPE) for n in (Lq, Lk, Lk))


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _math(fn, *args):
    with sdpa_kernel(SDPBackend.MATH):
        return fn(*args)


def test_encoder_layer_with_dropout_in_training(monkeypatch):
    """nn.TransformerEncoderLayer(dropout=0.1) in training calls SDPA with dropout_p=0.1: the
    patch hands the call to torch's SDPA, which gives what it gives without the patch (same
    random stream). In eval mode with parameters requiring grad (no fast path) flash_jvp
    serves the call (dropout_p=0) and matches math SDPA."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.1, batch_first=True)
    layer = layer.to(DEVICE, DTYPE).train()
    x = randn(2, 8, 32, gen=torch.Generator().manual_seed(1)).to(DEVICE, DTYPE)
    torch.manual_seed(2)
    expected = layer(x)
    log = count_served(monkeypatch)
    with flash_jvp.patch_sdpa():
        torch.manual_seed(2)
        y = layer(x)
    assert log == ["torch"]
    torch.testing.assert_close(y, expected, rtol=0, atol=0)

    layer.eval()
    expected = _math(layer, x)
    log.clear()
    with flash_jvp.patch_sdpa():
        y = layer(x)
    assert log == ["flash_jvp"]
    assert _rel(y, expected) <= TOL


def test_encoder_layer_inference_fast_path_not_reached(monkeypatch):
    """In eval mode without grad, nn.TransformerEncoderLayer takes torch's fused inference
    path, which never calls F.scaled_dot_product_attention (as patch_sdpa documents)."""
    layer = torch.nn.TransformerEncoderLayer(32, 2, 64, batch_first=True).to(DEVICE).eval()
    log = count_served(monkeypatch)
    with flash_jvp.patch_sdpa(), torch.no_grad():
        layer(torch.randn(2, 8, 32, device=DEVICE))
    assert log == []


@pytest.mark.skipif(
    not _utils.uses_kernels(torch.device(DEVICE)),
    reason="the kernels' float64 refusal (TRITON_INTERPRET=1 or CUDA); the CPU fallback serves it",
)
def test_float64_handed_back_by_the_kernels(monkeypatch):
    q, k, v = (x.double() for x in _qkv())
    assert flash_jvp.supports(q, k, v)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    log = count_served(monkeypatch)
    with flash_jvp.patch_sdpa():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert log == ["torch"]
    torch.testing.assert_close(o, expected, rtol=0, atol=0)


def _record_previous(monkeypatch):
    """Install a fake SDPA that records its arguments, so a patch's hand-back is visible."""
    seen = []

    def fake(*args, **kwargs):
        seen.append((args, kwargs))
        return "torch's result"

    monkeypatch.setattr(F, "scaled_dot_product_attention", fake)
    return seen


@pytest.mark.parametrize(
    "make_call",
    [
        lambda q, k, v: ((q, k, v), {"dropout_p": 0.1}),
        lambda q, k, v: ((q, k[..., :0, :], v[..., :0, :]), {}),  # no keys
        lambda q, k, v: ((q, k, v), {"unknown_option": 1}),
        lambda q, k, v: (
            (q, k, v, torch.ones(6, 6, dtype=torch.bool, device=DEVICE)),
            {"is_causal": True},
        ),
        lambda q, k, v: ((q, k, v, None, 0.0, False, 0.5), {}),  # scale is keyword-only
        lambda q, k, v: ((q, k, v.to(torch.float16)), {}),
    ],
    ids=["dropout", "no_keys", "unknown_kwarg", "mask_and_causal", "positional_scale", "dtypes"],
)
def test_refused_calls_handed_back_unchanged(make_call, monkeypatch):
    """Calls flash_jvp refuses reach the replaced function with the very same arguments."""
    args, kwargs = make_call(*_qkv())
    seen = _record_previous(monkeypatch)
    with flash_jvp.patch_sdpa():
        assert F.scaled_dot_product_attention(*args, **kwargs) == "torch's result"
    assert len(seen) == 1
    assert all(a is b for a, b in zip(seen[0][0], args)) and len(seen[0][0]) == len(args)
    assert seen[0][1] == kwargs


def test_supported_call_served_with_all_options(monkeypatch):
    """Every SDPA option reaches flash_jvp: mask, scale, GQA."""
    q, k, v = _qkv(H=4)
    k, v = k[:, :2], v[:, :2]
    mask = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(3)).to(DEVICE) > 0.3
    kwargs = {"attn_mask": mask, "scale": 0.7, "enable_gqa": True}
    expected = _math(lambda: F.scaled_dot_product_attention(q, k, v, **kwargs))
    log = count_served(monkeypatch)
    with flash_jvp.patch_sdpa():
        o = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert log == ["flash_jvp"]
    assert _rel(o, expected) <= TOL


def _jvp(q, k, v, tangents, **kwargs):
    return torch.func.jvp(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs), (q, k, v), tangents
    )


def _dual(q, k, v, q_t):
    with fwAD.dual_level():
        o = F.scaled_dot_product_attention(fwAD.make_dual(q, q_t), k, v)
        return fwAD.unpack_dual(o)


def _dual_mask(q, k, v, mask, mask_t):
    with fwAD.dual_level():
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=fwAD.make_dual(mask, mask_t))
        return fwAD.unpack_dual(o)


def _grad(q, k, v):
    return torch.func.grad(lambda q: F.scaled_dot_product_attention(q, k, v).square().sum())(q)


def _vmap_jvp(q, k, v, tangents):
    return torch.func.vmap(lambda *xs: _jvp(*xs[:3], xs[3:]))(q, k, v, *tangents)


def _cases():
    q, k, v = _qkv()
    tangents = _qkv(seed=1)
    gen = torch.Generator().manual_seed(4)
    mask, mask_t = (randn(2, 2, 6, 6, gen=gen).to(DEVICE, DTYPE) for _ in range(2))
    return {
        "plain": (lambda: F.scaled_dot_product_attention(q, k, v), "torch"),
        "torch.func.jvp": (lambda: _jvp(q, k, v, tangents, is_causal=True), "flash_jvp"),
        "forward_ad dual query": (lambda: _dual(q, k, v, tangents[0]), "flash_jvp"),
        "forward_ad dual mask": (lambda: _dual_mask(q, k, v, mask, mask_t), "flash_jvp"),
        "torch.func.grad": (lambda: _grad(q, k, v), "torch"),
        "vmap of jvp": (lambda: _vmap_jvp(q, k, v, tangents), "flash_jvp"),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_only_forward_ad_routing(case, monkeypatch):
    """only_forward_ad=True: forward-mode calls go to flash_jvp, the others to torch's SDPA;
    each result equals math SDPA's."""
    call, expected_server = _cases()[case]
    expected = _math(call)
    log = count_served(monkeypatch)
    with flash_jvp.patch_sdpa(only_forward_ad=True):
        result = call()
    assert log and set(log) == {expected_server}, log
    pairs = zip(result, expected) if isinstance(result, tuple) else [(result, expected)]
    for x, ref in pairs:
        assert _rel(x, ref) <= TOL, case


def test_jvp_and_grads_of_a_patched_model_equal_math_sdpa(monkeypatch):
    """An sCM-style step through nn.TransformerEncoderLayer (dropout 0, key padding mask) with
    the patch equals the step through math SDPA: pred, dpred and every parameter gradient."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    layer = layer.to(DEVICE, DTYPE).train()
    gen = torch.Generator().manual_seed(1)
    x, x_t = (randn(2, 8, 32, gen=gen).to(DEVICE, DTYPE) for _ in range(2))
    padding = torch.tensor([[False] * 8, [False] * 5 + [True] * 3], device=DEVICE)

    def step():
        pred, dpred = torch.func.jvp(lambda x: layer(x, src_key_padding_mask=padding), (x,), (x_t,))
        loss = (pred - 1).square().mean() + (pred - dpred.detach()).square().mean()
        return pred, dpred, *torch.autograd.grad(loss, list(layer.parameters()))

    expected = _math(step)
    log = count_served(monkeypatch)
    with flash_jvp.patch_sdpa():
        got = step()
    assert log == ["flash_jvp"]
    for i, (x, ref) in enumerate(zip(got, expected)):
        assert _rel(x, ref) <= 10 * TOL, f"output {i}"


def test_restore_semantics(monkeypatch):
    """Context exit, undo(), nesting, undo in any order, a second undo (does nothing), an
    exception inside the block, and code that replaced the function after the patch."""
    seen = _record_previous(monkeypatch)
    original = F.scaled_dot_product_attention

    with flash_jvp.patch_sdpa() as patch:
        assert F.scaled_dot_product_attention is patch.router and patch.previous is original
    assert F.scaled_dot_product_attention is original and not patch.active
    patch.undo()  # a second undo does nothing
    assert F.scaled_dot_product_attention is original

    with pytest.raises(KeyError), flash_jvp.patch_sdpa():
        raise KeyError
    assert F.scaled_dot_product_attention is original

    outer, inner = flash_jvp.patch_sdpa(), flash_jvp.patch_sdpa(only_forward_ad=True)
    assert inner.previous is outer.router
    outer.undo()  # the older one first: the newer one now hands its calls to the original
    assert F.scaled_dot_product_attention is inner.router and inner.previous is original
    inner.undo()
    assert F.scaled_dot_product_attention is original

    first, second = flash_jvp.patch_sdpa(), flash_jvp.patch_sdpa()
    second.undo()
    assert F.scaled_dot_product_attention is first.router
    first.undo()
    assert F.scaled_dot_product_attention is original

    patch = flash_jvp.patch_sdpa()
    router = patch.router

    def foreign(*args, **kwargs):  # e.g. a profiler wrapping whatever SDPA it found
        return router(*args, **kwargs)

    F.scaled_dot_product_attention = foreign
    patch.undo()
    assert F.scaled_dot_product_attention is foreign  # left in place
    q, k, v = _qkv()
    assert foreign(q, k, v) == "torch's result" and seen[-1][0] == (q, k, v)
    F.scaled_dot_product_attention = original


def test_bad_argument():
    with pytest.raises(TypeError, match="only_forward_ad"):
        flash_jvp.patch_sdpa(only_forward_ad="yes")


@pytest.mark.parametrize("only_forward_ad", [False, True])
def test_patch_compiles_without_graph_breaks(only_forward_ad):
    """A patched SDPA call inside torch.compile (fullgraph): no graph break, and the jvp's
    values equal math SDPA's. With only_forward_ad the router cannot ask which transforms are
    active while Dynamo traces (it used to fail there: functorch's interpreter stack is not
    traceable), so it routes every call flash_jvp serves."""
    q, k, v = _qkv()
    tangents = _qkv(seed=1)

    def fn(q, k, v, q_t, k_t, v_t):
        return torch.func.jvp(F.scaled_dot_product_attention, (q, k, v), (q_t, k_t, v_t))

    torch._dynamo.reset()
    with flash_jvp.patch_sdpa(only_forward_ad=only_forward_ad):
        assert torch._dynamo.explain(fn)(q, k, v, *tangents).graph_break_count == 0
        torch._dynamo.reset()
        o, o_t = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, *tangents)
    o_ref, o_t_ref = _math(fn, q, k, v, *tangents)
    assert _rel(o, o_ref) <= TOL and _rel(o_t, o_t_ref) <= TOL
    torch._dynamo.reset()
