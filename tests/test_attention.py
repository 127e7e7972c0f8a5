"""o, o_t, dq, dk, dv against float64 math SDPA over the shape matrix (both tiers)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    CUDA,
    DTYPE_IDS,
    DTYPES,
    assert_matches_reference,
    needs_kernels,
    qkv,
    randn,
    slow_if,
)

import flash_jvp
from flash_jvp import _check

gpu = pytest.mark.gpu


def case(B, Hq, Hkv, Lq, Lk, E, Ev=None, marks=(), **kw):
    ev = "" if Ev is None else f"-Ev{Ev}"
    extra = "".join(f"-{k}{v}" for k, v in kw.items())
    return pytest.param(
        (B, Hq, Hkv, Lq, Lk, E, Ev), kw, marks=marks,
        id=f"B{B}-H{Hq}x{Hkv}-Lq{Lq}-Lk{Lk}-E{E}{ev}{extra}",
    )  # fmt: skip


SHAPES = [
    # awkward lengths, square
    *(case(1, 2, 2, n, n, 64) for n in (1, 17, 97, 128, 130)),
    # Lq != Lk in both directions (causal stays top-left aligned)
    case(1, 2, 2, 17, 130, 32),
    case(1, 2, 2, 130, 17, 32),
    case(2, 2, 2, 1, 33, 64),
    case(2, 2, 2, 33, 1, 64),
    # GQA / MQA
    case(1, 2, 1, 40, 40, 32),
    case(1, 4, 2, 65, 33, 32),
    case(2, 4, 1, 33, 65, 16),
    # head dims: padded tiles, value dim != query dim, tiny
    case(1, 2, 2, 48, 48, 8),
    case(1, 2, 2, 48, 48, 72),
    case(1, 2, 2, 48, 48, 96),
    case(1, 2, 2, 48, 48, 64, Ev=128),
    case(1, 2, 2, 48, 48, 72, Ev=40),
    case(1, 2, 1, 33, 40, 160, Ev=48),
    # custom scale, large-magnitude inputs
    case(1, 2, 2, 64, 64, 64, scale=0.3),
    case(1, 2, 2, 64, 64, 32, scale=2.0),
    # GPU only: long sequences, many heads
    case(2, 8, 8, 1025, 1025, 64, marks=gpu),
    case(1, 4, 4, 4096, 4096, 128, marks=gpu),
    case(1, 8, 2, 2048, 1000, 128, marks=gpu),
    case(1, 2, 2, 8192, 8192, 64, marks=gpu),
    case(4, 16, 16, 256, 256, 72, marks=gpu),
    case(1, 4, 4, 1000, 1000, 160, marks=gpu),
    case(1, 4, 4, 1000, 1000, 96, marks=gpu),
    case(2, 4, 2, 700, 900, 80, marks=gpu),
    case(1, 4, 4, 1000, 1000, 256, marks=gpu),
    # split head-dim tiles whose tail is partly padding (40: 32 + 16 with 8 real columns,
    # 72: 64 + 16 with 8, 136: 128 + 16 with 8) at key lengths off the key blocks: the
    # fwd+JVP kernel's o_t was wrong there once (Triton 3.6, sm_90)
    case(2, 4, 2, 1000, 777, 72, marks=gpu),
    case(1, 4, 4, 300, 77, 72, marks=gpu),
    case(1, 4, 4, 500, 1001, 40, marks=gpu),
    case(1, 2, 2, 600, 333, 136, marks=gpu),
]


def _slow_on_gpu(shape, dtype) -> bool:
    """float32 at head dims above 128 (the slowest kernels to compile) runs in the slow GPU
    tier only; bf16 and fp16 cover those head dims in the fast one."""
    E, Ev = shape[5], shape[6] or shape[5]
    return CUDA and dtype == torch.float32 and max(E, Ev) > 128


SHAPE_DTYPES = [
    pytest.param(*p.values, dtype, id=f"{p.id}-{DTYPE_IDS[dtype]}",
                 marks=(*p.marks, *slow_if(_slow_on_gpu(p.values[0], dtype))))
    for p in SHAPES for dtype in DTYPES
]  # fmt: skip


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape,kw,dtype", SHAPE_DTYPES)
def test_matches_float64_reference(shape, kw, dtype, is_causal):
    B, Hq, Hkv, Lq, Lk, E, Ev = shape
    q, k, v, tangents, do = qkv(B, Hq, Hkv, Lq, Lk, E, Ev, dtype=dtype)
    assert_matches_reference(
        flash_jvp.attention, q, k, v, tangents, do, is_causal=is_causal,
        enable_gqa=Hq != Hkv, **kw,
    )  # fmt: skip


# On the CPU, math SDPA in fp16 computes in fp32 inside, which no fp16 flash kernel matches
# once scores reach ~100: fp16 is judged on the GPU, where torch rounds like we do.
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES if CUDA else [torch.float32], ids=DTYPE_IDS.get)
def test_large_magnitude_inputs(dtype, is_causal):
    """Inputs with std 10: logits of order 100, an almost one-hot softmax.

    In fp16/bf16 the gradients are then held to PyTorch's flash backend, not math SDPA (the
    rule of flash_jvp._check: both take delta = rowsum(dO o O) from the rounded output). In
    fp32 the backward rebuilds P = exp(s - lse) from the stored fp32 lse, so its gradients may
    also lose |s| * 2^-24 relative (README, Accuracy): that much is added to their tolerance
    (a few 1e-5 here; the floor alone failed once in CI at 3.41e-5 vs 3.40e-5).
    """
    q, k, v, tangents, do = qkv(1, 2, 2, 64, 64, 64, dtype=dtype, std=10.0)
    kw = dict(is_causal=is_causal)
    if dtype != torch.float32:
        assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, **kw)
        return
    assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, names=("o", "o_t"), **kw)
    max_score = (q @ k.transpose(-1, -2)).abs().max().item() / q.shape[-1] ** 0.5
    lse_rounding = 4 * max_score * 2.0**-24
    for c in _check.check_outputs(flash_jvp.attention, q, k, v, tangents, do,
                                  names=("dq", "dk", "dv"), **kw):  # fmt: skip
        assert c.err <= c.tol + lse_rounding, f"{c.name}: {c.err:.3e} > {c.tol + lse_rounding:.3e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_leading_batch_dims_and_3d(dtype):
    """(N, ..., H, L, E) with several batch dims, and (N, L, E), as SDPA accepts."""
    q, k, v, tangents, do = qkv(6, 2, 2, 33, 40, 32, dtype=dtype)
    shape5 = (2, 3, 2)
    five = [x.reshape(*shape5, *x.shape[2:]) for x in (q, k, v)]
    t5 = tuple(t.reshape(*shape5, *t.shape[2:]) for t in tangents)
    assert_matches_reference(flash_jvp.attention, *five, t5, do.reshape(*shape5, 33, 32))
    three = [x[0] for x in (q, k, v)]
    assert_matches_reference(
        flash_jvp.attention, *three, tuple(t[0] for t in tangents), do[0], is_causal=True
    )


def test_empty_batch_gives_empty_output(device):
    q, k, v, _, _ = qkv(0, 2, 2, 16, 16, 32)
    o = flash_jvp.attention(q.requires_grad_(), k, v)
    assert o.shape == (0, 2, 16, 32)
    o.sum().backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("E", [64, 72])
def test_forward_is_deterministic(E):
    """o, o_t and the gradients bit for bit the same on every run (a race in a kernel, such
    as the one of the fwd+JVP kernel at E=72 on sm_90 once, shows here first)."""
    q, k, v, tangents, do = qkv(1, 2, 2, 77 if not CUDA else 1000, 77, E)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    runs = []
    for _ in range(3):
        o, o_t = torch.func.jvp(lambda *x: flash_jvp.attention(*x, is_causal=True),
                                tuple(leaves), tangents)  # fmt: skip
        runs.append((o, o_t, *torch.autograd.grad(o, leaves, do)))
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)


@gpu
@pytest.mark.skipif(not CUDA, reason="a race shows on the GPU's own schedule only")
@pytest.mark.parametrize(
    "E, Hkv, is_causal", [(128, 8, True), (128, 32, False), (64, 32, False), (64, 8, True)]
)
def test_shipped_forward_repeats_bit_for_bit(E, Hkv, is_causal):
    """fwd+JVP (300 calls) and the forward (100) of the shipped configs at a size where the
    descriptor path runs (bf16, 4096 keys): every call finite and equal to the first. Two
    warp-specialised configs gave a whole block of NaN in 2 and 4 of 300 calls on an H100
    with Triton 3.6's unused barriers on the key ring (kernels/ws_barriers.py), where the
    tests' three runs at L <= 1000 passed (benchmarks/NOTES.md, 2026-12-05)."""
    q, k, v, tangents, _ = qkv(1, 32, Hkv, 4096, 4096, E, dtype=torch.bfloat16)

    def fwd_jvp():
        return torch.func.jvp(
            lambda *x: flash_jvp.attention(*x, is_causal=is_causal, enable_gqa=True),
            (q, k, v),
            tangents,
        )

    def fwd():
        return (flash_jvp.attention(q, k, v, is_causal=is_causal, enable_gqa=True),)

    for fn, calls in ((fwd_jvp, 300), (fwd, 100)):
        first = fn()
        for call in range(calls):
            for name, a, b in zip(("o", "o_t"), first, fn()):
                assert torch.equal(a, b), (
                    f"{fn.__name__} call {call}: {name} differs from the first call; "
                    f"{a.isnan().sum().item()} / {b.isnan().sum().item()} NaN"
                )  # fmt: skip
        assert all(x.isfinite().all() for x in first)


