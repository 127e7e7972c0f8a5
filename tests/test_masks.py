"""attn_mask: boolean and additive masks of every broadcast shape, fully masked rows (case C5),
mask gradients and tangents, CausalBias objects, errors, poisoned neighbours, and a small
BERT-style encoder end to end.

REF = torch.func.jvp / autograd through math SDPA on float64 copies, the mask made canonical
first (``reference.canonical_mask``: additive entries <= finfo(query dtype).min become -inf,
flash_jvp's documented rule). Pass rule as in flash_jvp._check, with dmask added to the
gradient group.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers import (
    CUDA,
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    assert_close_rel,
    needs_kernels,
    qkv,
    randn,
    slow_if,
)
from torch.autograd import forward_ad as fwAD
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import flash_jvp
from flash_jvp import _check, _ops, reference
from flash_jvp.reference import math_sdpa

gpu = pytest.mark.gpu
DTYPE = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
GROUPS = (("o", "o_t"), ("dq", "dk", "dv", "dmask"))
NEG_INF = -math.inf


# ---------------------------------------------------------------- helpers
def _additive(keep: torch.Tensor, dtype: torch.dtype, fill: float = NEG_INF, bias=None):
    """An additive mask from a boolean one: ``bias`` (default random normal) where kept,
    ``fill`` elsewhere."""
    if bias is None:
        bias = torch.randn(keep.shape, device=keep.device)
    return torch.where(keep, bias.to(torch.float32), fill).to(dtype)


def _random_keep(*shape, density=0.5, device=DEVICE) -> torch.Tensor:
    return torch.rand(*shape, device=device) < density


def _masked_sdpa(query_dtype: torch.dtype):
    """math SDPA with flash_jvp's masking rule for additive entries <= finfo(query_dtype).min."""

    def fn(q, k, v, attn_mask=None, **kw):
        if isinstance(attn_mask, torch.Tensor) and attn_mask.dtype != torch.bool:
            attn_mask = reference.canonical_mask(attn_mask, query_dtype)
        return math_sdpa(q, k, v, attn_mask=attn_mask, **kw)

    return fn


def _outputs(fn, q, k, v, mask, tangents, do, mask_t=None, mask_grad=False, **kw) -> dict:
    """o and o_t (torch.func.jvp over q, k, v and, given mask_t, the mask; missing tangents
    are zeros), and the gradients of sum(o * do) for q, k, v and, with mask_grad, the mask."""
    tangents = tuple(torch.zeros_like(x) if t is None else t for x, t in zip((q, k, v), tangents))
    if mask_t is None:
        o, o_t = torch.func.jvp(
            lambda q, k, v: fn(q, k, v, attn_mask=mask, **kw), (q, k, v), tangents
        )
    else:
        o, o_t = torch.func.jvp(
            lambda q, k, v, m: fn(q, k, v, attn_mask=m, **kw), (q, k, v, mask), (*tangents, mask_t)
        )
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    m = mask.detach().requires_grad_() if mask_grad else mask
    with torch.enable_grad():
        out = fn(*leaves, attn_mask=m, **kw)
        grads = torch.autograd.grad(out, leaves + [m] * mask_grad, do)
    res = {"o": o.detach(), "o_t": o_t.detach()}
    res.update(zip(("dq", "dk", "dv", "dmask"), grads))
    return res


def _to64(x):
    """float64 copy of a float tensor; bool masks, CausalBias and None pass through."""
    if isinstance(x, torch.Tensor) and x.dtype.is_floating_point:
        return x.detach().to(torch.float64)
    return x


def _rms(t: torch.Tensor) -> float:
    return t.norm().item() / math.sqrt(max(t.numel(), 1))


def _compare(ours: dict, ref: dict, same: dict, dtype: torch.dtype, context="", also=None):
    """_check's rule on every entry of ours (dmask belongs to the gradient group). ``also``:
    a second same-dtype result per name; the worse of the two sets the tolerance."""
    scale = {}
    for group in GROUPS:
        rms = max((_rms(ref[n]) for n in group if n in ref), default=0.0)
        scale.update({n: rms for n in group})
    comps = []
    for name, x in ours.items():
        t_errs = [_check.rel_err(s[name], ref[name], scale[name]) for s in (same, also or {})
                  if name in s]  # fmt: skip
        t_err = max((e for e in t_errs if math.isfinite(e)), default=0.0)
        tol = _check.RTOL * t_err + _check.floor(dtype)
        comps.append(_check.Comparison(name, _check.rel_err(x, ref[name], scale[name]), t_err, tol))
    _check.assert_ok(comps, context)


def _fa2_dmask(q, k, v, mask, do, ref: dict, same: dict, **kw) -> torch.Tensor:
    """float64 dmask as a FlashAttention-2 backward gets it: delta = rowsum(dO o O) from the
    output rounded to q's dtype (math SDPA's), i.e. ref's dS + P o (delta - delta_rounded).

    A mask broadcast over keys has gradient rowsum(dS) = 0: all that is left is this rounding,
    which math SDPA (delta = rowsum(P o dP)) does not have.
    """
    eye = torch.eye(k.shape[-2], dtype=torch.float64, device=k.device)
    p = math_sdpa(*map(_to64, (q, k)), eye.expand(*k.shape[:-1], -1), attn_mask=_to64(mask), **kw)
    err = (_to64(do) * (ref["o"] - _to64(same["o"]))).sum(-1, keepdim=True)
    return ref["dmask"] + (p * err).sum_to_size(ref["dmask"].shape)


def check_mask(q, k, v, mask, tangents, do, mask_t=None, mask_grad=False, ref_mask=None, **kw):
    """flash_jvp.attention with attn_mask=mask (ref_mask on the reference side, default the
    same) against REF under the _check rule; returns flash_jvp's outputs.

    In half precision dmask may also be as far off as the FlashAttention-2 formula
    (:func:`_fa2_dmask`), which flash_jvp's backward is.
    """
    ref_mask = mask if ref_mask is None else ref_mask
    ours = _outputs(flash_jvp.attention, q, k, v, mask, tangents, do, mask_t, mask_grad, **kw)
    fn = _masked_sdpa(q.dtype)
    ref = _outputs(fn, *map(_to64, (q, k, v, ref_mask)), tuple(map(_to64, tangents)), _to64(do),
                   _to64(mask_t), mask_grad, **kw)  # fmt: skip
    same = _outputs(fn, q, k, v, ref_mask, tangents, do, mask_t, mask_grad, **kw)
    also = None
    if mask_grad and q.dtype != torch.float32:
        canonical = reference.canonical_mask(ref_mask, q.dtype)
        also = {"dmask": _fa2_dmask(q, k, v, canonical, do, ref, same, **kw)}
    where = mask if not isinstance(mask, torch.Tensor) else (tuple(mask.shape), mask.dtype)
    _compare(ours, ref, same, q.dtype, f"q {tuple(q.shape)} {q.dtype} k {tuple(k.shape)} "
                                       f"mask {where} {kw}", also)  # fmt: skip
    return ours


