"""Gated residual ``out = x + gate * y`` (adaLN-Zero's gate, as DiT blocks add their
attention and MLP outputs) with its forward-mode tangent in the same pass:

    out_t = x_t + gate_t * y + gate * y_t

x, y: rows (N, D); gate: (G, D), row r using gate row r // ROWS. The backward is plain
elementwise torch (dx = dout, dy = dout * gate, dgate = sum of dout * y over the group).
"""

import triton
import triton.language as tl


@triton.jit
def gated_residual_kernel(
    X, G, Y, X_T, G_T, Y_T, OUT, OUT_T,
    stride_x, stride_g, stride_y, stride_xt, stride_gt, stride_yt, stride_o, stride_ot,
    D, ROWS,
    HAS_X_T: tl.constexpr, HAS_G_T: tl.constexpr, HAS_Y_T: tl.constexpr,
    TANGENT: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One row per program: out (and out_t with TANGENT), in float32."""
    row = tl.program_id(0).to(tl.int64)
    group = row // ROWS
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    x = tl.load(X + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(G + group * stride_g + cols, mask=inside, other=0.0).to(tl.float32)
    y = tl.load(Y + row * stride_y + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (x + g * y).to(OUT.dtype.element_ty), mask=inside)
    if TANGENT:
        out_t = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_X_T:
            out_t += tl.load(X_T + row * stride_xt + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_G_T:
            g_t = tl.load(G_T + group * stride_gt + cols, mask=inside, other=0.0)
            out_t += g_t.to(tl.float32) * y
        if HAS_Y_T:
            y_t = tl.load(Y_T + row * stride_yt + cols, mask=inside, other=0.0)
            out_t += g * y_t.to(tl.float32)
        tl.store(OUT_T + row * stride_ot + cols, out_t.to(OUT_T.dtype.element_ty), mask=inside)
