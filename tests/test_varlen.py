"""flash_jvp.varlen_attention: packed variable-length batches against math SDPA run on each
sequence alone, against dense attention with a key-padding mask, and its input checks.

REF = torch.func.jvp / autograd through math SDPA on float64 copies of one sequence at a time
(a sequence without keys gives zeros). Pass rule: flash_jvp._check.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CUDA, DEVICE, DTYPE_IDS, DTYPES, assert_close_rel, needs_kernels, randn
from torch.autograd import forward_ad as fwAD

import flash_jvp
from flash_jvp import _check, _ops, reference

gpu = pytest.mark.gpu
DTYPE = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
CAUSAL = pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
NAMES = ("o", "o_t", "dq", "dk", "dv")


# ---------------------------------------------------------------- helpers
def _cu(lengths, device=DEVICE) -> torch.Tensor:
    """int32 (n + 1,) cumulative lengths starting at 0."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def _packed(lens_q, lens_k, Hq, Hkv, E, Ev=None, dtype=torch.float32):
    """Packed q (Tq, Hq, E), k (Tk, Hkv, E), v (Tk, Hkv, Ev), their tangents, dO and the
    cu_seqlens, all fresh random."""
    Ev = E if Ev is None else Ev
    Tq, Tk = sum(lens_q), sum(lens_k)
    q, k, v = (
        randn(Tq, Hq, E, dtype=dtype),
        randn(Tk, Hkv, E, dtype=dtype),
        randn(Tk, Hkv, Ev, dtype=dtype),
    )
    tangents = tuple(randn(*x.shape, dtype=dtype) for x in (q, k, v))
    do = randn(Tq, Hq, Ev, dtype=dtype)
    return q, k, v, tangents, do, _cu(lens_q), _cu(lens_k)


def _varlen(cu_q, cu_k, max_q=None, max_k=None, **kw):
    """varlen_attention as a function of (q, k, v) only."""
    lens_q, lens_k = (cu[1:] - cu[:-1] for cu in (cu_q, cu_k))
    max_q = int(lens_q.max()) if max_q is None and len(lens_q) else (max_q or 0)
    max_k = int(lens_k.max()) if max_k is None and len(lens_k) else (max_k or 0)

    def fn(q, k, v):
        return flash_jvp.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, **kw)

    return fn


def _per_sequence(q, k, v, tangents, do, cu_q, cu_k, dtype, **kw) -> reference.Outputs:
    """reference.sdpa_outputs (math SDPA in ``dtype``, None = as given) on each sequence alone,
    packed back; sequences without keys (or queries) give zeros."""
    out_dtype = dtype or q.dtype
    zeros = [torch.zeros(*x.shape, dtype=out_dtype, device=x.device) for x in (do, do, q, k, v)]
    res = reference.Outputs(*zeros)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        r, c = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if r.start == r.stop or c.start == c.stop:
            continue

        def cut(x, s):  # (L, H, E) rows -> (1, H, L, E)
            return None if x is None else x[s].transpose(0, 1)[None]

        seq = reference.sdpa_outputs(
            cut(q, r), cut(k, c), cut(v, c), (cut(tangents[0], r), cut(tangents[1], c),
            cut(tangents[2], c)), cut(do, r), dtype=dtype, enable_gqa=True, **kw,
        )  # fmt: skip
        for name, s in (("o", r), ("o_t", r), ("dq", r), ("dk", c), ("dv", c)):
            getattr(res, name)[s] = getattr(seq, name)[0].transpose(0, 1)
    return res


def check_varlen(q, k, v, tangents, do, cu_q, cu_k, names=NAMES, max_q=None, max_k=None, **kw):
    """varlen_attention's o, o_t (torch.func.jvp; None tangents = zeros) and dq, dk, dv pass the
    _check rule against REF per sequence; returns flash_jvp's outputs."""
    fn = _varlen(cu_q, cu_k, max_q, max_k, **kw)
    ours = reference.run_outputs(fn, q, k, v, tangents, do)
    ref = _per_sequence(q, k, v, tangents, do, cu_q, cu_k, torch.float64, **kw)
    same = _per_sequence(q, k, v, tangents, do, cu_q, cu_k, None, **kw)
    comps = _check.compare(ours, ref, same, q.dtype, names)
    _check.assert_ok(comps, f"q {tuple(q.shape)} k {tuple(k.shape)} cu_q {cu_q.tolist()} "
                            f"cu_k {cu_k.tolist()} {q.dtype} {kw}")  # fmt: skip
    return ours