def _assert_all_finite(res: dict) -> None:
    for name, x in res.items():
        assert torch.isfinite(x).all(), f"{name} has NaN/Inf"


# ---------------------------------------------------------------- the tile-range table
def _ranges_oracle(mask: torch.Tensor, other_len: int, mask_min: float) -> torch.Tensor:
    """(lo, hi, dense) per 16 rows of a 4-D mask in plain torch (the kernel's definition)."""
    keep = mask if mask.dtype == torch.bool else ~(mask <= mask_min)  # NaN is kept
    n, m = keep.shape[-2:]
    count = keep.sum(-1)
    idx = torch.arange(m, device=keep.device)
    first = torch.where(keep, idx, m).amin(-1)
    last = torch.where(keep, idx + 1, 0).amax(-1)
    if m == 1:
        first, last, count = first * 0, torch.full_like(last, other_len), count * other_len
    row_lo = torch.where(count > 0, first, other_len)
    row_hi = torch.where(count > 0, last, 0)
    table = []
    for g in range(0, n, 16):
        lo, hi = row_lo[..., g : g + 16], row_hi[..., g : g + 16]
        glo, ghi = lo.amin(-1), hi.amax(-1)
        exact = (lo == glo[..., None]) & (hi == ghi[..., None])
        dense = (exact & (count[..., g : g + 16] == (ghi - glo)[..., None])).all(-1)
        table.append(torch.stack((glo, ghi, dense.to(glo.dtype)), -1))
    return torch.stack(table, -2).to(torch.int32)


def _table_masks():
    """(name, 4-D mask, other_len) covering the table's cases."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
    pad = torch.arange(150)[None, :] < torch.tensor([150, 149, 97, 0])[:, None]
    additive = torch.where(
        rand(2, 1, 37, 150) < 0.6, torch.randn(2, 1, 37, 150, generator=g), -torch.inf
    )
    additive[0, 0, 3] = torch.finfo(torch.float16).min
    additive[1, 0, 32:] = -torch.inf  # the last group of rows sees one NaN entry only
    additive[1, 0, 33, 7] = torch.nan
    window = (torch.arange(40)[:, None] - torch.arange(40)[None, :]).abs() < 5
    return [
        ("random-bool", rand(2, 3, 37, 150) < 0.3, 150),
        ("dense-rows", rand(1, 2, 33, 1) < 0.5, 140),
        ("key-padding", pad[:, None, None, :], 150),
        ("key-padding-by-keys", pad[:, None, None, :].transpose(-1, -2), 64),
        ("all-masked", torch.zeros(1, 1, 20, 9, dtype=torch.bool), 9),
        ("window", window[None, None], 40),
        ("window-expanded", window.expand(2, 3, 40, 40), 40),
        ("additive-f32", additive, 150),
        ("additive-f16-by-keys", additive.to(torch.float16).transpose(-1, -2), 37),
    ]


@needs_kernels
@pytest.mark.parametrize("name,mask,other_len", _table_masks(), ids=[m[0] for m in _table_masks()])
def test_range_table_kernel_matches_torch(name, mask, other_len):
    """The one-launch range table (kernels/mask_ranges.py) equals its definition in torch, for
    broadcast, transposed, expanded, empty, NaN and finfo.min masks (rows not a multiple of 16,
    columns past one block of the kernel)."""
    mask = mask.to(DEVICE)
    mask_min = torch.finfo(torch.float16).min
    ours = _ops.mask_ranges(mask, other_len, mask_min)
    ref = _ranges_oracle(_ops._unexpanded(mask), other_len, mask_min)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)


# ---------------------------------------------------------------- 1: shapes and layouts
def _layout(name, make, B, H, Lq, Lk):
    """A mask of the named layout, its values from make(*shape) (bool or float)."""
    if name == "LqLk":
        return make(Lq, Lk)
    if name == "key-padding":
        return make(B, 1, 1, Lk)
    if name == "B1LqLk":
        return make(B, 1, Lq, Lk)
    if name == "BHLqLk":
        return make(B, H, Lq, Lk)
    if name == "1HLqLk":
        return make(1, H, Lq, Lk)
    if name == "3d-HLqLk":
        return make(H, Lq, Lk)
    if name == "BHLq1":  # one value per query row, broadcast over keys
        return make(B, H, Lq, 1)
    if name == "expanded-keys":  # stride 0 over heads and query rows
        return make(B, 1, 1, Lk).expand(B, H, Lq, Lk)
    if name == "expanded-rows":  # stride 0 over batch and keys
        return make(1, H, Lq, 1).expand(B, H, Lq, Lk)
    if name == "transposed":
        return make(B, H, Lk, Lq).transpose(-1, -2)
    raise ValueError(name)


# mask kind (bool; additive float32; additive in the query's dtype) x query dtype
MASK_TYPES = {
    "bool-fp32": ("bool", torch.float32),
    "bool-fp16": ("bool", torch.float16),
    "add32-fp32": ("float32", torch.float32),
    "add32-fp16": ("float32", torch.float16),
    "add16-fp16": ("query", torch.float16),
    "addbf16-bf16": ("query", torch.bfloat16),
    "add32-bf16": ("float32", torch.bfloat16),
}
# layout -> the mask types the CPU tier runs (the GPU runs every one): each layout bool and
# at least one additive type, the stride-sensitive layouts more.
LAYOUTS = {
    "LqLk": ["bool-fp32", "add16-fp16"],
    "key-padding": ["bool-fp32", "add32-fp16"],
    "B1LqLk": ["bool-fp16", "add32-fp32"],
    "BHLqLk": ["bool-fp32", "add32-fp16", "add16-fp16"],
    "1HLqLk": ["bool-fp32", "add32-fp32"],
    "3d-HLqLk": ["bool-fp16", "add16-fp16"],
    "BHLq1": ["bool-fp32", "add32-fp32"],
    "expanded-keys": ["bool-fp16", "add32-fp16", "add16-fp16"],
    "expanded-rows": ["bool-fp32", "add32-fp32"],
    "transposed": ["bool-fp32", "add32-fp32", "add32-fp16", "add16-fp16"],
}
# On the GPU, bool masks under fp16 queries run in the slow tier (bool-fp32 in the fast one).
LAYOUT_CASES = [
    pytest.param(layout, *MASK_TYPES[t], id=f"{layout}-{t}",
                 marks=(*[gpu] * (t not in cpu), *slow_if(t == "bool-fp16")))
    for layout, cpu in LAYOUTS.items() for t in MASK_TYPES
]  # fmt: skip


def _maker(kind: str, dtype: torch.dtype, density: float = 0.6):
    """make(*shape): a random mask of this kind (additive: random bias, -inf where masked)."""
    if kind == "bool":
        return lambda *shape: _random_keep(*shape, density=density)
    mask_dtype = torch.float32 if kind == "float32" else dtype
    return lambda *shape: _additive(_random_keep(*shape, density=density), mask_dtype)


@pytest.mark.parametrize("layout,kind,dtype", LAYOUT_CASES)
def test_mask_layouts_match_reference(layout, kind, dtype):
    """Every broadcast shape and stride pattern of a bool/additive mask is read as SDPA does."""
    B, H, Lq, Lk = 2, 2, 33, 40
    q, k, v, tangents, do = qkv(B, H, H, Lq, Lk, 32, dtype=dtype)
    mask = _layout(layout, _maker(kind, dtype), B, H, Lq, Lk)
    check_mask(q, k, v, mask, tangents, do)


def _alibi(H, Lq, Lk, causal=False, device=DEVICE):
    """ALiBi-style bias (1, H, Lq, Lk): -slope_h * |i - j|; -inf above the diagonal if causal."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=device) / H)
    dist = (torch.arange(Lq, device=device)[:, None] - torch.arange(Lk, device=device)).abs()
    bias = -slopes[:, None, None] * dist
    if causal:
        above = torch.ones(Lq, Lk, dtype=torch.bool, device=device).triu(1)
        bias = bias.masked_fill(above, NEG_INF)
    return bias[None]


