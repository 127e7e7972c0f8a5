"""The Gluon warp-specialised forward (kernels/fwd_hopper.py) on Hopper: taken where the
launcher routes to it (configs.HOPPER), right against float64 in every case it serves (odd
lengths, GQA, causal with either alignment, rows that see no key, one query, (B, L, H, E)
memory), bit for bit the same on poisoned, unaligned or strided inputs as on contiguous
copies, and not taken outside its scope.

Every configs.HOPPER entry is forced on here, whether or not it ships, so each compiled
variant is checked on the GPU before it can be routed to.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CUDA, assert_close_rel, assert_matches_reference, qkv, randn
from test_tangent_backward import assert_tangent_grads
from torch.nn.attention.bias import causal_lower_right

import flash_jvp
from flash_jvp import _ops
from flash_jvp._utils import Spec
from flash_jvp.kernels import configs
from flash_jvp.reference import math_sdpa

HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="the Gluon forward is for Hopper (sm_90) only"),
]


@pytest.fixture
def hopper_seen(monkeypatch) -> list[tuple[bool, int]]:
    """(tangent, HEAD_DIM) of every launch of the Gluon forward, every offered entry on
    (and no launch plan made under other routes replayed: see _ops.forget_configs)."""
    monkeypatch.setattr(configs, "HOPPER", configs.HOPPER_COMPILED)
    monkeypatch.setattr(_ops, "_CHOSEN", {})
    seen: list[tuple[bool, int]] = []
    launch = _ops._attn_fwd_hopper

    def spy(q, k, v, q_t, *args):
        seen.append((q_t is not None, q.shape[-1]))
        return launch(q, k, v, q_t, *args)

    monkeypatch.setattr(_ops, "_attn_fwd_hopper", spy)
    return seen


def _bhle(x: torch.Tensor) -> torch.Tensor:
    """The same values as a (B, L, H, E) tensor seen as (B, H, L, E) (projection layout)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


# name: (B, Hq, Hkv, Lq, Lk, E, kwargs); lengths past configs.HOPPER_MIN_LK, most not
# multiples of the blocks
CASES = {
    "e64": (2, 2, 2, 600, 600, 64, {}),
    "e128_odd": (2, 2, 2, 777, 1000, 128, {}),
    "gqa_causal": (2, 4, 1, 640, 640, 64, {"is_causal": True}),
    "gqa4_e128": (1, 8, 2, 530, 530, 128, {}),
    "causal_top_left_long_q": (1, 2, 2, 900, 600, 128, {"is_causal": True}),
    "causal_bottom_right": (1, 2, 2, 300, 700, 64, {"bottom_right": True}),
    "no_key_rows": (1, 2, 2, 700, 600, 64, {"bottom_right": True}),  # first 100 rows: none
    "no_key_block": (1, 2, 2, 800, 600, 128, {"bottom_right": True}),  # a program with none
    "one_query": (2, 2, 2, 1, 1030, 128, {}),
    "one_query_causal": (1, 2, 2, 1, 555, 64, {"bottom_right": True}),
    "bhle": (2, 3, 3, 520, 520, 64, {"bhle": True}),
}


def _inputs(case: str, dtype=torch.bfloat16):
    B, Hq, Hkv, Lq, Lk, E, kw = CASES[case]
    q, k, v, tangents, do = qkv(B, Hq, Hkv, Lq, Lk, E, dtype=dtype)
    kw = dict(kw)
    if kw.pop("bhle", False):
        q, k, v, do = (_bhle(x) for x in (q, k, v, do))
        tangents = tuple(_bhle(t) for t in tangents)
    if kw.pop("bottom_right", False):
        kw["attn_mask"] = causal_lower_right(Lq, Lk)
    if Hq != Hkv:
        kw["enable_gqa"] = True
    return q, k, v, tangents, do, kw


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64(hopper_seen, case):
    """o, o_t (fwd+JVP) and the backward's dq, dk, dv (which read lse; the primal forward)
    against float64, at both head dims."""
    q, k, v, tangents, do, kw = _inputs(case)
    E = q.shape[-1]
    assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, **kw)
    assert set(hopper_seen) == {(False, E), (True, E)}