def _assert_finite(outputs: reference.Outputs) -> None:
    for name, x in outputs.as_dict().items():
        assert torch.isfinite(x).all(), f"{name} has NaN/Inf"


# ---------------------------------------------------------------- against per-sequence SDPA
def _vcase(name, lens_q, lens_k=None, Hq=2, Hkv=2, E=32, Ev=None, marks=(), **kw):
    lens_k = lens_q if lens_k is None else lens_k
    return pytest.param((lens_q, lens_k, Hq, Hkv, E, Ev), kw, marks=marks, id=name)


CONFIGS = [
    _vcase("self-0-1-odd", [5, 0, 1, 33, 17]),
    _vcase("cross-lq-ne-lk", [7, 40, 1, 20], [30, 9, 16, 1]),
    _vcase("no-keys-for-one", [10, 5, 3], [12, 0, 7]),
    _vcase("no-queries-for-one", [10, 0, 3], [12, 9, 7]),
    _vcase("gqa-4x2", [20, 45, 3], Hq=4, Hkv=2),
    _vcase("one-sequence", [77], [50]),
    _vcase("ones-around-long", [1, 100, 1], [1, 100, 2]),
    _vcase("Ev64-scale", [19, 40], E=16, Ev=64, scale=0.3),
    _vcase("gpu-long", [1000, 0, 1, 2048, 517], Hq=4, Hkv=4, E=64, marks=gpu),
    _vcase("gpu-gqa-cross", [1500, 3, 700], [2000, 1024, 1], Hq=8, Hkv=2, E=128, marks=gpu),
]


@CAUSAL
@DTYPE
@pytest.mark.parametrize("config,kw", CONFIGS)
def test_varlen_matches_per_sequence_reference(config, kw, dtype, is_causal):
    """Each packed sequence equals attention on that sequence alone: o, o_t, dq, dk, dv."""
    lens_q, lens_k, Hq, Hkv, E, Ev = config
    q, k, v, tangents, do, cu_q, cu_k = _packed(lens_q, lens_k, Hq, Hkv, E, Ev, dtype)
    ours = check_varlen(q, k, v, tangents, do, cu_q, cu_k, is_causal=is_causal, **kw)
    _assert_finite(ours)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        if ck[i] == ck[i + 1]:  # a sequence without keys: exact zeros, as documented
            for name in ("o", "o_t", "dq"):
                rows = getattr(ours, name)[cq[i] : cq[i + 1]]
                assert torch.equal(rows, torch.zeros_like(rows)), f"{name} of sequence {i}"
        if cq[i] == cq[i + 1]:  # keys no query sees: no gradient
            for name in ("dk", "dv"):
                rows = getattr(ours, name)[ck[i] : ck[i + 1]]
                assert torch.equal(rows, torch.zeros_like(rows)), f"{name} of sequence {i}"


@DTYPE
@pytest.mark.parametrize("subset", ["q", "v", "kv", "qkv", "none"])
def test_varlen_forward_ad_tangent_subsets(subset, dtype):
    """forward_ad dual tensors on any subset of q, k, v: same o_t as torch.func.jvp (bit for
    bit) and as REF; no duals at all gives the plain output."""
    q, k, v, tangents, do, cu_q, cu_k = _packed([9, 1, 40], [30, 17, 1], 4, 2, 32, dtype=dtype)
    given = tuple(t if name in subset else None for name, t in zip("qkv", tangents))
    fn = _varlen(cu_q, cu_k, is_causal=True)
    with fwAD.dual_level():
        args = [x if t is None else fwAD.make_dual(x, t) for x, t in zip((q, k, v), given)]
        o, o_t = fwAD.unpack_dual(fn(*args))
    plain = fn(q, k, v)
    assert torch.equal(o, plain), "a dual input changed the primal output"
    if subset == "none":
        assert o_t is None
        ref = _per_sequence(q, k, v, given, do, cu_q, cu_k, torch.float64, is_causal=True)
        assert_close_rel("o", o, ref.o, 4 * _check.floor(dtype))
        return
    ours = check_varlen(q, k, v, given, do, cu_q, cu_k, names=("o", "o_t"), is_causal=True)
    torch.testing.assert_close(o_t, ours.o_t, rtol=0, atol=0)