def _key_padding(lengths, Lk, device=DEVICE):
    """(B, 1, 1, Lk) bool: key j of sample b takes part iff j < lengths[b]."""
    return (torch.arange(Lk, device=device) < torch.tensor(lengths, device=device)[:, None])[
        :, None, None
    ]


def _block_diagonal(Lq, Lk, block, device=DEVICE):
    """(Lq, Lk) bool: query i sees key j iff they are in the same block of ``block``."""
    return (torch.arange(Lq, device=device)[:, None] // block) == (
        torch.arange(Lk, device=device)[None] // block
    )


def _pattern(name, B, Hq, Lq, Lk, dtype):
    add = torch.float32 if dtype == torch.float32 else dtype
    if name.startswith("density"):
        return _random_keep(B, Hq, Lq, Lk, density=float(name[len("density") :]))
    if name == "alibi":
        return _alibi(Hq, Lq, Lk).to(add)
    if name == "alibi-causal":
        return _alibi(Hq, Lq, Lk, causal=True).to(add)
    if name == "key-padding-60":  # sample 0: 60 of 100 keys padded, whole key tiles empty
        return _key_padding([Lk - 60, Lk], Lk)
    if name == "key-padding-additive":
        return _additive(
            _key_padding([Lk - 60, Lk - 3], Lk), add, bias=torch.zeros(B, 1, 1, Lk, device=DEVICE)
        )
    if name == "key-padding-holes":  # padding plus a hidden key in every 7th row
        keep = _key_padding([Lk - 20, Lk - 45], Lk).expand(B, 1, Lq, Lk).clone()
        keep[:, :, ::7, 3] = False
        return keep
    if name == "left-padding":  # keys [pad, Lk) take part (tile-aligned pads and not)
        pads = torch.tensor([16, 37] if Lk < 1000 else [128, 301], device=DEVICE)
        return (torch.arange(Lk, device=DEVICE) >= pads[:, None])[:, None, None, :]
    if name == "query-padding":  # rows >= length see nothing (fully masked rows)
        rows = torch.arange(Lq, device=DEVICE) < torch.tensor([Lq - 20, Lq], device=DEVICE)[:, None]
        return rows[:, None, :, None]
    if name == "query-and-key-padding":
        rows = torch.arange(Lq, device=DEVICE) < torch.tensor([Lq - 17, 5], device=DEVICE)[:, None]
        return rows[:, None, :, None] & _key_padding([Lk - 33, Lk], Lk)
    if name == "block-diagonal":
        return _block_diagonal(Lq, Lk, 32)
    if name == "block-diagonal-additive":
        return _additive(_block_diagonal(Lq, Lk, 32)[None].expand(Hq, -1, -1), add)
    if name == "gqa-random":
        return _random_keep(B, 1, Lq, Lk, density=0.5)
    if name == "gqa-alibi":
        return _alibi(Hq, Lq, Lk, causal=True).to(add)
    if name.startswith("odd"):
        return _additive(_random_keep(B, 1, Lq, Lk, density=0.7), add)
    raise ValueError(name)


ALL_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _pcase(name, B, Hq, Hkv, Lq, Lk, E=32, gpu_only=False, cpu=("fp32", "fp16"), **kw):
    """One pattern in every dtype; those not in ``cpu`` (and bf16) run on the GPU only. On
    the GPU, fp16 runs in the slow tier (bf16 takes the same kernels in the fast one)."""
    return [
        pytest.param(name, (B, Hq, Hkv, Lq, Lk, E), kw, dtype,
                     marks=[*[gpu] * (gpu_only or DTYPE_IDS[dtype] not in cpu),
                            *slow_if(dtype == torch.float16)],
                     id=f"{name}-B{B}-H{Hq}x{Hkv}-Lq{Lq}-Lk{Lk}-{DTYPE_IDS[dtype]}")
        for dtype in ALL_DTYPES
    ]  # fmt: skip