@needs_kernels
def test_batch_times_heads_beyond_the_grid_limit():
    """A clear error instead of a failed launch (CUDA caps the grid's y dimension)."""
    q = randn(65536, 1, 1, 16)
    with pytest.raises(NotImplementedError, match="batch \\* heads = 65536"):
        flash_jvp.attention(q, q, q)


def test_head_tiles_are_the_narrowest_cover():
    """Every head dim is tiled as one power of two, or two (the second narrower), of the
    least total width (ties: one tile); tl.dot needs >= 16 columns."""
    from flash_jvp._ops import _head_tiles

    pow2 = [16, 32, 64, 128, 256]
    for e in range(1, 257):
        head, tail = _head_tiles(e)
        covers = [(h, t) for h in pow2 for t in [0, *pow2] if t < h and h + t >= e]
        best = min(covers, key=lambda ht: (ht[0] + ht[1], ht[1]))
        assert (head, tail) == best, e


def test_inputs_left_from_a_finished_torch_func_transform():
    """A tensor captured inside torch.func.grad and used after it (a dead wrapper) is taken
    as its plain value, as torch's own ops take it, on the no-grad path too and closed over
    inside a new torch.func.jvp."""
    q, k, v = (randn(1, 2, 24, 16) for _ in range(3))
    kept = []

    def f(q):
        kept.append(k * 1.0)  # a wrapper at grad's level, dead once grad returns
        return flash_jvp.attention(q, kept[-1], v).sum()

    torch.func.grad(f)(q)
    ref = flash_jvp.reference.math_sdpa(q.double(), k.double(), v.double())
    out = flash_jvp.attention(q, kept[-1], v)
    assert _check.rel_err(out, ref) <= 1e-5
    # closed over in a new torch.func.jvp (along v), also with v requiring grad
    v_t = randn(*v.shape)
    ref_t = torch.func.jvp(
        lambda v: flash_jvp.reference.math_sdpa(q.double(), k.double(), v), (v.double(),),
        (v_t.double(),),
    )[1]  # fmt: skip
    for v_ in (v, v.clone().requires_grad_()):
        out, out_t = torch.func.jvp(lambda v: flash_jvp.attention(q, kept[-1], v), (v_,), (v_t,))
        assert _check.rel_err(out, ref) <= 1e-5 and _check.rel_err(out_t, ref_t) <= 1e-5