def test_varlen_zero_tangents_give_zero_o_t():
    """Explicit zero tangents: o_t exactly zero."""
    q, k, v, _, _, cu_q, cu_k = _packed([9, 0, 40], [30, 17, 1], 2, 2, 32)
    zeros = tuple(map(torch.zeros_like, (q, k, v)))
    _, o_t = torch.func.jvp(_varlen(cu_q, cu_k), (q, k, v), zeros)
    assert torch.equal(o_t, torch.zeros_like(o_t))


@pytest.mark.parametrize("layout", ["qkv-buffer", "heads-first"])
def test_varlen_non_contiguous_inputs(layout):
    """Slices of a fused (T, 3, H, E) projection, or (H, T, E) buffers seen as (T, H, E),
    for primals and tangents: same results as contiguous copies, and REF."""
    lens = [13, 0, 40, 1]
    T, H, E = sum(lens), 2, 32
    cu = _cu(lens)

    def make():
        if layout == "qkv-buffer":
            return randn(T, 3, H, E).unbind(1)
        return tuple(randn(H, T, E).transpose(0, 1) for _ in range(3))

    q, k, v = make()
    tangents = make()
    assert not any(x.is_contiguous() for x in (q, k, v, *tangents))
    do = randn(T, H, E)
    strided = check_varlen(q, k, v, tangents, do, cu, cu, is_causal=True)
    dense = reference.run_outputs(_varlen(cu, cu, is_causal=True),
                                  *(x.contiguous() for x in (q, k, v)),
                                  tuple(t.contiguous() for t in tangents), do)  # fmt: skip
    for name, x in strided.as_dict().items():
        assert_close_rel(name, x, getattr(dense, name), 1e-6)


@DTYPE
def test_varlen_max_seqlen_above_the_true_maximum(dtype):
    """max_seqlen larger than the longest sequence only widens the grid: same results."""
    q, k, v, tangents, do, cu_q, cu_k = _packed([9, 33, 1], [20, 3, 45], 2, 2, 32, dtype=dtype)
    exact = check_varlen(q, k, v, tangents, do, cu_q, cu_k, is_causal=True)
    wide = check_varlen(q, k, v, tangents, do, cu_q, cu_k, max_q=97, max_k=130, is_causal=True)
    for name, x in exact.as_dict().items():
        assert torch.equal(x, getattr(wide, name)), f"{name} depends on max_seqlen"


# ---------------------------------------------------------------- against dense + key padding
@CAUSAL
@pytest.mark.parametrize("dtype", [torch.float32, DTYPES[0]], ids=DTYPE_IDS.get)
def test_varlen_equals_dense_with_key_padding(dtype, is_causal):
    """The packed batch and the same batch padded, through flash_jvp.attention with a
    key-padding (and causal) mask: real rows agree in o, o_t, dq, dk, dv."""
    lens, H, E = [40, 23, 7], 2, 32
    L, B = max(lens), len(lens)
    q, k, v, tangents, do, cu, _ = _packed(lens, lens, H, H, E, dtype=dtype)
    real = torch.arange(L, device=DEVICE) < torch.tensor(lens, device=DEVICE)[:, None]  # (B, L)

    def pad(x):  # (T, H, E) -> (B, H, L, E), zeros in the padding
        out = x.new_zeros(B, L, *x.shape[1:])
        out[real] = x
        return out.transpose(1, 2)

    def unpad(x):  # (B, H, L, E) -> (T, H, E)
        return x.transpose(1, 2)[real]

    keep = real[:, None, None, :]
    if is_causal:
        keep = keep & torch.ones(L, L, dtype=torch.bool, device=DEVICE).tril()
    packed = reference.run_outputs(_varlen(cu, cu, is_causal=is_causal), q, k, v, tangents, do)
    dense = reference.run_outputs(flash_jvp.attention, pad(q), pad(k), pad(v),
                                  tuple(map(pad, tangents)), pad(do), attn_mask=keep)  # fmt: skip
    tol = 1e-6 if dtype == torch.float32 else _check.floor(dtype)
    for name, x in packed.as_dict().items():
        assert_close_rel(name, x, unpad(getattr(dense, name)), tol)
    check_varlen(q, k, v, tangents, do, cu, cu, is_causal=is_causal)