CANDIDATES = [(key, cfg) for key, cfgs in configs.HOPPER_CANDIDATES.items() for cfg in cfgs]


@pytest.mark.parametrize(
    "shape", [(777, 1000, {}), (900, 600, {"is_causal": True}), (800, 600, {"bottom_right": True})]
)
@pytest.mark.parametrize("key, cfg", CANDIDATES, ids=[f"{k}-{tuple(c)}" for k, c in CANDIDATES])
def test_candidates_match_float64(monkeypatch, key, cfg, shape):
    """Every variant the sweep may pick (configs.HOPPER_CANDIDATES), routed alone: o, o_t and
    the backward's gradients (through the variant's lse, or o_t) against float64; odd
    lengths, causal both alignments, a query block that sees no key (bottom-right, Lq - Lk
    >= BLOCK_M, 128 or 192)."""
    E = key[1]
    Lq, Lk, kw = shape
    monkeypatch.setattr(configs, "HOPPER", {key: cfg})
    monkeypatch.setattr(_ops, "_CHOSEN", {})
    seen = []
    launch = _ops._attn_fwd_hopper
    monkeypatch.setattr(_ops, "_attn_fwd_hopper", lambda *a: seen.append(a[-1]) or launch(*a))
    q, k, v, tangents, do = qkv(1, 2, 2, Lq, Lk, E, dtype=torch.bfloat16)
    kw = dict(kw)
    if kw.pop("bottom_right", False):
        kw["attn_mask"] = causal_lower_right(Lq, Lk)
    assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, **kw)
    assert seen and all(c == cfg for c in seen)


@pytest.mark.parametrize("case", ["e64", "gqa_causal", "no_key_rows", "e128_odd"])
def test_backward_through_tangent(hopper_seen, case):
    """mu (lse's tangent) from the Gluon fwd+JVP feeds the backward through o_t: right."""
    q, k, v, tangents, do, kw = _inputs(case)
    do_t = randn(*do.shape, dtype=do.dtype)
    assert_tangent_grads(flash_jvp.attention, q, k, v, tangents, do, do_t, **kw)
    assert (True, q.shape[-1]) in hopper_seen