PATTERNS = [
    *_pcase("density0.1", 2, 2, 2, 40, 40),
    *_pcase("density0.5", 1, 2, 2, 77, 33, cpu=("fp32",)),
    *_pcase("density0.9", 1, 2, 2, 33, 77, cpu=("fp32",)),
    *_pcase("alibi", 1, 2, 2, 64, 64, cpu=("fp32",)),
    *_pcase("alibi", 1, 2, 2, 48, 48, scale=0.3),  # the bias is not multiplied by the scale
    *_pcase("alibi-causal", 1, 2, 2, 48, 70),
    *_pcase("key-padding-60", 2, 2, 2, 40, 100, cpu=("fp32",)),
    *_pcase("key-padding-additive", 2, 1, 1, 33, 100),
    *_pcase("key-padding-holes", 2, 2, 2, 40, 70),
    *_pcase("left-padding", 2, 2, 2, 33, 70),
    *_pcase("query-padding", 2, 2, 2, 70, 40, cpu=("fp32",)),
    *_pcase("query-and-key-padding", 2, 1, 1, 50, 60),
    *_pcase("block-diagonal", 1, 2, 2, 96, 96, cpu=("fp32",)),
    *_pcase("block-diagonal-additive", 1, 2, 2, 70, 100),
    *_pcase("gqa-random", 1, 4, 2, 40, 40, enable_gqa=True, cpu=("fp32",)),
    *_pcase("gqa-alibi", 1, 4, 2, 33, 50, enable_gqa=True),
    *_pcase("odd", 2, 2, 2, 1, 33),
    *_pcase("odd", 2, 2, 2, 33, 1, cpu=("fp32",)),
    *_pcase("odd", 1, 2, 2, 100, 77),
    *_pcase("odd", 1, 2, 2, 1, 1, cpu=("fp32",)),
    # GPU: long sequences, tiles of the real block sizes fully empty
    *_pcase("density0.1", 1, 4, 4, 1024, 1024, 64, gpu_only=True),
    *_pcase("alibi-causal", 2, 4, 4, 2048, 2048, 64, gpu_only=True),
    *_pcase("key-padding-60", 2, 4, 4, 1000, 2000, 128, gpu_only=True),
    *_pcase("block-diagonal", 1, 4, 4, 2048, 2048, 64, gpu_only=True),
    *_pcase("left-padding", 2, 2, 2, 1024, 1500, 64, gpu_only=True),
    *_pcase("query-and-key-padding", 2, 2, 2, 1500, 1024, 64, gpu_only=True),
    *_pcase("gqa-random", 2, 8, 2, 1000, 1500, 64, gpu_only=True, enable_gqa=True),
]


@pytest.mark.parametrize("name,shape,kw,dtype", PATTERNS)
def test_mask_patterns_match_reference(name, shape, kw, dtype):
    """Random densities, ALiBi biases, bias + causal, empty tiles, GQA and odd lengths."""
    B, Hq, Hkv, Lq, Lk, E = shape
    q, k, v, tangents, do = qkv(B, Hq, Hkv, Lq, Lk, E, dtype=dtype)
    mask = _pattern(name, B, Hq, Lq, Lk, dtype)
    check_mask(q, k, v, mask, tangents, do, **kw)


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 1, 40), (3, 1, 24, 40), (2, 3, 2, 24, 40)],
                         ids=["N11-keys", "M1-rows", "full-5d"])  # fmt: skip
def test_several_batch_dims(mask_shape):
    """(N, M, H, L, E) inputs: masks broadcasting over one or both batch dims."""
    q, k, v, tangents, do = qkv(6, 2, 2, 24, 40, 16)
    five = [x.reshape(2, 3, *x.shape[1:]) for x in (q, k, v)]
    t5 = tuple(t.reshape(2, 3, *t.shape[1:]) for t in tangents)
    mask = _additive(_random_keep(*mask_shape, density=0.6), torch.float32)
    check_mask(*five, mask, t5, do.reshape(2, 3, *do.shape[1:]), mask_t=randn(*mask_shape),
               mask_grad=True)  # fmt: skip


def test_3d_query_with_mask():
    """(N, L, E) inputs, as SDPA takes them, with an (N, L, S) boolean mask."""
    q, k, v, tangents, do = qkv(1, 3, 3, 40, 33, 16)
    three = [x[0] for x in (q, k, v)]
    check_mask(*three, _random_keep(3, 40, 33), tuple(t[0] for t in tangents), do[0])


