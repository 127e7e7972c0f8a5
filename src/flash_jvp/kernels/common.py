"""Triton helpers shared by the forward and backward kernels."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # 1 / ln 2: scores are kept in base 2 for exp2
LN2 = tl.constexpr(0.6931471805599453)


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
def key_range(start_m, Lk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """Key blocks one query block visits: [0, full_end) need no mask, [full_end, end) do.

    Causal is SDPA's top-left alignment: query row i sees keys j <= i, so every row of the
    block sees keys < start_m + 1 and none sees keys >= start_m + BLOCK_M.
    """
    if IS_CAUSAL:
        end = tl.minimum(Lk, start_m + BLOCK_M)
        full = tl.minimum(Lk, start_m + 1)
    else:
        end = Lk
        full = Lk
    full_end = (full // BLOCK_N) * BLOCK_N
    return full_end, end


@triton.jit
def score_mask(offs_m, offs_n, Lk, IS_CAUSAL: tl.constexpr):
    """[BLOCK_M, BLOCK_N] True where query row offs_m may attend to key offs_n."""
    keep = offs_n[None, :] < Lk
    if IS_CAUSAL:
        keep = keep & (offs_m[:, None] >= offs_n[None, :])
    return keep
