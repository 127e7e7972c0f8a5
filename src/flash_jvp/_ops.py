"""Host launchers: allocate outputs, pick a config, build the grid, launch.

They take and return plain tensors with any strides: dense (B, H, L, E), or packed
(total, H, E) with cumulative sequence lengths (see :class:`Spec`); autograd lives in
``_function.py``. Inputs are assumed validated by ``_validate.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.errors import OutOfResources

from . import _plans
from ._utils import INTERPRET, MAX_GRID_Y, Spec, tangent_bwd_outputs, tangent_bwd_runs
from .kernels import configs
from .kernels.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from .kernels.bwd_hopper import HALF_N, attn_bwd_hopper_kernel
from .kernels.configs import Config
from .kernels.fwd import attn_fwd_kernel
from .kernels.fwd_hopper import HALF_M, attn_fwd_hopper_kernel
from .kernels.mask_ranges import mask_ranges_kernel

Tensor = torch.Tensor

MASK_GROUP = 16  # rows/keys per entry of the tile-range tables; kernels/common.py has it too
MASK_RANGES_BLOCK = 128  # mask columns per step of mask_ranges_kernel

# key -> the first candidate config that fit the GPU's resources for it
_CHOSEN: dict[tuple, Config] = {}


def forget_configs() -> None:
    """Choose launch configs anew (after the candidates changed); drops the launch plans made
    with the old choices too."""
    global _CHOSEN
    _CHOSEN = {}


def _chosen() -> dict:
    return _CHOSEN


def _empty(shape: Sequence[int], like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Every buffer the launchers return is allocated here (see _plans.allocate)."""
    return _plans.empty(shape, like.device, dtype or like.dtype)


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv is a jit-callable: ~10 us per host call, several per launch
    return -(-a // b)


def _pow2(e: int) -> int:
    """The next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (e - 1).bit_length())


def _head_tiles(e: int) -> tuple[int, int]:
    """(HEAD_DIM, HEAD_DIM_TAIL): the columns a head dim is tiled as. One power of two, or
    where two cover it with less padding, a power of two and a smaller one (72: 64 + 16, 96:
    64 + 32, 160: 128 + 32 instead of 128, 128, 256; measured in benchmarks/NOTES.md)."""
    full = _pow2(e)
    head = full // 2
    tail = _pow2(e - head) if e > head else 0
    return (head, tail) if head >= 32 and 0 < tail and head + tail < full else (full, 0)


def _tile_args(lay: _Layout) -> dict[str, int]:
    """HEAD_DIM[_TAIL] and HEAD_DIM_V[_TAIL] of the kernels for these head dims."""
    (h, t), (hv, tv) = _head_tiles(lay.D), _head_tiles(lay.DV)
    return dict(HEAD_DIM=h, HEAD_DIM_TAIL=t, HEAD_DIM_V=hv, HEAD_DIM_V_TAIL=tv)


def _tile_width(tiles: dict[str, int]) -> int:
    """The widest tile row a kernel holds (what its launch configs are chosen by)."""
    return max(tiles["HEAD_DIM"] + tiles["HEAD_DIM_TAIL"],
               tiles["HEAD_DIM_V"] + tiles["HEAD_DIM_V_TAIL"])  # fmt: skip


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 follows torch.backends.cuda.matmul.allow_tf32, like torch's own matmuls."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


_STRIDE_NAMES = {
    prefix: tuple(f"stride_{prefix}{n}" for n in names)
    for names, prefixes in (
        (("b", "h", "m", "n"), ("m", "mt", "g", "gt")),  # masks: (b, h, query row, key)
        (("b", "h", "g"), ("r",)),  # tile-range tables: (b, h, group)
        # dt: dO_t, the cotangent of o_t
        (("b", "h", "m", "d"), ("q", "o", "qt", "ot", "do", "dq", "dt", "dqt")),
        (("b", "h", "n", "d"), ("k", "v", "kt", "vt", "dk", "dv")),
    )
    for prefix in prefixes
}


def _strides(t: Tensor | None, prefix: str) -> dict[str, int]:
    names = _STRIDE_NAMES[prefix]
    return dict(zip(names, t.stride() if t is not None else (0,) * len(names)))


def _stride_align(*tiles: Tensor | None) -> int:
    """STRIDE_ALIGN: the largest power of two up to 16 dividing the row stride of every
    (B, H, L, E) view the kernel loads or stores tiles of (see kernels/common.aligned)."""
    g = math.gcd(*(t.stride(2) for t in tiles if t is not None))
    return min(16, g & -g) if g else 16


@dataclass
class _Layout:
    """(B, H, L, E) views of the inputs as the kernels index them, and their sizes."""

    B: int
    H: int
    H_KV: int
    Lq: int
    Lk: int
    D: int
    DV: int

    @staticmethod
    def of(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> _Layout:
        if spec.varlen:
            # the grid needs no more rows than the totals; clamped here, on the launch's own
            # ints: in the traced API a min() would guard on max_seqlen (a recompile per
            # value) and torch.sym_min does not trace under Dynamo of torch 2.11
            n = spec.cu_seqlens_q.numel() - 1
            lq, lk = min(spec.max_seqlen_q, q.shape[0]), min(spec.max_seqlen_k, k.shape[0])
            return _Layout(n, q.shape[1], k.shape[1], lq, lk, q.shape[2], v.shape[2])
        return _Layout(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
                       v.shape[3])  # fmt: skip


def _view(x: Tensor | None, spec: Spec, batch: int) -> Tensor | None:
    """Packed (total, H, E) -> (batch, H, total, E) with batch stride 0 (sequences start at
    their cu_seqlens offset inside the kernel); dense tensors pass through."""
    if x is None or not spec.varlen:
        return x
    return x.unsqueeze(0).transpose(1, 2).expand(batch, -1, -1, -1)


def _lse_strides(lse: Tensor, spec: Spec) -> dict[str, int]:
    """lse/delta are (B, H, Lq) dense, (H, total_q) packed."""
    if spec.varlen:
        return {"stride_lb": 0, "stride_lh": lse.stride(0)}
    return {"stride_lb": lse.stride(0), "stride_lh": lse.stride(1)}


def _seqlens(spec: Spec, like: Tensor) -> dict[str, Tensor]:
    """CU_SEQLENS_Q/K arguments (any valid pointer when dense); the kernels read them with
    stride 1. (Copied here, inside autograd.Function.forward, where torch.func does not wrap.)"""
    cu_q = spec.cu_seqlens_q.contiguous() if spec.varlen else like
    cu_k = spec.cu_seqlens_k.contiguous() if spec.varlen else like
    return {"CU_SEQLENS_Q": cu_q, "CU_SEQLENS_K": cu_k}


def mask_kind(mask: Tensor | None) -> int:
    """0: no mask; 1: boolean; 2: additive (the kernels' MASK_KIND)."""
    if mask is None:
        return 0
    return 1 if mask.dtype == torch.bool else 2


def _mask_splits(mask: Tensor | None) -> tuple[int, ...]:
    """MASK_SPLIT of each launch: a boolean mask runs the kernels twice, once for the blocks
    it leaves a plain key (row) range (no mask loads) and once for the others."""
    return (1, 2) if mask is not None and mask.dtype == torch.bool else (0,)


def _unexpanded(mask: Tensor) -> Tensor:
    """The mask with every stride-0 dim cut to size 1 (same values, no broadcast copies)."""
    for d in range(mask.dim()):
        if mask.stride(d) == 0 and mask.shape[d] > 1:
            mask = mask.narrow(d, 0, 1)
    return mask


def mask_ranges(mask: Tensor, other_len: int, mask_min: float) -> Tensor:
    """The tile-range table of a 4-D ``mask`` (b, h, n, m), one launch: (b, h, groups, 3)
    int32 rows (lo, hi, dense) per MASK_GROUP rows (see kernels/mask_ranges.py). Pass the
    mask transposed (a view) for a table per group of keys. Size-1 (or stride-0) dims stay
    size 1 in the table; the kernels read it through strides."""
    mask = _unexpanded(mask)
    b, h, n, m = mask.shape
    groups = _cdiv(n, MASK_GROUP)
    ranges = _empty((b, h, groups, 3), mask, torch.int32)
    _plans.launch(
        mask_ranges_kernel, (groups, b * h),
        MASK=mask.view(torch.uint8) if mask.dtype == torch.bool else mask, RANGES=ranges,
        **_strides(mask, "m"), **_strides(ranges, "r"), H=h, n_rows=n, n_cols=m,
        other_len=other_len, mask_min=mask_min, MASK_KIND=mask_kind(mask),
        BLOCK_C=MASK_RANGES_BLOCK,
    )  # fmt: skip
    return ranges


def _mask_args(
    mask: Tensor | None, lay: _Layout, mask_min: float, by_keys: bool, grad: bool = False
) -> dict:
    """Kernel arguments for an attn_mask (own 4-D shape, broadcast to (B, H, Lq, Lk) here
    through strides, never copied), and its tile-range table (per query group, or per key
    group with ``by_keys``). With ``grad`` (its gradient is accumulated along), rows/columns
    count as shared only where the mask's own size is 1: an expanded (stride-0) mask of size
    > 1 still gets one gradient entry per element, as autograd defines it."""
    if mask is None:
        return dict(MASK_KIND=0, MASK_SAME_ROWS=False, MASK_SAME_COLS=False,
                    **_strides(None, "m"), **_strides(None, "r"))  # fmt: skip
    full = mask.expand(lay.B, lay.H, lay.Lq, lay.Lk)  # spans < 2**31: see _validate.mask_span
    same_rows, same_cols = full.stride(2) == 0, full.stride(3) == 0
    if grad:
        same_rows, same_cols = same_rows and mask.shape[2] == 1, same_cols and mask.shape[3] == 1
    if by_keys:
        ranges = mask_ranges(mask.transpose(-1, -2), lay.Lq, mask_min)
        groups = _cdiv(lay.Lk, MASK_GROUP)
    else:
        ranges = mask_ranges(mask, lay.Lk, mask_min)
        groups = _cdiv(lay.Lq, MASK_GROUP)
    ranges = ranges.expand(lay.B, lay.H, groups, 3)
    return dict(
        MASK=full.view(torch.uint8) if mask.dtype == torch.bool else full,
        MASK_KIND=mask_kind(mask), MASK_SAME_ROWS=same_rows, MASK_SAME_COLS=same_cols,
        **_strides(full, "m"),
        **{("Q_RANGES" if by_keys else "KV_RANGES"): ranges}, **_strides(ranges, "r"),
    )  # fmt: skip


def _launch(
    kernel,
    grid: Callable[[Config], tuple[int, ...]],
    candidates: list[Config],
    key: tuple,
    cfg_args: Callable[[Config], dict] = lambda cfg: {},
    **args,
) -> None:
    """Launch with the first candidate that fits the GPU; remember it for this key.
    ``cfg_args``: the arguments that depend on the config (tensor descriptors' blocks)."""
    batch_heads = grid(candidates[0])[1]  # _validate checks it too; vmap folds more in here
    if batch_heads > MAX_GRID_Y:
        raise NotImplementedError(
            f"flash_jvp: batch * heads = {batch_heads} is more than this version launches "
            f"({MAX_GRID_Y}, CUDA's grid limit); split the batch."
        )
    chosen = _CHOSEN.get(key)
    if chosen is not None:
        _plans.launch(kernel, grid(chosen), **args, **cfg_args(chosen), **chosen.kwargs())
        return
    errors = []
    for cfg in candidates:
        try:
            _plans.launch(kernel, grid(cfg), **args, **cfg_args(cfg), **cfg.kwargs())
        except OutOfResources as err:
            errors.append(f"{cfg}: {err}")
            continue
        _CHOSEN[key] = cfg
        return
    raise NotImplementedError(
        f"flash_jvp: no launch configuration of {kernel.fn.__name__} fits this GPU for {key}: "
        + "; ".join(errors)
    )


@functools.cache
def _tma_capable(device: torch.device) -> bool:
    """Hopper (sm_90), where the kernels can read tiles through tensor descriptors (TMA)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _describable(x: Tensor) -> bool:
    """Whether the kernels can make tensor descriptors of a (B, H, L, E) view's matrices
    (common.tile_desc): 16-byte aligned data and (B, H, L) strides, unit column stride.
    A size-1 dim's stride is never multiplied by more than 0, so it may be anything."""
    align = 16 // x.element_size()
    if x.data_ptr() % 16 or (x.stride(3) != 1 and x.shape[3] != 1):
        return False
    return all(st % align == 0 or n == 1 for st, n in zip(x.stride()[:3], x.shape[:3]))


def _tma(tiles: dict[str, int], *tensors: Tensor | None) -> bool:
    """Whether a kernel can move every tile of ``tensors`` (those it reads or writes through
    descriptors: the forward's q, k, v, o and their tangents; the dQ kernel's k, v, k_t, v_t)
    through tensor descriptors (TMA; its config decides whether it does): Hopper, fp16/bf16,
    single head-dim tiles, each tensor _describable."""
    x = tensors[0]
    return (
        not tiles["HEAD_DIM_TAIL"]
        and not tiles["HEAD_DIM_V_TAIL"]
        and x.dtype in (torch.float16, torch.bfloat16)
        and _tma_capable(x.device)
        and all(_describable(t) for t in tensors if t is not None)
    )


@_plans.planned(_chosen)
def attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_t: Tensor | None,
    k_t: Tensor | None,
    v_t: Tensor | None,
    mask: Tensor | None,
    mask_t: Tensor | None,
    spec: Spec,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """Fused forward. Returns o (shaped like q with v's head dim), o_t (same, or None
    without tangents), lse float32 in natural log ((B, H, Lq) dense, (H, total_q) packed)
    and mu = rowsum(P o S_t), lse's tangent (laid out like lse, or None without tangents).
    Missing tangents count as zero and cost nothing. ``mask``: boolean or additive, a 4-D
    shape that broadcasts to (B, H, Lq, Lk); ``mask_t``: the additive mask's tangent."""
    lay = _Layout.of(q, k, v, spec)
    tangent = any(t is not None for t in (q_t, k_t, v_t, mask_t))
    o = _empty((*q.shape[:-1], lay.DV), q)
    o_t = _empty(o.shape, q) if tangent else None
    lse_shape = (lay.H, q.shape[0]) if spec.varlen else (lay.B, lay.H, lay.Lq)
    lse = _empty(lse_shape, q, torch.float32)
    mu = _empty(lse_shape, q, torch.float32) if tangent else None
    if o.numel() == 0 or lay.B == 0:
        return o, o_t, lse, mu
    tiles = _tile_args(lay)
    mask_min = torch.finfo(q.dtype).min
    mask_args = _mask_args(mask, lay, mask_min, by_keys=False)
    flags = dict(
        IS_CAUSAL=spec.causal_offset is not None,
        HAS_Q_T=q_t is not None,
        HAS_K_T=k_t is not None,
        HAS_V_T=v_t is not None,
        HAS_MASK_T=mask_t is not None,
        VARLEN=spec.varlen,
        DOT_PRECISION=_dot_precision(q.dtype),
        **{n: mask_args.pop(n) for n in ("MASK_KIND", "MASK_SAME_ROWS", "MASK_SAME_COLS")},
    )
    mask_t_full = None if mask_t is None else mask_t.expand(lay.B, lay.H, lay.Lq, lay.Lk)
    q4, k4, v4, o4, q_t4, k_t4, v_t4, o_t4 = (
        _view(x, spec, lay.B) for x in (q, k, v, o, q_t, k_t, v_t, o_t)
    )
    hopper = _hopper(lay, spec, mask, mask_t, (q4, k4, v4, q_t4, k_t4, v_t4))
    if hopper is not None:
        _attn_fwd_hopper(q4, k4, v4, q_t4, k_t4, v_t4, o4, o_t4, lse, mu, lay, spec, hopper)
        return o, o_t, lse, mu
    width, short = _tile_width(tiles), lay.Lk <= configs.SHORT_LK
    tma = _tma(tiles, q4, k4, v4, o4, q_t4, k_t4, v_t4, o_t4)
    # the warp-specialised loop: one per kernel, no attn_mask loads, no varlen; lse and mu
    # stored through 1-D descriptors, whose (b, h) rows start 16-byte aligned (fwd.py)
    ws = tma and mask is None and mask_t is None and not spec.varlen and lay.Lq % 4 == 0
    key = ("fwd", tuple(tiles.values()), short, tma, ws, q.dtype, tuple(flags.values()),
           q.device.index)  # fmt: skip
    args = dict(
        Q=q4, K=k4, V=v4, O=o4, LSE=lse, MU=_or(mu, lse),
        # absent tensors: any valid pointer, never read (the switches are compile-time)
        Q_T=_or(q_t4, q4), K_T=_or(k_t4, k4), V_T=_or(v_t4, v4), O_T=_or(o_t4, o4),
        MASK=mask_args.pop("MASK", q4), MASK_T=_or(mask_t_full, q4),
        KV_RANGES=mask_args.pop("KV_RANGES", lse), **_seqlens(spec, lse),
        **_strides(q4, "q"), **_strides(k4, "k"), **_strides(v4, "v"), **_strides(o4, "o"),
        **_strides(q_t4, "qt"), **_strides(k_t4, "kt"), **_strides(v_t4, "vt"),
        **_strides(o_t4, "ot"), **_strides(mask_t_full, "mt"), **mask_args,
        **_lse_strides(lse, spec), scale=spec.scale, mask_min=mask_min,
        causal_offset=spec.causal_offset or 0, H=lay.H, GROUP=lay.H // lay.H_KV,
        Lq=lay.Lq, Lk=lay.Lk, D=lay.D, DV=lay.DV, **tiles,
        STRIDE_ALIGN=_stride_align(q4, k4, v4, o4, q_t4, k_t4, v_t4, o_t4), **flags,
    )  # fmt: skip
    for split in _mask_splits(mask):
        _launch(
            attn_fwd_kernel,
            lambda c: (_cdiv(lay.Lq, c.BLOCK_M), lay.B * lay.H),
            configs.fwd(width, q.dtype, tangent, short, ws, flags["IS_CAUSAL"]),
            key + (split,),
            lambda cfg: {"TMA": tma and cfg.tma, "WS": ws and cfg.tma and cfg.ws},
            MASK_SPLIT=split,
            **args,
        )
    return o, o_t, lse, mu


def _hopper(
    lay: _Layout, spec: Spec, mask: Tensor | None, mask_t: Tensor | None, views: tuple
) -> configs.HopperConfig | None:
    """The variant of the Gluon warp-specialised forward (kernels/fwd_hopper.py) for
    these (B, H, L, E) views of q, k, v, q_t, k_t, v_t, or None where it does not run (its
    scope: that module's docstring) or is not measured faster (configs.HOPPER). Inputs
    expanded over the batch or heads (a stride of 0) stay on the Triton forward, which reads
    them as they are: the Gluon forward would copy them out (_descriptor)."""
    tangents = views[3:]
    if any(t is None for t in tangents) and any(t is not None for t in tangents):
        return None  # some tangents only: the Triton forward skips the missing ones' products
    chosen = configs.HOPPER.get((tangents[0] is not None, lay.D))
    if (
        chosen is None
        or mask_t is not None
        or lay.Lk <= configs.HOPPER_MIN_LK
        # o's pointer offsets are 32-bit in the kernel (o is contiguous, as q's shape)
        or lay.B * lay.H * lay.Lq * lay.DV >= 2**31
        or not _gluon_scope(lay, spec, mask, views)
    ):
        return None
    return chosen


def _gluon_scope(lay: _Layout, spec: Spec, mask: Tensor | None, views: tuple) -> bool:
    """What the Gluon kernels (kernels/*_hopper.py) all need of (B, H, L, E) views ``views``
    (None: absent): Hopper outside the interpreter, fp16/bf16, one head dim, no attn_mask,
    dense batches, a grid's y within range, no input expanded with a stride of 0 (the
    Triton kernels read those as they are; TMA descriptors would copy them out)."""
    q = views[0]
    return not (
        mask is not None
        or spec.varlen
        or lay.DV != lay.D
        or lay.B * lay.H > MAX_GRID_Y
        or INTERPRET
        or q.dtype not in (torch.float16, torch.bfloat16)
        or not _tma_capable(q.device)
        or any(_expanded(x) for x in views if x is not None)
    )


def _expanded(x: Tensor) -> bool:
    """A stride of 0 over more than one entry (a broadcast view)."""
    return any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape))