def test_all_true_mask_equals_no_mask():
    """A mask that hides nothing (bool all True, additive all 0) gives the unmasked result."""
    q, k, v, tangents, do = qkv(1, 2, 2, 40, 50, 32)
    none = reference.run_outputs(flash_jvp.attention, q, k, v, tangents, do)
    for mask in (torch.ones(40, 50, dtype=torch.bool, device=DEVICE),
                 torch.zeros(1, 2, 40, 50, device=DEVICE)):  # fmt: skip
        masked = reference.run_outputs(flash_jvp.attention, q, k, v, tangents, do, attn_mask=mask)
        for name, a in none.as_dict().items():
            torch.testing.assert_close(getattr(masked, name), a, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- 2: C5 fully masked rows
def _c5_mask(kind, B, H, L, dtype):
    """README C5: batch 1's last 16 query rows see nothing, its last 8 keys are hidden from
    every row; 'head' instead hides everything from head 1 of batch 0. Returns the mask and
    the boolean (B, H, L) of fully masked query rows."""
    keep = torch.ones(B, H if kind.startswith("head") else 1, L, L, dtype=torch.bool,
                      device=DEVICE)  # fmt: skip
    keep[1, :, :, -8:] = False
    if kind.startswith("head"):
        keep[0, 1] = False
    else:
        keep[1, :, -16:] = False
    dead = ~keep.any(-1).expand(B, H, L)
    if kind in ("bool", "head-bool"):
        return keep, dead
    if kind in ("neg-inf", "head-neg-inf"):
        return _additive(keep, dtype), dead
    if kind == "finfo-min":  # the masking value of many models, in the query's dtype
        return _additive(keep, dtype, fill=torch.finfo(dtype).min), dead
    if kind == "finfo-min-in-fp32-mask":  # a float32 mask holding finfo(query dtype).min
        return _additive(keep, torch.float32, fill=torch.finfo(dtype).min), dead
    raise ValueError(kind)


C5_KINDS = ["bool", "neg-inf", "finfo-min", "finfo-min-in-fp32-mask", "head-bool", "head-neg-inf"]


@DTYPE
@pytest.mark.parametrize("kind", C5_KINDS)
def test_c5_fully_masked_rows(kind, dtype):
    """Fully masked rows: exact zeros in o, o_t and dq, nothing in dk/dv, no NaN anywhere."""
    B, H, L = 2, 2, 64
    q, k, v, tangents, do = qkv(B, H, H, L, L, 32, dtype=dtype)
    mask, dead = _c5_mask(kind, B, H, L, dtype)
    additive = mask.dtype != torch.bool
    mask_t = randn(*mask.shape, dtype=mask.dtype) if additive else None
    ours = check_mask(q, k, v, mask, tangents, do, mask_t=mask_t, mask_grad=additive)
    _assert_all_finite(ours)
    for name in ("o", "o_t", "dq"):
        rows = ours[name][dead]
        assert torch.equal(rows, torch.zeros_like(rows)), f"{name} not zero on masked rows"
    if additive:  # a fully masked row has no score whose change matters
        dmask = ours["dmask"].expand(B, H, L, L)[dead]
        assert torch.equal(dmask, torch.zeros_like(dmask)), "dmask not zero on masked rows"
    # the rows' (random, non-zero) dO must not reach dk, dv
    quiet = _outputs(
        flash_jvp.attention, q, k, v, mask, tangents, do.masked_fill(dead[..., None], 0)
    )
    for name in ("dk", "dv"):
        assert torch.equal(ours[name], quiet[name]), f"masked rows' dO changed {name}"
    if kind.startswith("head"):  # no query of head 1 (batch 0) sees a key
        for name in ("dk", "dv"):
            assert torch.equal(ours[name][0, 1], torch.zeros_like(ours[name][0, 1])), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=DTYPE_IDS.get)
def test_c5_every_row_masked(dtype):
    """A mask that hides everything: all zeros, finite, no division by an empty softmax."""
    q, k, v, tangents, do = qkv(1, 2, 2, 40, 33, 32, dtype=dtype)
    for mask in (torch.zeros(40, 33, dtype=torch.bool, device=DEVICE),
                 torch.full((1, 1, 1, 33), NEG_INF, dtype=dtype, device=DEVICE)):  # fmt: skip
        res = _outputs(flash_jvp.attention, q, k, v, mask, tangents, do)
        for name, x in res.items():
            assert torch.equal(x, torch.zeros_like(x)), f"{name} not all zero ({mask.dtype})"


def test_finfo_min_rows_differ_from_math_sdpa_as_documented():
    """Entries <= finfo.min mask exactly: a row of them gives 0, where math SDPA averages."""
    q, k, v, _, _ = qkv(1, 1, 1, 16, 16, 16)
    mask = torch.zeros(16, 16, device=DEVICE)
    mask[3] = torch.finfo(torch.float32).min
    ours = flash_jvp.attention(q, k, v, attn_mask=mask)
    assert torch.equal(ours[0, 0, 3], torch.zeros_like(ours[0, 0, 3]))
    plain = math_sdpa(q.double(), k.double(), v.double(), attn_mask=mask.double())
    torch.testing.assert_close(plain[0, 0, 3], v[0, 0].double().mean(0))  # math SDPA: average


# ---------------------------------------------------------------- 3: mask grads and tangents
GRAD_SHAPES = [
    pytest.param((2, 2, 40, 50), id="BHLqLk"),
    pytest.param((1, 2, 40, 50), id="1HLqLk"),
    pytest.param((2, 1, 1, 50), id="B11Lk"),
    pytest.param((40, 50), id="LqLk"),
    pytest.param((2, 1, 40, 1), id="B1Lq1"),
]
# (query dtype, mask dtype)
GRAD_DTYPES = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.float16, torch.float32, id="fp16-mask32"),
    pytest.param(torch.float16, torch.float16, id="fp16-mask16"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16-maskbf16", marks=gpu),
]


