"""Triton helpers shared by the forward and backward kernels."""

import torch
import triton
import triton.language as tl

from .._utils import INTERPRET

LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln 2: scores are kept in base 2 for exp2
LN2 = tl.constexpr(0.6931471805599453)
# Rows (or keys) per entry of the tile-range tables built from an attn_mask (see _ops.py);
# every BLOCK_M / BLOCK_N is a multiple of it.
MASK_GROUP = tl.constexpr(16)


@triton.jit
def aligned(stride, ALIGN: tl.constexpr):
    """``stride`` (a multiple of ALIGN, checked by the launcher), in a form the compiler knows
    to be one. Triton itself marks only integer arguments divisible by 16, so a row stride of
    72 (head dim 72) would leave every tile load unvectorised (2-byte accesses)."""
    return (stride // ALIGN) * ALIGN


@triton.jit
def load_tile(
    base,
    offs_r,
    offs_c,
    stride_r,
    stride_c,
    n_rows,
    N_COLS: tl.constexpr,
    CHECK_R: tl.constexpr,
    CHECK_C: tl.constexpr,
):
    """Load a [len(offs_r), len(offs_c)] tile; out-of-range rows/columns read as 0.

    Only the checks the caller asks for are emitted, so interior tiles load unmasked.
    """
    ptrs = base + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c
    if CHECK_R:
        if CHECK_C:
            tile = tl.load(
                ptrs, mask=(offs_r[:, None] < n_rows) & (offs_c[None, :] < N_COLS), other=0.0
            )
        else:
            tile = tl.load(ptrs, mask=offs_r[:, None] < n_rows, other=0.0)
    else:
        if CHECK_C:
            tile = tl.load(ptrs, mask=offs_c[None, :] < N_COLS, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def store_tile(base, value, offs_r, offs_c, stride_r, stride_c, n_rows, N_COLS: tl.constexpr):
    ptrs = base + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c
    tl.store(ptrs, value, mask=(offs_r[:, None] < n_rows) & (offs_c[None, :] < N_COLS))


@triton.jit
def load_split(
    base,
    offs_r,
    stride_r,
    stride_c,
    n_rows,
    N_COLS: tl.constexpr,
    HEAD: tl.constexpr,
    TAIL: tl.constexpr,
    CHECK_R: tl.constexpr,
):
    """A [len(offs_r), N_COLS] tile as two tiles: columns [0, HEAD) and, when TAIL > 0,
    [HEAD, HEAD + TAIL) (TAIL == 0: the second is the first again, unused). Columns past
    N_COLS read as 0. Head dims such as 72 or 96 so run as 64 + 16 or 64 + 32 columns
    instead of one tile padded to 128 (see _ops._head_tiles)."""
    a = load_tile(base, offs_r, tl.arange(0, HEAD), stride_r, stride_c, n_rows, N_COLS,
                  CHECK_R, N_COLS < HEAD)  # fmt: skip
    b = a
    if TAIL > 0:
        b = load_tile(base + HEAD * stride_c, offs_r, tl.arange(0, TAIL), stride_r, stride_c,
                      n_rows, N_COLS - HEAD, CHECK_R, N_COLS - HEAD < TAIL)  # fmt: skip
    return a, b


@triton.jit
def tile_desc(base, n_rows, stride_r, N_COLS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """A tensor descriptor of the [n_rows, N_COLS] matrix at ``base`` (row stride stride_r,
    unit column stride; base and stride 16-byte aligned, which the launcher checks), moved
    as [ROWS, COLS] tiles by Hopper's copy engine (TMA): asynchronously, with no address
    registers, zero-filled past the matrix on loads and clipped to it on stores. Made on
    the device, per program, in global scratch the launcher provides: one matrix per
    (batch, head) or packed sequence, any strides, and Triton's warp specialisation takes
    only such descriptors (host-made ones hung or gave NaN under it; benchmarks/NOTES.md)."""
    return tl.make_tensor_descriptor(base, [n_rows, N_COLS], [stride_r, 1], [ROWS, COLS])


@triton.jit
def load_rows(
    desc,
    base,
    start,
    offs,
    stride_r,
    stride_c,
    n_rows,
    N_COLS: tl.constexpr,
    HEAD: tl.constexpr,
    TAIL: tl.constexpr,
    CHECK_R: tl.constexpr,
    TMA: tl.constexpr,
):
    """load_split of the rows offs = start + arange of a [rows, N_COLS] matrix (the key-side
    tiles of the forward and dQ kernels); with TMA through ``desc`` (see
    tile_desc; single tiles only) instead. Either way rows from n_rows on (with CHECK_R)
    and columns past N_COLS read as 0: the copy engine zero-fills past the matrix's rows,
    and rows between n_rows (the end of a mask's range) and there are zeroed here, so
    values there (NaN in padding) never meet a zero weight. Past the matrix alone no check
    is needed with TMA (the caller then leaves CHECK_R off)."""
    if TMA:
        a = desc.load([start, 0])
        if CHECK_R:
            a = tl.where(offs[:, None] < n_rows, a, 0.0)
        b = a
    else:
        a, b = load_split(base, offs, stride_r, stride_c, n_rows, N_COLS, HEAD, TAIL, CHECK_R)
    return a, b


@triton.jit
def store_split(
    base,
    a,
    b,
    offs_r,
    stride_r,
    stride_c,
    n_rows,
    N_COLS: tl.constexpr,
    HEAD: tl.constexpr,
    TAIL: tl.constexpr,
):
    """Store a tile held as two column tiles (see load_split), columns below N_COLS only."""
    store_tile(base, a, offs_r, tl.arange(0, HEAD), stride_r, stride_c, n_rows, N_COLS)
    if TAIL > 0:
        store_tile(base + HEAD * stride_c, b, offs_r, tl.arange(0, TAIL), stride_r, stride_c,
                   n_rows, N_COLS - HEAD)  # fmt: skip


@triton.jit
def dot_split(a, a2, b, b2, acc, TAIL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b^T (+ acc) where the contraction dim is held as two column tiles (load_split)."""
    acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
    if TAIL > 0:
        acc = tl.dot(a2, tl.trans(b2), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def seq_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, off_b, Lq, Lk, VARLEN: tl.constexpr):
    """(first query row, query length, first key, key length) of batch entry off_b.

    Packed batches (VARLEN) read them from the cumulative lengths; dense ones start at 0.
    """
    if VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + off_b)
        q_len = tl.load(CU_SEQLENS_Q + off_b + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + off_b)
        k_len = tl.load(CU_SEQLENS_K + off_b + 1) - k_start
        return q_start.to(tl.int64), q_len, k_start.to(tl.int64), k_len
    else:
        return 0, Lq, 0, Lk


@triton.jit
def key_range(
    start_m,
    Lk,
    causal_offset,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
):
    """Key blocks one query block visits: [0, full_end) need no mask, [full_end, end) do.

    Causal: query row i sees keys j <= i + causal_offset (0: SDPA's top-left alignment;
    Lk - Lq: bottom-right), so every row of the block sees keys <= start_m + causal_offset
    and none sees keys >= start_m + BLOCK_M + causal_offset.
    """
    if IS_CAUSAL:
        end = tl.maximum(tl.minimum(Lk, start_m + BLOCK_M + causal_offset), 0)
        full = tl.maximum(tl.minimum(Lk, start_m + 1 + causal_offset), 0)
    else:
        end = Lk
        full = Lk
    full_end = (full // BLOCK_N) * BLOCK_N
    return full_end, end


@triton.jit
def score_mask(offs_m, offs_n, Lk, causal_offset, IS_CAUSAL: tl.constexpr):
    """[BLOCK_M, BLOCK_N] True where query row offs_m may attend to key offs_n."""
    keep = offs_n[None, :] < Lk
    if IS_CAUSAL:
        keep = keep & (offs_m[:, None] + causal_offset >= offs_n[None, :])
    return keep


@triton.jit
def load_mask(
    base,
    offs_r,
    offs_c,
    stride_r,
    stride_c,
    n_rows,
    n_cols,
    SAME_ROWS: tl.constexpr,
    SAME_COLS: tl.constexpr,
):
    """An attn_mask tile [len(offs_r), len(offs_c)] (0 outside), read through its strides.

    SAME_ROWS / SAME_COLS: the stride along rows / columns is 0 (a broadcast mask, e.g. key
    padding), so one vector is loaded and broadcast instead of a whole tile.
    """
    in_r = offs_r < n_rows
    in_c = offs_c < n_cols
    if SAME_ROWS:
        vals = tl.load(base + offs_c * stride_c, mask=in_c, other=0)[None, :]
        vals = tl.where(in_r[:, None], vals, 0)
    elif SAME_COLS:
        vals = tl.load(base + offs_r * stride_r, mask=in_r, other=0)[:, None]
        vals = tl.where(in_c[None, :], vals, 0)
    else:
        ptrs = base + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c
        vals = tl.load(ptrs, mask=in_r[:, None] & in_c[None, :], other=0)
    return vals


@triton.jit
def apply_mask(s, vals, mask_min, MASK_KIND: tl.constexpr):
    """Base-2 scores s with an attn_mask tile applied.

    MASK_KIND 1: boolean (nonzero = take part); 2: additive, in natural-log units. Additive
    entries <= mask_min (finfo(dtype).min, the "masked" value of many models) or -inf mask
    the key out exactly, so a row with every key masked gives 0.
    """
    if MASK_KIND == 1:
        s = tl.where(vals != 0, s, float("-inf"))
    else:
        bias = vals.to(tl.float32)
        s = tl.where(bias <= mask_min, float("-inf"), s + bias * LOG2E)
    return s


@triton.jit
def mask_range(RANGES, stride_b, stride_h, stride_g, off_b, off_h, start, n, BLOCK: tl.constexpr):
    """From the per-MASK_GROUP table of _ops.mask_ranges, for rows (or keys) [start,
    start + BLOCK): the range [lo, hi) of keys (or rows) the attn_mask lets any of them see,
    and ``dense``: every one of them sees exactly [lo, hi) (so no mask needs loading)."""
    offs_g = start // MASK_GROUP + tl.arange(0, BLOCK // MASK_GROUP)
    ptrs = RANGES + off_b * stride_b + off_h * stride_h + offs_g * stride_g
    valid = offs_g * MASK_GROUP < n
    g_lo = tl.load(ptrs, mask=valid, other=2147483647)
    g_hi = tl.load(ptrs + 1, mask=valid, other=0)
    g_dense = tl.load(ptrs + 2, mask=valid, other=1)
    lo = tl.min(g_lo, 0)
    hi = tl.max(g_hi, 0)
    same = (tl.max(tl.where(valid, g_lo, 0), 0) == lo) & (
        tl.min(tl.where(valid, g_hi, 2147483647), 0) == hi
    )
    return lo, hi, same & (tl.min(g_dense, 0) == 1)


if INTERPRET or torch.version.hip is not None:  # no PTX there; nothing to tell a compiler

    @triton.jit
    def uniform(x):
        return x

else:

    @triton.jit
    def uniform(x):
        """x (int32, alike in every thread), marked warp-uniform for ptxas: a shuffle from lane
        0. Loop bounds loaded from memory are otherwise taken as divergent; on Hopper that
        costs 20-90 registers (spills) and up to 1.5x time in the mask kernels (measured)."""
        return tl.inline_asm_elementwise(
            "shfl.sync.idx.b32 $0, $1, 0, 0x1f, 0xffffffff;",
            "=r,r",
            [x],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )


@triton.jit
def block_range(
    RANGES,
    stride_b,
    stride_h,
    stride_g,
    off_b,
    off_h,
    start,
    n,
    n_other,
    BLOCK: tl.constexpr,
    BLOCK_OTHER: tl.constexpr,
    MASK_KIND: tl.constexpr,
    MASK_SPLIT: tl.constexpr,
):
    """What the program owning [start, start + BLOCK) visits along the other axis: blocks from
    lo (a multiple of BLOCK_OTHER) to hi, entries below ``bound``; and ``run``: whether this
    launch handles the block (boolean masks run twice, see MASK_SPLIT in fwd.py: launch 1
    takes the blocks that see exactly [lo, hi) and bounds them by hi, launch 2 the others)."""
    if MASK_KIND == 0:
        lo, hi, bound, run = 0, n_other, n_other, True
    else:
        lo, hi, dense = mask_range(RANGES, stride_b, stride_h, stride_g, off_b, off_h, start, n,
                                   BLOCK)  # fmt: skip
        lo, hi = uniform(lo), uniform(hi)  # they bound the loops
        dense = dense & (lo % BLOCK_OTHER == 0)
        if MASK_SPLIT == 1:
            bound, run = hi, dense
        else:
            lo, bound, run = (lo // BLOCK_OTHER) * BLOCK_OTHER, n_other, dense == 0
            if MASK_SPLIT == 0:
                run = True
    return lo, hi, bound, run