def _poisoned(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x's values as a slice of a NaN-filled buffer (rows past the slice are another head's or
    NaN): TMA-describable ("aligned"), 2 bytes off with odd row strides ("unaligned"), or with
    a column stride other than 1 ("strided"); the last two are copied before the Gluon forward."""
    B, H, L, E = x.shape
    if layout == "strided":
        buf = torch.full((B, H + 1, E, L + 9), float("nan"), dtype=x.dtype, device=x.device)
        view = buf[:, 1:, :, 3 : 3 + L].transpose(-1, -2)
    else:
        pad = int(layout == "unaligned")
        buf = torch.full((B, H + 1, L + 9, E + pad), float("nan"), dtype=x.dtype, device=x.device)
        view = buf[:, 1:, 3 : 3 + L, pad:]
    view.copy_(x)
    return view


# q, k, v, q_t, k_t, v_t each its own way (forward AD hands tangents over laid out like
# their primals, so mixed layouts reach the launcher from other callers only)
MIXED = ("aligned", "unaligned", "strided", "strided", "aligned", "unaligned")


@pytest.mark.parametrize("E", [64, 128])
@pytest.mark.parametrize("layout", ["aligned", "unaligned", "strided", "mixed"])
@pytest.mark.parametrize("tangent", [False, True], ids=["fwd", "fwd+jvp"])
def test_poisoned_inputs(hopper_seen, tangent, layout, E):
    """Inputs as slices of NaN-filled buffers, TMA-describable or not: the same result bit
    for bit as contiguous copies, with lse and mu (the route does not depend on alignment)."""
    B, H, L = 2, 2, 650
    spec = Spec(scale=E**-0.5, causal_offset=None)
    clean = [randn(B, H, L, E, dtype=torch.bfloat16) for _ in range(6)]
    layouts = MIXED if layout == "mixed" else (layout,) * 6
    poisoned = [_poisoned(x, kind) for x, kind in zip(clean, layouts)]
    assert [_ops._describable(x) for x in poisoned] == [kind == "aligned" for kind in layouts]
    runs = []
    for xs in (clean, poisoned):
        tangents = xs[3:] if tangent else (None, None, None)
        runs.append(_ops.attn_fwd(*xs[:3], *tangents, None, None, spec))
    assert hopper_seen == [(tangent, E)] * 2
    for a, b in zip(*runs):
        if a is not None:
            assert not a.isnan().any()
            assert torch.equal(a, b)


def _broadcast(fn, dim: int, n: int):
    """fn with k and v expanded along ``dim`` to ``n`` inside it: a stride of 0 there."""

    def expanded(q, k, v, **kw):
        shape = [-1] * 4
        shape[dim] = n
        return fn(q, k.expand(*shape), v.expand(*shape), **kw)

    return expanded


def test_lse_against_float64(hopper_seen):
    q, k, v, _, _, _ = _inputs("e128_odd")
    spec = Spec(scale=q.shape[-1] ** -0.5, causal_offset=None)
    _, _, lse, _ = _ops.attn_fwd(q, k, v, None, None, None, None, None, spec)
    ref = torch.logsumexp(spec.scale * q.double() @ k.double().transpose(-1, -2), dim=-1)
    assert_close_rel("lse", lse, ref, 1e-5)
    assert hopper_seen == [(False, 128)]


@pytest.mark.parametrize(
    "case", ["short", "mask", "some_tangents", "e96", "fp32", "varlen", "expanded_kv"]
)
def test_not_taken(hopper_seen, case):
    """Outside its scope the Triton forward runs (and is right); k and v expanded over the
    heads (a stride of 0) too, which the Triton forward reads without a copy."""
    Lk = 300 if case == "short" else 600
    E = 96 if case == "e96" else 64
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    q, k, v, tangents, do = qkv(1, 2, 2, Lk, Lk, E, dtype=dtype)
    kw = {}
    if case == "mask":
        kw["attn_mask"] = torch.rand(1, 1, Lk, Lk, device=q.device) > 0.2
    if case == "some_tangents":  # q_t only: against float64 math SDPA's JVP
        o_t = torch.func.jvp(lambda q: flash_jvp.attention(q, k, v), (q,), (tangents[0],))[1]
        ref = torch.func.jvp(
            lambda q: torch.nn.functional.scaled_dot_product_attention(q, k.double(), v.double()),
            (q.double(),),
            (tangents[0].double(),),
        )[1]
        assert_close_rel("o_t", o_t, ref, 2e-2)
        assert hopper_seen == []
        return
    if case == "expanded_kv":
        k, v = k[:, :1], v[:, :1]
        tangents = (tangents[0], tangents[1][:, :1], tangents[2][:, :1])
        fn, ref = _broadcast(flash_jvp.attention, 1, 2), _broadcast(math_sdpa, 1, 2)
        assert_matches_reference(fn, q, k, v, tangents, do, ref_fn=ref)
        assert hopper_seen == []
        return
    if case == "varlen":
        cu = torch.tensor([0, 250, Lk], device=q.device, dtype=torch.int32)
        packed = [x[0].transpose(0, 1).contiguous() for x in (q, k, v)]
        flash_jvp.varlen_attention(*packed, cu, cu, 350, 350)
    else:
        assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, **kw)
    assert hopper_seen == []