def _descriptor(x: Tensor, rows: int, copy: bool = True) -> TensorDescriptor:
    """A rank-4 TMA descriptor over a (B, H, L, E) view, blocks of [1, 1, rows, E]; a view TMA
    cannot describe (not _describable) is copied first (``copy``; an output must never be),
    so the route and the bits do not depend on alignment. A size-1 dim's stride (never
    multiplied by more than 0) is replaced by an aligned one."""
    if not _describable(x):
        if not copy:
            raise RuntimeError(f"flash_jvp: internal error, output strides {x.stride()} not TMA")
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh, aligned allocation
    strides = list(x.stride())
    for d in (2, 1, 0):
        if x.shape[d] == 1:
            strides[d] = x.shape[d + 1] * strides[d + 1]
    block = [1, 1, rows, x.shape[3]]
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor(x, list(x.shape), strides, block, layout)


def _attn_fwd_hopper(q, k, v, q_t, k_t, v_t, o, o_t, lse, mu, lay: _Layout, spec: Spec,
                     cfg: configs.HopperConfig) -> None:  # fmt: skip
    """Launch kernels/fwd_hopper.py on (B, H, L, E) views (the tangents all given or none).
    Host descriptors hold the tensors' addresses, which a launch plan cannot swap: unplanned."""
    _plans.unplannable()
    tangent = q_t is not None
    rows = HALF_M.value  # each consumer's query rows

    def descs(q, k, v):  # q's in blocks of one consumer's rows, k's and v's of BLOCK_N keys
        return [_descriptor(q, rows), _descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n)]

    primal = descs(q, k, v)
    # absent tangents' descriptors: the primal's, never read (TANGENT is compile-time)
    tangents = descs(q_t, k_t, v_t) if tangent else primal
    o_t, mu = _or(o_t, o), _or(mu, lse)
    # o and o_t: fresh contiguous buffers (_empty); without O_TMA any descriptor, never read
    outs = [_descriptor(x, rows, copy=False) for x in (o, o_t)] if cfg.o_tma else primal[:2]
    grid = (_cdiv(lay.Lq, cfg.consumers * rows), lay.B * lay.H)
    attn_fwd_hopper_kernel[grid](
        *primal, *tangents, *outs, o, o_t, lse, mu, *o.stride()[:3], *o_t.stride()[:3],
        *_lse_strides(lse, spec).values(), spec.scale, spec.causal_offset or 0,
        lay.H, lay.H // lay.H_KV, lay.Lq, lay.Lk,
        HEAD_DIM=lay.D, BLOCK_N=cfg.block_n, STAGES=cfg.stages,
        IS_CAUSAL=spec.causal_offset is not None, TANGENT=tangent, O_TMA=cfg.o_tma,
        OVERLAP=cfg.overlap, CONSUMER_REGS=cfg.regs, CONSUMERS=cfg.consumers, num_warps=4,
    )  # fmt: skip


