"""The tile-range table of an attn_mask, the one the attention kernels skip blocks with.

For every MASK_GROUP rows of a mask (n_rows, n_cols) (rows: queries, or keys for the
backward's dK/dV table, read through transposed strides): lo, hi = the columns where any of
these rows takes part (lo = other_len, hi = 0 if none), and dense = 1 if each row takes part
on exactly [lo, hi) (key padding, say), which lets the attention kernels bound their loop
instead of loading the mask. One program per group of rows and (batch, head) of the mask's
own shape. A mask with n_cols = 1 is broadcast along its columns: a row then takes part on
all other_len of them or on none. One launch replaces ~35 small torch ops per table (host
time: they made a masked call at L = 4096 host-bound on the H200).
"""

import triton
import triton.language as tl

from .common import MASK_GROUP


@triton.jit
def mask_ranges_kernel(
    MASK,
    RANGES,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    stride_rb,
    stride_rh,
    stride_rg,
    H,
    n_rows,
    n_cols,
    other_len,
    mask_min,
    MASK_KIND: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """RANGES[b, h, g] = (lo, hi, dense) int32 for rows [g * MASK_GROUP, ...) of the mask
    (b, h, n_rows, n_cols). Grid: (cdiv(n_rows, MASK_GROUP), mask b * h).

    MASK_KIND 1: boolean (nonzero takes part); 2: additive (takes part unless <= mask_min or
    -inf; NaN takes part, as in the attention kernels)."""
    g = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    offs_r = g * MASK_GROUP + tl.arange(0, MASK_GROUP)
    in_r = offs_r < n_rows
    base = MASK + off_b * stride_mb + off_h * stride_mh + offs_r[:, None].to(tl.int64) * stride_mm
    first = tl.full([MASK_GROUP], 2147483647, tl.int32)
    last = tl.zeros([MASK_GROUP], tl.int32)
    count = tl.zeros([MASK_GROUP], tl.int32)
    for c0 in range(0, n_cols, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        inside = in_r[:, None] & (offs_c[None, :] < n_cols)
        vals = tl.load(base + offs_c[None, :] * stride_mn, mask=inside, other=0)
        if MASK_KIND == 1:
            keep = vals != 0
        else:
            keep = (vals.to(tl.float32) <= mask_min) == 0  # NaN compares False: kept
        keep = keep & inside
        first = tl.minimum(first, tl.min(tl.where(keep, offs_c[None, :], 2147483647), 1))
        last = tl.maximum(last, tl.max(tl.where(keep, offs_c[None, :] + 1, 0), 1))
        count += tl.sum(keep.to(tl.int32), 1)
    if n_cols == 1:  # broadcast columns: all other_len of them, or none
        first = tl.where(count > 0, 0, first)
        last = tl.where(count > 0, other_len, 0)
        count = count * other_len
    row_lo = tl.where(count > 0, first, other_len)
    row_hi = tl.where(count > 0, last, 0)
    lo = tl.min(tl.where(in_r, row_lo, 2147483647), 0)
    hi = tl.max(tl.where(in_r, row_hi, 0), 0)
    exact = (row_lo == lo) & (row_hi == hi) & (count == hi - lo)
    dense = tl.min(tl.where(in_r, exact.to(tl.int32), 1), 0)
    out = RANGES + off_b * stride_rb + off_h * stride_rh + g * stride_rg
    tl.store(out, lo)
    tl.store(out + 1, hi)
    tl.store(out + 2, dense)
