"""Triton helpers of the row-wise kernels of ``flash_jvp.nn`` (norms, gated residual): one
program per row of width D (BLOCK_D = next power of two), rows grouped by ROWS for per-group
vectors (adaLN's modulation and gate)."""

import triton
import triton.language as tl


@triton.jit
def row_program(ROWS, D, BLOCK_D: tl.constexpr):
    """This program's row (int64), its group (row // ROWS), the column offsets and their
    mask."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    return row, row // ROWS, cols, cols < D


@triton.jit
def load_row(PTR, offset, cols, inside):
    """The row at PTR + offset in float32, columns outside the mask 0."""
    return tl.load(PTR + offset + cols, mask=inside, other=0.0).to(tl.float32)