# ---------------------------------------------------------------- edges
def test_varlen_no_sequences_and_all_empty():
    """cu_seqlens [0] (no sequences) and [0, 0, 0] (empty ones): empty outputs and grads."""
    for lens in ([], [0, 0]):
        q, k, v, tangents, do, cu_q, cu_k = _packed(lens, lens, 2, 2, 16)
        fn = _varlen(cu_q, cu_k, 0, 0)
        o, o_t = torch.func.jvp(fn, (q, k, v), tangents)
        assert o.shape == (0, 2, 16) and o_t.shape == (0, 2, 16)
        leaves = [x.requires_grad_() for x in (q, k, v)]
        grads = torch.autograd.grad(fn(*leaves).sum(), leaves, allow_unused=True)
        assert all(g is None or g.shape == x.shape for g, x in zip(grads, leaves))


@needs_kernels
def test_varlen_under_vmap_is_a_clear_error():
    """torch.func.vmap over varlen_attention raises NotImplementedError, never wrong values."""
    q, k, v, _, _, cu_q, cu_k = _packed([5, 7], [6, 4], 2, 2, 16)
    fn = _varlen(cu_q, cu_k)
    with pytest.raises(NotImplementedError, match="vmap over varlen_attention is not supported"):
        torch.func.vmap(fn, in_dims=(None, None, 0))(q, k, torch.stack([v, v]))


# ---------------------------------------------------------------- errors before launch
def _args(**over):
    """Valid varlen arguments (lengths 3, 5: total 8) with some replaced."""
    q, k, v = randn(8, 2, 16), randn(8, 2, 16), randn(8, 2, 16)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=_cu([3, 5]), cu_seqlens_k=_cu([3, 5]),
                max_seqlen_q=5, max_seqlen_k=5)  # fmt: skip
    args.update(over)
    return args


def _int32(values, device=DEVICE):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _nested_q():
    parts = [randn(3, 2, 16), randn(5, 2, 16)]
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