def _or(x: Tensor | None, default: Tensor) -> Tensor:
    return default if x is None else x


def attn_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    mask: Tensor | None,
    spec: Spec,
    mask_grad: bool = False,
    dlse: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients dq, dk, dv (shaped and typed like q, k, v) of sum(o * do) [+ sum(lse *
    dlse)], and with ``mask_grad`` that of the additive mask (shaped and typed like it; else
    None). ``dlse``, the cotangent of lse (laid out like it), adds P * dlse to dS, which
    the kernels get as delta - dlse."""
    n = None
    grads = attn_bwd_tangent(do, n, q, k, v, n, n, n, o, n, lse, n, mask, n, spec, dlse=dlse,
                             mask_grad=mask_grad)  # fmt: skip
    return grads[0], grads[1], grads[2], grads[6]


@_plans.planned(_chosen)
def attn_bwd_tangent(
    do: Tensor | None,
    do_t: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_t: Tensor | None,
    k_t: Tensor | None,
    v_t: Tensor | None,
    o: Tensor,
    o_t: Tensor | None,
    lse: Tensor,
    mu: Tensor | None,
    mask: Tensor | None,
    mask_t: Tensor | None,
    spec: Spec,
    *,
    dlse: Tensor | None = None,
    dmu: Tensor | None = None,
    mask_grad: bool = False,
    mask_t_grad: bool = False,
    tangent_grads: bool = True,
) -> tuple[Tensor | None, ...]:
    """Reverse mode through the fused forward: the gradients of sum(o * do) + sum(o_t * do_t)
    [+ sum(lse * dlse) + sum(mu * dmu)] (see kernels/bwd.py and
    reference.attention_tangent_bwd for the math).

    q_t, k_t, v_t, mask_t: the forward's tangents (None = zero); o, o_t, lse, mu: its outputs
    (o_t where do_t is given, mu where a tangent of the scores (q_t, k_t or mask_t) is);
    do, do_t, dlse, dmu: cotangents (None = zero; dlse and mu laid out like lse). Returns
    (dq, dk, dv, dq_t, dk_t, dv_t, dmask, dmask_t): shaped and typed like q, k, v, their
    tangents (None where the tangent is None, where neither do_t nor dmu is given, or without
    ``tangent_grads``) and the additive mask (float32 sums cast to its dtype; None unless
    ``mask_grad`` / ``mask_t_grad``).
    """
    lay = _Layout.of(q, k, v, spec)
    tangent = tangent_bwd_runs(q_t, k_t, v_t, mask_t, do_t, dmu)
    tangent_s = tangent and any(t is not None for t in (q_t, k_t, mask_t))
    if tangent_s and mu is None:
        raise ValueError("flash_jvp: the tangent backward needs mu, the forward's lse tangent")
    if tangent and do_t is not None and o_t is None:
        raise ValueError("flash_jvp: the tangent backward needs o_t with do_t")
    dq, dk, dv = _empty(q.shape, q), _empty(k.shape, k), _empty(v.shape, v)
    given = tangent_bwd_outputs(q_t, k_t, v_t, mask_t, do_t, dmu, mask_grad, mask_t_grad,
                                tangent_grads)  # fmt: skip
    dq_t, dk_t, dv_t = (_empty(x.shape, x) if g else None for x, g in zip((q, k, v), given[3:6]))
    # dmask_t stays zero without a tangent of the scores (dS_t never reaches it then)
    dmask, dmask_t = (_zeros_f32(mask) if need else None for need in (mask_grad, mask_t_grad))
    grads = (dq, dk, dv, dq_t, dk_t, dv_t)
    nothing = do is None and dlse is None and not tangent
    if q.numel() == 0 or k.numel() == 0 or lay.B == 0 or nothing:
        _plans.unplannable()  # zeroed in place
        zeros = (None if x is None else x.zero_() for x in grads)
        return (*zeros, _cast(dmask, mask), _cast(dmask_t, mask))
    lse = lse.contiguous()  # the kernels index it (and the other row statistics) by rows
    mu = mu.contiguous() if tangent_s else None
    delta = _empty(lse.shape, q, torch.float32)
    gamma = _empty(lse.shape, q, torch.float32) if tangent else None
    if not tangent:
        do_t = o_t = None
    q4, k4, v4, o4, do4, dq4, dk4, dv4 = (
        _view(x, spec, lay.B) for x in (q, k, v, o, do, dq, dk, dv)
    )
    q_t4, k_t4, v_t4, o_t4, do_t4, dq_t4, dk_t4, dv_t4 = (
        _view(x, spec, lay.B) if tangent else None
        for x in (q_t, k_t, v_t, o_t, do_t, dq_t, dk_t, dv_t)
    )
    seqlens = _seqlens(spec, lse)
    _plans.launch(
        attn_bwd_preprocess_kernel, (_cdiv(lay.Lq, configs.PREPROCESS_BLOCK_M), lay.B * lay.H),
        O=o4, DO=_or(do4, o4), DELTA=delta, O_T=_or(o_t4, o4), DO_T=_or(do_t4, o4),
        GAMMA=_or(gamma, delta), CU_SEQLENS_Q=seqlens["CU_SEQLENS_Q"],
        **_strides(o4, "o"), **_strides(do4, "do"), **_strides(o_t4, "ot"),
        **_strides(do_t4, "dt"), **_lse_strides(lse, spec),
        H=lay.H, Lq=lay.Lq, DV=lay.DV, HEAD_DIM_V=_pow2(lay.DV),
        BLOCK_M=configs.PREPROCESS_BLOCK_M, VARLEN=spec.varlen, HAS_DO=do is not None,
        HAS_DO_T=do_t is not None, HAS_O_T=o_t is not None,
        STRIDE_ALIGN=_stride_align(o4, do4, o_t4, do_t4),
    )  # fmt: skip
    if dlse is not None:
        _plans.unplannable()  # updated in place
        delta -= dlse  # dS = P o (dP - delta) + P * dlse
    hopper = None if tangent else _hopper_bwd(lay, spec, mask, (q4, k4, v4, do4))
    if hopper is not None:  # one Gluon kernel instead of the Triton ones below
        _attn_bwd_hopper(q4, k4, v4, do4, lse, delta, dq4, dk4, dv4, lay, spec, hopper)
        return (*grads, None, None)  # no mask in its scope: no mask gradients
    tiles = _tile_args(lay)
    if tangent and dmu is not None:  # dS_t gains P * dmu
        gamma = -dmu if do_t is None else gamma - dmu
    elif tangent and do_t is None:
        gamma = torch.zeros_like(delta)
    mask_min = torch.finfo(q.dtype).min
    mask_t_full = (
        mask_t.expand(lay.B, lay.H, lay.Lq, lay.Lk) if tangent_s and mask_t is not None else None
    )
    common = dict(
        Q=q4, K=k4, V=v4, LSE=lse, **seqlens,
        Q_T=_or(q_t4, q4), K_T=_or(k_t4, k4), V_T=_or(v_t4, v4), DO_T=_or(do_t4, q4),
        MASK_T=_or(mask_t_full, q4), GAMMA=_or(gamma, lse), MU=_or(mu, lse),
        **_strides(q4, "q"), **_strides(k4, "k"), **_strides(v4, "v"),
        **_strides(q_t4, "qt"), **_strides(k_t4, "kt"), **_strides(v_t4, "vt"),
        **_strides(do_t4, "dt"), **_strides(mask_t_full, "mt"),
        **_lse_strides(lse, spec), scale=spec.scale, mask_min=mask_min,
        causal_offset=spec.causal_offset or 0, H=lay.H, GROUP=lay.H // lay.H_KV,
        Lq=lay.Lq, Lk=lay.Lk, D=lay.D, DV=lay.DV, **tiles, VARLEN=spec.varlen,
        IS_CAUSAL=spec.causal_offset is not None, DOT_PRECISION=_dot_precision(q.dtype),
        STRIDE_ALIGN=_stride_align(q4, k4, v4, do4, dq4, dk4, dv4, q_t4, k_t4, v_t4, do_t4,
                                   dq_t4, dk_t4, dv_t4),
    )  # fmt: skip
    masks = (
        _mask_args(mask, lay, mask_min, by_keys=True),
        _mask_args(mask, lay, mask_min, by_keys=False, grad=mask_grad or mask_t_grad),
    )
    # dS_t reaches dmask_t only with a tangent of the scores; the TANGENT dQ kernel gives
    # dq_t and dmask_t beside dq (kernels/bwd.py)
    mask_t_grad = mask_t_grad and tangent_s
    _bwd_launches(
        common, masks, mask, lay, do4, delta, dq4, dk4, dv4, dmask, TANGENT=tangent,
        HAS_DO_T=do_t is not None, HAS_Q_T=q_t4 is not None, HAS_K_T=k_t4 is not None,
        HAS_V_T=v_t4 is not None, HAS_MASK_T=mask_t_full is not None,
        dq_t4=dq_t4, dmask_t=dmask_t if mask_t_grad else None,
    )  # fmt: skip
    if dk_t4 is not None or dv_t4 is not None:
        # dK_t and dV_t are the primal backward's dK and dV with dO := dO_t and delta :=
        # gamma: the primal dK/dV kernel gives them. It writes dk with dv: scratch where only
        # one of them is wanted
        dk_t4, dv_t4 = (_scratch(x4, x, spec, lay.B) for x4, x in ((dk_t4, k), (dv_t4, v)))
        _bwd_launches(common, masks, mask, lay, do_t4, gamma, None, dk_t4, dv_t4, None)
    return (*grads, _cast(dmask, mask), _cast(dmask_t, mask))


def _hopper_bwd(
    lay: _Layout, spec: Spec, mask: Tensor | None, views: tuple
) -> configs.HopperBwdConfig | None:
    """The variant of the Gluon warp-specialised backward (kernels/bwd_hopper.py) for these
    (B, H, L, E) views of q, k, v, do, or None where it does not run (its scope: that
    module's docstring; configs.HOPPER_BWD; deterministic algorithms requested, as its dq
    sums in varying order)."""
    chosen = configs.HOPPER_BWD.get(lay.D)
    if (
        chosen is None
        or views[3] is None  # lse's cotangent alone
        or lay.H_KV != lay.H
        or min(lay.Lq, lay.Lk) < configs.HOPPER_BWD_MIN_L
        # dk's and dv's pointer offsets (fresh contiguous buffers) and dq's TMA row
        # coordinates are 32-bit in the kernel
        or lay.B * lay.H * max(lay.Lq, lay.Lk) * lay.D >= 2**31
        or torch.are_deterministic_algorithms_enabled()
        or not _gluon_scope(lay, spec, mask, views)
    ):
        return None
    return chosen


def _dq_accumulator(lay: _Layout, cfg: configs.HopperBwdConfig,
                    device: torch.device) -> tuple[Tensor, TensorDescriptor]:  # fmt: skip
    """The Gluon backward's zeroed float32 dq accumulator, (B, H, Lq', E) or with
    cfg.dq_transposed (B, H, E, Lq'), each head's Lq' rows (transposed: columns) padded to
    whole query blocks, and the rank-2 TMA descriptor its programs reduce into (rows
    flattened over batch and heads)."""
    rows = _cdiv(lay.Lq, cfg.block_m) * cfg.block_m
    shape = (lay.B, lay.H, lay.D, rows) if cfg.dq_transposed else (lay.B, lay.H, rows, lay.D)
    block = [lay.D, cfg.block_m] if cfg.dq_transposed else [cfg.block_m, lay.D]
    dq_acc = torch.zeros(shape, device=device, dtype=torch.float32)
    flat = dq_acc.view(-1, shape[-1])
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float32)
    return dq_acc, TensorDescriptor(flat, list(flat.shape), list(flat.stride()), block, layout)


def _attn_bwd_hopper(q, k, v, do, lse, delta, dq, dk, dv, lay: _Layout, spec: Spec,
                     cfg: configs.HopperBwdConfig) -> None:  # fmt: skip
    """Launch kernels/bwd_hopper.py on (B, H, L, E) views: dq through a float32 accumulator
    its programs add into (_dq_accumulator), scaled and cast into ``dq`` after in one pass.
    Unplanned (host descriptors hold the tensors' addresses)."""
    _plans.unplannable()
    keys = HALF_N.value
    dq_acc, dq_desc = _dq_accumulator(lay, cfg, q.device)
    grid = (_cdiv(lay.Lk, 2 * keys), lay.B * lay.H)
    attn_bwd_hopper_kernel[grid](
        _descriptor(q, cfg.block_m), _descriptor(k, keys), _descriptor(v, keys),
        _descriptor(do, cfg.block_m), dq_desc, lse, delta, dk, dv,
        lse.stride(0), lse.stride(1), *dk.stride()[:3], *dv.stride()[:3], spec.scale,
        spec.causal_offset or 0, lay.H, lay.Lq, lay.Lk, HEAD_DIM=lay.D, BLOCK_M=cfg.block_m,
        STAGES=cfg.stages, IS_CAUSAL=spec.causal_offset is not None,
        DQ_TRANSPOSED=cfg.dq_transposed, CONSUMER_REGS=cfg.regs, DQ_REGS=cfg.dq_regs,
        num_warps=4,
    )  # fmt: skip
    acc = dq_acc[..., : lay.Lq].transpose(2, 3) if cfg.dq_transposed else dq_acc[:, :, : lay.Lq]
    torch.mul(acc, spec.scale, out=dq)  # float32 product rounded once into dq's dtype


def _bwd_launches(
    args: dict,
    masks: tuple[dict, dict],
    mask: Tensor | None,
    lay: _Layout,
    do4: Tensor | None,
    delta: Tensor,
    dq4: Tensor | None,
    dk4: Tensor | None,
    dv4: Tensor | None,
    dmask: Tensor | None,
    dq_t4: Tensor | None = None,
    dmask_t: Tensor | None = None,
    **tangent_flags: bool,
) -> None:
    """The dK/dV and dQ kernels: into dk4 and dv4 (None: not launched), dq4 (None: not
    launched) and, with dq4, dmask (float32 sums, or None).
    ``args``: the arguments both share; ``masks``: _mask_args by keys and by query rows;
    ``tangent_flags``: TANGENT and the HAS_* of the tangents (default: the primal backward);
    ``dq_t4``, ``dmask_t``: with TANGENT, the dQ kernel's q_t and mask_t gradients too (None:
    not wanted).
    """
    flags = dict(HAS_DO=do4 is not None, TANGENT=False, HAS_DO_T=False, HAS_Q_T=False,
                 HAS_K_T=False, HAS_V_T=False, HAS_MASK_T=False) | tangent_flags  # fmt: skip
    args = dict(args, DO=_or(do4, args["Q"]), DELTA=delta, **_strides(do4, "do"), **flags)
    q4 = args["Q"]
    tiles = {n: args[n] for n in ("HEAD_DIM", "HEAD_DIM_TAIL", "HEAD_DIM_V", "HEAD_DIM_V_TAIL")}
    tile, tangent = _tile_width(tiles), flags["TANGENT"]
    key = (tuple(tiles.values()), q4.dtype, args["VARLEN"], args["IS_CAUSAL"],
           args["DOT_PRECISION"], mask_kind(mask), q4.device.index,
           tuple(flags.values()))  # fmt: skip
    dkdv_mask, dq_mask = ({"MASK": q4, "Q_RANGES": args["LSE"]} | masks[0],
                          {"MASK": q4, "KV_RANGES": args["LSE"]} | masks[1])  # fmt: skip
    if dk4 is not None:
        for split in _mask_splits(mask):
            _launch(
                attn_bwd_dkdv_kernel,
                lambda c: (_cdiv(lay.Lk, c.BLOCK_N), lay.B * lay.H_KV),
                configs.bwd_dkdv(tile, q4.dtype, tangent),
                ("dkdv", split) + key,
                DK=dk4, DV_OUT=dv4, **_strides(dk4, "dk"), **_strides(dv4, "dv"),
                H_KV=lay.H_KV, MASK_SPLIT=split, **dkdv_mask, **args,
            )  # fmt: skip
    if dq4 is None:
        return
    dmask_full, dmask_t_full = (
        None if m is None else m.expand(lay.B, lay.H, lay.Lq, lay.Lk) for m in (dmask, dmask_t)
    )
    # the tiles of its key loop (absent ones stand in as k, v, never read)
    tma = _tma(tiles, args["K"], args["V"], args["K_T"], args["V_T"])
    for split in _mask_splits(mask):
        _launch(
            attn_bwd_dq_kernel,
            lambda c: (_cdiv(lay.Lq, c.BLOCK_M), lay.B * lay.H),
            configs.bwd_dq(tile, q4.dtype, tangent),
            ("dq", dmask is not None, dq_t4 is not None, dmask_t_full is not None, split, tma)
            + key,
            lambda cfg: {"TMA": tma and cfg.tma},
            DQ=dq4, DMASK=_or(dmask_full, args["LSE"]), MASK_GRAD=dmask is not None,
            DQ_T=_or(dq_t4, dq4), DMASK_T=_or(dmask_t_full, args["LSE"]),
            GRAD_T=dq_t4 is not None, MASK_T_GRAD=dmask_t_full is not None,
            MASK_SPLIT=split, **_strides(dq4, "dq"), **_strides(dq_t4, "dqt"),
            **_strides(dmask_full, "g"), **_strides(dmask_t_full, "gt"), **dq_mask, **args,
        )  # fmt: skip


def _scratch(x4: Tensor | None, like: Tensor, spec: Spec, batch: int) -> Tensor:
    """x4, or a buffer shaped like ``like`` viewed as the kernels index it (packed ones stay
    (total, H, E) in memory) for a kernel output nobody reads."""
    return x4 if x4 is not None else _view(_empty(like.shape, like), spec, batch)


def _zeros_f32(mask: Tensor) -> Tensor:
    """A zeroed float32 gradient buffer shaped like ``mask`` (the kernels add into it)."""
    return _plans.zeros(mask.shape, mask.device, torch.float32)


def _cast(dmask: Tensor | None, mask: Tensor | None) -> Tensor | None:
    return None if dmask is None else dmask.to(mask.dtype)
