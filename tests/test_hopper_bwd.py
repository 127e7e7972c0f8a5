"""The Gluon warp-specialised backward (kernels/bwd_hopper.py) on Hopper: taken where
_ops._hopper_bwd routes to it, dq, dk, dv right against float64 in every case it serves (odd
lengths, causal with either alignment, rows and whole programs that see no key, keys fewer
than a program's 128, (B, L, H, E) memory, fp16) at each HEAD_DIM it takes, with lse's
cotangent, the same dk and dv on poisoned, unaligned or strided inputs as on contiguous
copies (bit for bit but strided at E=128), heads kept apart, and not taken outside its
scope (nor under torch.use_deterministic_algorithms: its dq sums in varying order;
tests/test_hopper_bwd_route.py checks the routing on any machine).

Its length threshold (configs.HOPPER_BWD_MIN_L) is lowered here so short cases exercise it;
one case runs past the shipped threshold.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CUDA, assert_matches_reference, qkv, randn
from test_hopper import _bhle, _broadcast, _poisoned
from test_tangent_backward import assert_tangent_grads
from torch.nn.attention.bias import causal_lower_right

import flash_jvp
from flash_jvp import _check, _ops
from flash_jvp.kernels import configs
from flash_jvp.reference import math_sdpa

HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="the Gluon backward is for Hopper (sm_90) only"),
]


@pytest.fixture
def bwd_seen(monkeypatch) -> list[tuple[int, ...]]:
    """q's shape at every launch of the Gluon backward, its threshold lowered to every
    length (and no launch plan made under other routes replayed)."""
    monkeypatch.setattr(configs, "HOPPER_BWD_MIN_L", 1)
    monkeypatch.setattr(_ops, "_CHOSEN", {})
    seen: list[tuple[int, ...]] = []
    launch = _ops._attn_bwd_hopper

    def spy(q, *args):
        seen.append(tuple(q.shape))
        return launch(q, *args)

    monkeypatch.setattr(_ops, "_attn_bwd_hopper", spy)
    return seen


# name: (B, H, Lq, Lk, kwargs); E: each of configs.HOPPER_BWD's, most lengths not multiples
# of the blocks
CASES = {
    "plain": (2, 2, 600, 600, {}),
    "odd": (1, 2, 777, 1000, {}),
    "long_q": (1, 2, 1000, 700, {}),
    "few_keys": (1, 2, 300, 60, {}),  # consumer 1's keys all past Lk
    "one_query": (2, 2, 1, 1030, {}),
    "causal": (2, 2, 640, 640, {"is_causal": True}),
    "causal_top_left_long_q": (1, 2, 900, 600, {"is_causal": True}),
    "causal_bottom_right": (1, 2, 300, 700, {"bottom_right": True}),
    "no_key_rows": (1, 2, 700, 600, {"bottom_right": True}),  # first 100 rows: none
    "no_key_program": (1, 2, 300, 700, {"is_causal": True}),  # keys 300.. see no row
    "bhle": (2, 3, 520, 520, {"bhle": True}),
    "fp16": (1, 2, 700, 700, {"dtype": torch.float16}),
}


HEAD_DIMS = sorted(configs.HOPPER_BWD)


def _inputs(case: str, E: int):
    B, H, Lq, Lk, kw = CASES[case]
    kw = dict(kw)
    q, k, v, tangents, do = qkv(B, H, H, Lq, Lk, E, dtype=kw.pop("dtype", torch.bfloat16))
    if kw.pop("bhle", False):
        q, k, v, do = (_bhle(x) for x in (q, k, v, do))
    if kw.pop("bottom_right", False):
        kw["attn_mask"] = causal_lower_right(Lq, Lk)
    return q, k, v, tangents, do, kw


@pytest.mark.parametrize("E", HEAD_DIMS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64(bwd_seen, case, E):
    """dq, dk, dv (and o, o_t, from the forwards) against float64."""
    q, k, v, tangents, do, kw = _inputs(case, E)
    assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, **kw)
    assert bwd_seen == [tuple(q.shape)]


@pytest.mark.parametrize("E", HEAD_DIMS)
def test_past_the_shipped_threshold(monkeypatch, E):
    """Lengths past configs.HOPPER_BWD_MIN_L take the route unforced; causal, not blocks'
    multiples."""
    L = configs.HOPPER_BWD_MIN_L + 33
    seen = []
    launch = _ops._attn_bwd_hopper
    monkeypatch.setattr(_ops, "_attn_bwd_hopper", lambda *a: seen.append(1) or launch(*a))
    q, k, v, tangents, do = qkv(1, 2, 2, L, L, E, dtype=torch.bfloat16)
    assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, is_causal=True)
    assert seen == [1]


def _grads_with_lse(q, k, v, do, dlse, causal):
    """dq, dk, dv of sum(o * do) + sum(lse * dlse) by flash_jvp in the inputs' dtype."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o, lse = flash_jvp.attention_with_lse(*leaves, is_causal=causal)
    return torch.autograd.grad((o * do).sum() + (lse * dlse).sum(), leaves)