@pytest.mark.parametrize("dtype,mask_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("mask_shape", GRAD_SHAPES)
def test_additive_mask_gradient_and_tangent(mask_shape, dtype, mask_dtype):
    """An additive mask that requires grad gets dS summed over its broadcast dims, and its
    tangent adds to the tangent scores (torch.func.jvp over q, k, v and the mask)."""
    q, k, v, tangents, do = qkv(2, 2, 2, 40, 50, 32, dtype=dtype)
    keep = _random_keep(*mask_shape, density=0.8)
    mask = _additive(keep, mask_dtype)
    mask_t = randn(*mask_shape, dtype=mask_dtype, std=2.0)
    ours = check_mask(q, k, v, mask, tangents, do, mask_t=mask_t, mask_grad=True)
    assert ours["dmask"].shape == mask.shape and ours["dmask"].dtype == mask.dtype
    hidden = ours["dmask"][~keep]
    assert torch.equal(hidden, torch.zeros_like(hidden)), "gradient on -inf entries"


@pytest.mark.parametrize("dtype,mask_dtype", GRAD_DTYPES[:2])
def test_gradient_of_an_expanded_leaf_mask(dtype, mask_dtype):
    """A (Lk,) leaf bias expanded to (B, H, Lq, Lk) inside the function: its grad is summed."""
    q, k, v, tangents, do = qkv(2, 2, 2, 33, 40, 32, dtype=dtype)
    bias = randn(40, dtype=mask_dtype)

    def outputs(fn, cast):
        leaf = cast(bias).requires_grad_()
        leaves = [cast(x).requires_grad_() for x in (q, k, v)]
        with torch.enable_grad():
            o = fn(*leaves, attn_mask=leaf.expand(2, 2, 33, 40))
            return torch.autograd.grad(o, [*leaves, leaf], cast(do))

    ours = outputs(flash_jvp.attention, lambda x: x.detach().clone())
    ref = outputs(math_sdpa, _to64)
    same = outputs(math_sdpa, lambda x: x.detach().clone())
    names = ("dq", "dk", "dv", "dmask")
    _compare(dict(zip(names, ours)), dict(zip(names, ref)), dict(zip(names, same)), dtype)


@DTYPE
@pytest.mark.parametrize("mask_shape", [(1, 2, 33, 40), (2, 1, 1, 40)], ids=["1HLqLk", "B11Lk"])
def test_tangent_on_the_mask_only(mask_shape, dtype):
    """The mask as the only primal (q, k, v closed over): torch.func.jvp and a forward_ad dual
    mask agree with each other and with REF."""
    q, k, v, _, _ = qkv(2, 2, 2, 33, 40, 32, dtype=dtype)
    mask = _additive(_random_keep(*mask_shape, density=0.8), dtype)
    mask_t = randn(*mask_shape, dtype=dtype)

    def o_t(fn, cast):
        qc, kc, vc = (cast(x) for x in (q, k, v))
        return torch.func.jvp(lambda m: fn(qc, kc, vc, attn_mask=m), (cast(mask),),
                              (cast(mask_t),))[1]  # fmt: skip

    ours = o_t(flash_jvp.attention, lambda x: x)
    with fwAD.dual_level():
        dual = fwAD.make_dual(mask, mask_t)
        via_dual = fwAD.unpack_dual(flash_jvp.attention(q, k, v, attn_mask=dual)).tangent
    torch.testing.assert_close(via_dual, ours, rtol=0, atol=0)
    fn = _masked_sdpa(dtype)
    ref, same = o_t(fn, _to64), o_t(fn, lambda x: x)
    _compare({"o_t": ours}, {"o_t": ref}, {"o_t": same}, dtype)
    assert ours.abs().max() > 0, "a mask tangent must move the output"


def test_mask_tangent_through_forward_ad_with_requires_grad():
    """sCM pattern with a learnable bias: dual q and mask that require grad, a loss on o and
    o_t.detach(), backward inside the dual level; o_t and all grads match REF."""
    q, k, v, (q_t, _, _), _ = qkv(1, 2, 2, 33, 40, 32)
    mask = _additive(_random_keep(1, 2, 33, 40, density=0.8), torch.float32)
    mask_t = randn(1, 2, 33, 40)
    target = randn(*q.shape)

    def run(fn, cast):
        leaves = [cast(x).requires_grad_() for x in (q, k, v, mask)]
        with fwAD.dual_level():
            dq_ = fwAD.make_dual(leaves[0], cast(q_t))
            dm = fwAD.make_dual(leaves[3], cast(mask_t))
            out = fn(dq_, leaves[1], leaves[2], attn_mask=dm)
            o, o_t = fwAD.unpack_dual(out)
            loss = (out - cast(target)).square().mean() + (o * o_t.detach()).mean()
            grads = torch.autograd.grad(loss, leaves)
        return dict(zip(("o", "o_t", "dq", "dk", "dv", "dmask"), (o.detach(), o_t, *grads)))

    fn = _masked_sdpa(torch.float32)
    ours, ref, same = run(flash_jvp.attention, torch.clone), run(fn, _to64), run(fn, torch.clone)
    _compare(ours, ref, same, torch.float32)


# ---------------------------------------------------------------- 4: CausalBias objects
CAUSAL_LENGTHS = [(33, 77), (77, 33), (50, 50), (1, 40), (40, 1)]
CAUSAL_LENGTHS += [pytest.param((1000, 2048), marks=gpu), pytest.param((2048, 1000), marks=gpu)]


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize("variant", ["upper_left", "lower_right"])
@pytest.mark.parametrize("lengths", CAUSAL_LENGTHS, ids=lambda n: f"Lq{n[0]}-Lk{n[1]}")
def test_causal_bias_objects(lengths, variant):
    """causal_upper_left / causal_lower_right match their materialised masks; lower-right with
    Lq > Lk gives exact zeros (no NaN) in its first Lq - Lk rows."""
    Lq, Lk = lengths
    dtype = DTYPES[0] if Lq >= 1000 else torch.float32
    make = causal_upper_left if variant == "upper_left" else causal_lower_right
    bias = make(Lq, Lk)
    q, k, v, tangents, do = qkv(1, 2, 2, Lq, Lk, 32, dtype=dtype)
    ours = check_mask(q, k, v, bias, tangents, do, ref_mask=bias._materialize(q.device))
    _assert_all_finite(ours)
    dead = Lq - Lk if variant == "lower_right" and Lq > Lk else 0
    for name in ("o", "o_t", "dq"):
        rows = ours[name][:, :, :dead]
        assert torch.equal(rows, torch.zeros_like(rows)), f"{name} not zero on masked rows"
    if variant == "upper_left":  # the same as is_causal=True, bit for bit
        causal = _outputs(lambda *a, attn_mask, **kw: flash_jvp.attention(*a, is_causal=True),
                          q, k, v, None, tangents, do)  # fmt: skip
        for name, x in causal.items():
            assert torch.equal(ours[name], x), f"{name}: causal_upper_left != is_causal=True"


# ---------------------------------------------------------------- 5: errors
def _small(dtype=torch.float32):
    return tuple(randn(2, 2, 8, 16, dtype=dtype) for _ in range(3))


def test_mask_with_is_causal_is_sdpa_error():
    """attn_mask with is_causal=True: SDPA's message, as both ValueError and RuntimeError."""
    q, k, v = _small()
    mask = torch.ones(8, 8, dtype=torch.bool, device=DEVICE)
    message = "Explicit attn_mask should not be set when is_causal=True"
    for exc in (ValueError, RuntimeError):
        with pytest.raises(exc, match=message) as err:
            flash_jvp.attention(q, k, v, attn_mask=mask, is_causal=True)
        assert isinstance(err.value, ValueError) and isinstance(err.value, RuntimeError)
    with pytest.raises(RuntimeError, match=message):  # torch's own wording
        math_sdpa(q, k, v, attn_mask=mask, is_causal=True)


@needs_kernels
def test_autocast_is_the_call_on_cast_inputs():
    """Under fp16 autocast, float32 q, k, v, their tangents and a bf16 additive mask give
    exactly the call on their fp16 casts (as autocast casts SDPA's arguments)."""
    q, k, v, tangents, _ = qkv(1, 2, 2, 40, 40, 16)
    mask = randn(40, 40, dtype=torch.bfloat16)

    def call(mask):
        return lambda q, k, v: flash_jvp.attention(q, k, v, attn_mask=mask)

    with torch.autocast(DEVICE, dtype=torch.float16):
        o, o_t = torch.func.jvp(call(mask), (q, k, v), tangents)
    half = [x.half() for x in (q, k, v, *tangents)]
    o16, o_t16 = torch.func.jvp(call(mask.half()), tuple(half[:3]), tuple(half[3:]))
    assert o.dtype == o_t.dtype == torch.float16
    assert torch.equal(o, o16) and torch.equal(o_t, o_t16)


BAD_MASKS = [
    ("causal-bias-with-is-causal", lambda: causal_lower_right(8, 8), {"is_causal": True},
     ValueError, "CausalBias should not be used with causal=True"),
    ("causal-bias-wrong-lengths", lambda: causal_upper_left(8, 9), {}, ValueError,
     "Expected a CausalBias for query length 8 and key length 8, but got one for 8 and 9"),
    ("causal-bias-wrong-q-length", lambda: causal_lower_right(7, 8), {}, ValueError,
     "Expected a CausalBias for query length 8"),
    ("not-broadcasting", lambda: torch.ones(8, 9, dtype=torch.bool, device=DEVICE), {},
     ValueError, r"Expected attn_mask to broadcast to the attention scores \(2, 2, 8, 8\).*"
                 r"attn_mask of shape \(8, 9\)"),
    ("wrong-batch", lambda: torch.zeros(3, 1, 8, 8, device=DEVICE), {}, ValueError,
     r"attn_mask to broadcast.*attn_mask of shape \(3, 1, 8, 8\)"),
    ("too-many-dims", lambda: torch.zeros(1, 2, 2, 8, 8, device=DEVICE), {}, ValueError,
     r"attn_mask to broadcast.*attn_mask of shape \(1, 2, 2, 8, 8\)"),
    ("int64", lambda: torch.ones(8, 8, dtype=torch.int64, device=DEVICE), {}, TypeError,
     "Expected attn_mask dtype to be bool, torch.float32 or the query's dtype, but got "
     "attn_mask.dtype: torch.int64 and query.dtype: torch.float32"),
    ("float16-with-fp32-query", lambda: torch.zeros(8, 8, dtype=torch.float16, device=DEVICE),
     {}, TypeError, "attn_mask.dtype: torch.float16 and query.dtype: torch.float32"),
    ("float64", lambda: torch.zeros(8, 8, dtype=torch.float64, device=DEVICE), {}, TypeError,
     "attn_mask.dtype: torch.float64"),
    ("list", lambda: [[True] * 8] * 8, {}, TypeError,
     "Expected attn_mask to be None or a Tensor, but got <class 'list'>"),
    ("numpy", lambda: torch.ones(8, 8).numpy(), {}, TypeError,
     "Expected attn_mask to be None or a Tensor, but got <class 'numpy.ndarray'>"),
    ("mask-on-cpu", lambda: torch.ones(8, 8, dtype=torch.bool), {}, ValueError,
     r"Expected attn_mask on the device of query \(cuda:0\), but got attn_mask of shape "),
]  # fmt: skip


@pytest.mark.parametrize("name,make,kw,exc,match", BAD_MASKS, ids=[b[0] for b in BAD_MASKS])
def test_bad_mask_is_a_clear_error(name, make, kw, exc, match, monkeypatch):
    """Each invalid attn_mask raises its type and message before a launch; supports() agrees."""
    if name == "mask-on-cpu" and not CUDA:
        pytest.skip("needs a second device")
    monkeypatch.setattr(_ops, "attn_fwd", lambda *a, **k: pytest.fail("kernel launched"))
    q, k, v = _small()
    mask = make()
    with pytest.raises(exc, match=match):
        flash_jvp.attention(q, k, v, attn_mask=mask, **kw)
    reasons = flash_jvp.supports(q, k, v, attn_mask=mask, **kw)
    assert any(re.search(match, r) for r in reasons), reasons


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
def test_supports_accepts_valid_masks(dtype):
    """supports() is [] for every documented mask form."""
    q, k, v = _small(dtype)
    for mask in (torch.ones(8, 8, dtype=torch.bool, device=DEVICE),
                 torch.zeros(2, 1, 1, 8, device=DEVICE),
                 torch.zeros(2, 2, 8, 8, dtype=dtype, device=DEVICE),
                 torch.zeros(1, 8, device=DEVICE).expand(2, 2, 8, 8),
                 causal_upper_left(8, 8), causal_lower_right(8, 8)):  # fmt: skip
        assert flash_jvp.supports(q, k, v, attn_mask=mask) == [], mask
    assert flash_jvp.supports(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.int64)) != []