BAD = [
    ("cu-int64", lambda: _args(cu_seqlens_q=_cu([3, 5]).long()), TypeError,
     r"Expected cu_seqlens_q to be a 1-D int32 tensor of n \+ 1 cumulative lengths, but got "
     r"cu_seqlens_q of shape \(3,\), dtype torch.int64"),
    ("cu-k-int64", lambda: _args(cu_seqlens_k=_cu([3, 5]).long()), TypeError,
     "Expected cu_seqlens_k to be a 1-D int32 tensor"),
    ("cu-list", lambda: _args(cu_seqlens_q=[0, 3, 8]), TypeError,
     "Expected cu_seqlens_q to be an int32 tensor, but got <class 'list'>"),
    ("cu-2d", lambda: _args(cu_seqlens_q=_int32([[0, 3, 8]])), ValueError,
     "Expected cu_seqlens_q to be a 1-D int32 tensor"),
    ("cu-not-from-0", lambda: _args(cu_seqlens_q=_int32([1, 3, 8])), ValueError,
     r"Expected cu_seqlens_q to start at 0, never decrease and end at the number of packed "
     r"tokens \(8\), but got \[1, 3, 8\]"),
    ("cu-decreasing", lambda: _args(cu_seqlens_k=_int32([0, 6, 4, 8]),
                                    cu_seqlens_q=_int32([0, 3, 5, 8])), ValueError,
     r"cu_seqlens_k to start at 0, never decrease .*\[0, 6, 4, 8\]"),
    ("cu-last-not-total", lambda: _args(cu_seqlens_q=_int32([0, 3, 7])), ValueError,
     r"packed tokens \(8\), but got \[0, 3, 7\] \(last 7\)"),
    ("cu-last-beyond-total", lambda: _args(cu_seqlens_k=_int32([0, 3, 9])), ValueError,
     r"cu_seqlens_k to start at 0.*\(last 9\)"),
    ("cu-lengths-differ", lambda: _args(cu_seqlens_k=_int32([0, 3, 4, 8])), ValueError,
     "Expected cu_seqlens_q and cu_seqlens_k of the same length.*but got 3 and 4"),
    ("max-q-too-small", lambda: _args(max_seqlen_q=4), ValueError,
     r"Expected max_seqlen_q >= the longest sequence \(5\), but got 4"),
    ("max-k-too-small", lambda: _args(max_seqlen_k=0), ValueError,
     r"Expected max_seqlen_k >= the longest sequence \(5\), but got 0"),
    ("max-not-int", lambda: _args(max_seqlen_q=5.0), TypeError,
     "Expected max_seqlen_q to be an int, but got 5.0"),
    ("nested-q", lambda: _args(q=_nested_q()), TypeError,
     r"takes packed tensors, not nested ones \(q\); pass nt.values\(\) and nt.offsets\(\)"),
    ("q-2d", lambda: _args(q=randn(8, 32)), ValueError,
     r"Expected q to be a packed \(total, heads, head_dim\) tensor, but got q of shape \(8, 32\)"),
    ("k-4d", lambda: _args(k=randn(1, 8, 2, 16)), ValueError,
     r"Expected k to be a packed \(total, heads, head_dim\) tensor"),
    ("v-not-tensor", lambda: _args(v=[[1.0]]), TypeError,
     "Expected v to be a packed .* tensor, but got <class 'list'>"),
    ("heads-not-multiple", lambda: _args(q=randn(8, 3, 16)), ValueError,
     r"q's number of heads to be a multiple of k's and v's .* q \(8, 3, 16\), k \(8, 2, 16\)"),
    ("int-q", lambda: _args(q=randn(8, 2, 16).int()), TypeError,
     r"floating-point q, but got q of shape \(8, 2, 16\)"),
    ("return_lse-not-bool", lambda: {**_args(), "return_lse": 1}, TypeError,
     "return_lse to be a bool"),
    ("dtype-mismatch", lambda: _args(k=randn(8, 2, 16, dtype=torch.float16)), ValueError,
     "same dtype"),
    ("cu-on-cpu", lambda: _args(cu_seqlens_q=_cu([3, 5], device="cpu")), ValueError,
     r"Expected cu_seqlens_q on cuda:0, but got cu_seqlens_q of shape \(3,\)"),
]  # fmt: skip


@pytest.mark.parametrize("name,make,exc,match", BAD, ids=[b[0] for b in BAD])
def test_varlen_bad_input_is_a_clear_error(name, make, exc, match, monkeypatch):
    """Every invalid varlen argument raises its type and message before any launch."""
    if name == "cu-on-cpu" and not CUDA:
        pytest.skip("needs a second device")
    monkeypatch.setattr(_ops, "attn_fwd", lambda *a, **k: pytest.fail("kernel launched"))
    args = make()
    with pytest.raises(exc, match=match):
        flash_jvp.varlen_attention(**args)


def test_varlen_strided_cu_seqlens_and_huge_max_seqlen():
    """A strided cu_seqlens view reads as its values; a huge max_seqlen is capped at the totals."""
    q, k, v, tangents, do, cu_q, cu_k = _packed([5, 7, 8], [6, 1, 9], 2, 2, 32)
    strided_q = torch.stack([cu_q, torch.full_like(cu_q, 10**6)], 1)[:, 0]
    strided_k = torch.stack([cu_k, torch.full_like(cu_k, -7)], 1)[:, 0]
    assert not strided_q.is_contiguous()
    ours = check_varlen(q, k, v, tangents, do, strided_q, strided_k, max_q=2**40, max_k=2**40)
    plain = check_varlen(q, k, v, tangents, do, cu_q, cu_k)
    for name, x in plain.as_dict().items():
        assert torch.equal(x, getattr(ours, name)), name