@pytest.mark.parametrize("E", HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_lse_cotangent(monkeypatch, bwd_seen, causal, E):
    """dS gains P * dlse (delta - dlse in the kernel): against float64, within twice the
    Triton kernels' error in the same dtype plus a floor."""
    q, k, v, _, do = qkv(1, 2, 2, 700, 700, E, dtype=torch.bfloat16)
    dlse = randn(1, 2, 700)
    ours = _grads_with_lse(q, k, v, do, dlse, causal)
    assert len(bwd_seen) == 1
    monkeypatch.setattr(configs, "HOPPER_BWD", {})
    monkeypatch.setattr(_ops, "_CHOSEN", {})
    triton = _grads_with_lse(q, k, v, do, dlse, causal)
    assert len(bwd_seen) == 1
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    s = leaves[0] @ leaves[1].transpose(-1, -2) * E**-0.5
    if causal:
        s = s.masked_fill(torch.ones(700, 700, dtype=torch.bool, device=s.device).triu(1), -1e300)
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ leaves[2]
    loss = (o * do.double()).sum() + (lse * dlse.double()).sum()
    refs = torch.autograd.grad(loss, leaves)
    for name, a, b, ref in zip(("dq", "dk", "dv"), ours, triton, refs):
        err, bar = _check.rel_err(a, ref), 2 * _check.rel_err(b, ref) + 4e-3
        assert err <= bar, f"{name}: rel err {err:.3e} > {bar:.3e}"


@pytest.mark.parametrize("E", HEAD_DIMS)
@pytest.mark.parametrize("layout", ["aligned", "unaligned", "strided"])
def test_poisoned_inputs(bwd_seen, layout, E):
    """q, k, v, do as slices of NaN-filled buffers, read through TMA where it can describe
    them (aligned), copied first otherwise: dk and dv bit for bit those of contiguous copies
    (strided at E=128: equal to rounding; it differed in the last bits on the H100, most likely
    through the preprocess, which reads dO as laid out, and Triton may order the sum
    delta = rowsum(o dO) by the contiguous dim), dq equal but for its sums' order."""
    clean = [randn(2, 2, 650, E, dtype=torch.bfloat16) for _ in range(4)]
    runs = []
    for xs in (clean, [_poisoned(x, layout) for x in clean]):
        leaves = [x.detach().requires_grad_() for x in xs[:3]]
        o = flash_jvp.attention(*leaves, is_causal=True)
        runs.append(torch.autograd.grad(o, leaves, xs[3]))
    assert len(bwd_seen) == 2
    (dq, dk, dv), (dq2, dk2, dv2) = runs
    for a, b in ((dk, dk2), (dv, dv2)):
        if layout == "strided" and E == 128:
            assert not b.isnan().any() and _check.rel_err(b, a.double()) < 1e-2
        else:
            assert torch.equal(a, b)
    assert not dq2.isnan().any() and _check.rel_err(dq2, dq.double()) < 1e-2


@pytest.mark.parametrize("E", HEAD_DIMS)
def test_heads_stay_apart(bwd_seen, E):
    """inf in one head's keys leaves the other heads' gradients as they are without it: dq's
    reductions stay in their own head's rows (rows past Lq in its padding: they are not zero
    there; transposed, its E rows)."""
    q, k, v, _, do = qkv(2, 2, 2, 650, 650, E, dtype=torch.bfloat16)
    runs = []
    for bad in (False, True):
        leaves = [x.detach().clone() for x in (q, k, v)]
        if bad:
            leaves[1][0, 0, 5] = float("inf")
        leaves = [x.requires_grad_() for x in leaves]
        runs.append(torch.autograd.grad(flash_jvp.attention(*leaves), leaves, do))
    assert len(bwd_seen) == 2
    for clean, dirty in zip(*runs):
        assert torch.isfinite(dirty[0, 1]).all() and torch.isfinite(dirty[1]).all()
        assert _check.rel_err(dirty[0, 1], clean[0, 1].double()) < 1e-2
        assert _check.rel_err(dirty[1], clean[1].double()) < 1e-2


def test_deterministic_algorithms_keep_the_triton_kernels(bwd_seen):
    """Under torch.use_deterministic_algorithms the route is off: the same bits twice."""
    q, k, v, _, do = qkv(1, 2, 2, 700, 700, 64, dtype=torch.bfloat16)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = []
        for _ in range(2):
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            runs.append(torch.autograd.grad(flash_jvp.attention(*leaves), leaves, do))
    finally:
        torch.use_deterministic_algorithms(was)
    assert bwd_seen == []
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize(
    "case", ["e96", "gqa", "mask", "fp32", "varlen", "through_o_t", "expanded_kv"]
)
def test_not_taken(bwd_seen, case):
    """Outside its scope the Triton kernels run, and are right."""
    E = 96 if case == "e96" else 64
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    q, k, v, tangents, do = qkv(1, 4, 2 if case == "gqa" else 4, 300, 300, E, dtype=dtype)
    if case == "varlen":
        cu = torch.tensor([0, 120, 300], dtype=torch.int32, device=q.device)
        packed = [x[0].transpose(0, 1).contiguous().requires_grad_() for x in (q, k, v)]
        o = flash_jvp.varlen_attention(*packed, cu, cu, 180, 180)
        torch.autograd.grad(o, packed, do[0].transpose(0, 1))
    elif case == "through_o_t":  # a loss on o and o_t: the tangent backward
        do_t = randn(*do.shape, dtype=dtype)
        assert_tangent_grads(flash_jvp.attention, q, k, v, tangents, do, do_t)
    elif case == "expanded_kv":  # one head of k and v expanded over 4: a stride of 0
        k, v = (x[:, :1] for x in (k, v))
        tangents = (tangents[0], tangents[1][:, :1], tangents[2][:, :1])
        fn, ref = _broadcast(flash_jvp.attention, 1, 4), _broadcast(math_sdpa, 1, 4)
        assert_matches_reference(fn, q, k, v, tangents, do, ref_fn=ref)
    else:
        kw = {"enable_gqa": True} if case == "gqa" else {}
        if case == "mask":
            kw["attn_mask"] = randn(1, 1, 300, 300, dtype=dtype)
        assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, **kw)
    assert bwd_seen == []