# ---------------------------------------------------------------- 6: poisoned neighbours
def _in_buffer(x: torch.Tensor, transposed: bool = False, poison: bool = True) -> torch.Tensor:
    """x's values in a view of a larger buffer whose other entries are NaN (float) or random
    bytes (bool) with ``poison``, else 0 / False; ``transposed``: the buffer's last two dims
    are swapped (the view is a transposed one)."""
    a, b, c, d = x.shape
    if transposed:
        c, d = d, c
    shape = (a + 1, b + 1, c + 3, d + 8)
    if x.dtype == torch.bool and poison:
        buf = torch.randint(0, 256, shape, dtype=torch.uint8, device=x.device).view(torch.bool)
    else:
        buf = torch.full(shape, float("nan") if poison else 0, dtype=x.dtype, device=x.device)
    view = buf[1:, 1:, 2:-1, 5:-3]
    if transposed:
        view = view.transpose(-1, -2)
    view.copy_(x)
    return view


POISON = [
    pytest.param("bool", (2, 2, 33, 40), False, id="bool-BHLqLk"),
    pytest.param("bool", (2, 1, 1, 40), False, id="bool-key-padding"),
    pytest.param("bool", (1, 2, 33, 40), True, id="bool-transposed", marks=gpu),
    pytest.param("additive", (2, 2, 33, 40), False, id="add-BHLqLk", marks=gpu),
    pytest.param("additive", (2, 1, 33, 1), False, id="add-row-bias"),
    pytest.param("additive", (1, 2, 33, 40), True, id="add-transposed"),
]


