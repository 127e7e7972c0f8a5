"""Gated residual ``out = x + gate * y`` (adaLN-Zero's gate, as DiT blocks add their
attention and MLP outputs) with its forward-mode tangent in the same pass:

    out_t = x_t + gate_t * y + gate * y_t

x, y: rows (N, D); gate: (G, D), row r using gate row r // ROWS. The backward is plain
elementwise torch (dx = dout, dy = dout * gate, dgate = sum of dout * y over the group).
"""

import triton
import triton.language as tl

from .rows import load_row, row_program


@triton.jit
def gated_residual_kernel(
    X, G, Y, X_T, G_T, Y_T, OUT, OUT_T,
    stride_x, stride_g, stride_y, stride_xt, stride_gt, stride_yt, stride_o, stride_ot,
    D, ROWS,
    HAS_X_T: tl.constexpr, HAS_G_T: tl.constexpr, HAS_Y_T: tl.constexpr,
    TANGENT: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One row per program: out (and out_t with TANGENT), in float32."""
    row, group, cols, inside = row_program(ROWS, D, BLOCK_D)
    x = load_row(X, row * stride_x, cols, inside)
    g = load_row(G, group * stride_g, cols, inside)
    y = load_row(Y, row * stride_y, cols, inside)
    tl.store(OUT + row * stride_o + cols, (x + g * y).to(OUT.dtype.element_ty), mask=inside)
    if TANGENT:
        out_t = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_X_T:
            out_t += load_row(X_T, row * stride_xt, cols, inside)
        if HAS_G_T:
            out_t += load_row(G_T, group * stride_gt, cols, inside) * y
        if HAS_Y_T:
            out_t += g * load_row(Y_T, row * stride_yt, cols, inside)
        tl.store(OUT_T + row * stride_ot + cols, out_t.to(OUT_T.dtype.element_ty), mask=inside)