@pytest.mark.parametrize("kind,shape,transposed", POISON)
def test_poisoned_mask_neighbours(kind, shape, transposed):
    """A mask (and its tangent) viewed from a NaN/garbage-filled buffer gives results bit for
    bit equal to the same view of a clean buffer (nothing outside the view is read) and, for
    an untransposed view, to a fresh contiguous mask.

    A transposed mask is not compared bit for bit with a contiguous one: on the H200 the
    kernels specialised for its strides round differently (1 ulp of fp16 in o, dq, dk).
    """
    q, k, v, tangents, do = qkv(2, 2, 2, 33, 40, 32, dtype=torch.float16)
    keep = _random_keep(*shape, density=0.6)
    keep[..., :1] = True  # no fully masked rows here: those are C5's
    additive = kind == "additive"
    mask = _additive(keep, torch.float32) if additive else keep
    mask_t = randn(*shape) if additive else None

    def run(**how):
        m = _in_buffer(mask, transposed, **how)
        m_t = None if mask_t is None else _in_buffer(mask_t, transposed, **how)
        return _outputs(flash_jvp.attention, q, k, v, m, tangents, do, m_t, additive)

    dirty, clean = run(poison=True), run(poison=False)
    _assert_all_finite(clean)
    fresh = _outputs(flash_jvp.attention, q, k, v, mask, tangents, do, mask_t, additive)
    for name, x in clean.items():
        assert torch.equal(x, dirty[name]), f"{name} differs when neighbouring memory is poisoned"
        if not transposed:
            assert torch.equal(x, fresh[name]), f"{name}: a view differs from a fresh mask"
        else:
            assert_close_rel(name, x, fresh[name], 4 * _check.floor(torch.float16))


# ---------------------------------------------------------------- 8: BERT-style encoder
class _Layer(torch.nn.Module):
    """Post-LN transformer encoder layer (BERT): attention, residual, LayerNorm, GELU MLP."""

    def __init__(self, attn, dim=64, heads=2):
        super().__init__()
        self.attn, self.heads = attn, heads
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )

    def forward(self, x, mask):
        B, L, C = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        o = self.attn(q, k, v, attn_mask=mask)
        x = self.ln1(x + self.out(o.transpose(1, 2).reshape(B, L, C)))
        return self.ln2(x + self.mlp(x))


class _Encoder(torch.nn.Module):
    def __init__(self, attn, layers=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(attn) for _ in range(layers))

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x


@pytest.mark.parametrize("mask_kind", ["bool", "hf-additive"])
def test_bert_encoder_end_to_end(mask_kind):
    """A padded batch through 2 BERT layers: jvp w.r.t. the embeddings and the input gradient
    on real tokens match a float64 math-SDPA twin; padded tokens get exactly zero gradient."""
    lengths, L = [40, 23, 7], 40
    real = torch.arange(L, device=DEVICE) < torch.tensor(lengths, device=DEVICE)[:, None]
    keep = real[:, None, None, :]
    if mask_kind == "bool":
        mask = keep
    else:  # HuggingFace: (1 - mask) * finfo(dtype).min
        mask = (1.0 - keep.float()) * torch.finfo(torch.float32).min
    ours_model = _Encoder(flash_jvp.attention).to(DEVICE)
    ref_model = _Encoder(_masked_sdpa(torch.float32)).to(DEVICE)
    ref_model.load_state_dict(ours_model.state_dict())
    same_model = _Encoder(_masked_sdpa(torch.float32)).to(DEVICE)
    same_model.load_state_dict(ours_model.state_dict())
    ref_model.double()
    x, x_t, g = (randn(3, L, 64) for _ in range(3))

    def run(model, cast):
        xc = cast(x).requires_grad_()
        m = mask if mask.dtype == torch.bool else cast(mask)
        y, y_t = torch.func.jvp(lambda e: model(e, m), (cast(x),), (cast(x_t),))
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(model(xc, m), xc, cast(g) * real[..., None])
        return {"y": y[real], "y_t": y_t[real], "grad": grad}

    ours = run(ours_model, torch.clone)
    ref = run(ref_model, _to64)
    same = run(same_model, torch.clone)
    for name, x_ in ours.items():
        tol = _check.RTOL * _check.rel_err(same[name], ref[name]) + _check.floor(torch.float32)
        err = _check.rel_err(x_, ref[name])
        assert err <= tol, f"{name}: rel err {err:.3e} > {tol:.3e}"
    padded = ours["grad"][~real]
    assert torch.equal(padded, torch.zeros_like(padded)), "padded tokens got a gradient"


def test_expanded_leaf_mask_gets_one_gradient_entry_per_element():
    """A stride-0 (expanded) leaf mask of size > 1 gets per-element gradients (autograd rule)."""
    q, k, v, _, do = qkv(1, 2, 2, 20, 24, 16)
    grads = {}
    for name, dtype, fn in (("ours", torch.float32, flash_jvp.attention),
                            ("ref", torch.float64, reference.math_sdpa)):  # fmt: skip
        base = torch.linspace(-2, 2, 24, dtype=dtype, device=DEVICE)
        m = base.expand(20, 24).requires_grad_()  # rows share storage
        (fn(q.to(dtype), k.to(dtype), v.to(dtype), attn_mask=m) * do.to(dtype)).sum().backward()
        grads[name] = m.grad
    assert_close_rel("dmask", grads["ours"], grads["ref"], 1e-5)


def test_nan_mask_entries_reach_the_output_and_sparse_masks_are_refused():
    """NaN in an additive mask gives NaN like SDPA (never a silently skipped block); a sparse
    mask is a TypeError naming attn_mask."""
    q, k, v, _, _ = qkv(1, 1, 1, 40, 40, 16)
    mask = torch.zeros(40, 40, device=DEVICE)
    mask[:32] = float("nan")  # a whole 32-row block of NaN
    o = flash_jvp.attention(q, k, v, attn_mask=mask)
    assert torch.isnan(o[..., :32, :]).all() and torch.isfinite(o[..., 32:, :]).all()
    sparse = torch.ones(40, 40, device=DEVICE).to_sparse()
    with pytest.raises(TypeError, match="dense .strided. attn_mask"):
        flash_jvp.attention(q, k, v, attn_mask=sparse)
