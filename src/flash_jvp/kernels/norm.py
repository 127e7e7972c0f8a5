"""Row norms (LayerNorm / RMSNorm) with an optional affine and adaLN modulation, their
forward-mode tangent fused into the forward pass, and their backward.

Per row x of width D (rows grouped: row r belongs to group g = r // ROWS, the modulation's
batch entry), in float32:

    LayerNorm: xhat = (x - mean(x)) * rstd, rstd = 1 / sqrt(mean((x - mean(x))^2) + eps)
    RMSNorm:   xhat = x * rstd,             rstd = 1 / sqrt(mean(x^2) + eps)
    n = xhat * w + b                  (w, b: (D,), optional)
    y = n * (1 + scale[g]) + shift[g] (scale, shift: (G, D), optional)

Tangent along x_t (and scale_t, shift_t), by differentiating the lines above:

    xhat_t = rstd * (x_t - mean(x_t) - xhat * mean(xhat * x_t))   (RMSNorm: no mean(x_t))
    y_t = xhat_t * w * (1 + scale[g]) + n * scale_t[g] + shift_t[g]

Backward with cotangent dy: dn = dy * (1 + scale[g]), g_ = dn * w,
dx = rstd * (g_ - mean(g_) - xhat * mean(g_ * xhat)) (RMSNorm: no mean(g_)), and the sums
over rows dshift[g] = sum dy, dscale[g] = sum dy * n, dw = sum dn * xhat, db = sum dn, which
each program accumulates over its chunk of rows and writes as one partial row.
"""

import triton
import triton.language as tl

from .rows import load_row, row_program


@triton.jit
def _normalize(x, cols, D, eps, RMS: tl.constexpr):
    """xhat and rstd of one float32 row (columns >= D are zero in x and in xhat)."""
    if RMS:
        centred = x
    else:
        centred = tl.where(cols < D, x - tl.sum(x, axis=0) / D, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / D + eps)
    return centred * rstd, rstd


@triton.jit
def norm_fwd_kernel(
    X, X_T, Y, Y_T, RSTD,  # rows (N, D); RSTD (N,) float32
    W, B, SHIFT, SCALE, SHIFT_T, SCALE_T,  # (D,), (D,), (G, D) x 4 (unit column stride)
    stride_x, stride_xt, stride_y, stride_yt, stride_sh, stride_sc, stride_sht, stride_sct,
    D, ROWS, eps,
    RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_SHIFT: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_X_T: tl.constexpr, HAS_SHIFT_T: tl.constexpr,
    HAS_SCALE_T: tl.constexpr, TANGENT: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One row per program: y (and y_t with TANGENT) and rstd."""
    row, group, cols, inside = row_program(ROWS, D, BLOCK_D)
    x = load_row(X, row * stride_x, cols, inside)
    xhat, rstd = _normalize(x, cols, D, eps, RMS)
    tl.store(RSTD + row, rstd)
    w = load_row(W, 0, cols, inside) if HAS_W else 1.0
    n = xhat * w
    if HAS_B:
        n += load_row(B, 0, cols, inside)
    gain = 1.0
    if HAS_SCALE:
        gain += load_row(SCALE, group * stride_sc, cols, inside)
    y = n * gain
    if HAS_SHIFT:
        y += load_row(SHIFT, group * stride_sh, cols, inside)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=inside)
    if TANGENT:
        y_t = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_X_T:
            x_t = load_row(X_T, row * stride_xt, cols, inside)
            if not RMS:
                x_t = tl.where(inside, x_t - tl.sum(x_t, axis=0) / D, 0.0)
            xhat_t = rstd * (x_t - xhat * (tl.sum(xhat * x_t, axis=0) / D))
            y_t += xhat_t * w * gain
        if HAS_SCALE_T:
            y_t += n * load_row(SCALE_T, group * stride_sct, cols, inside)
        if HAS_SHIFT_T:
            y_t += load_row(SHIFT_T, group * stride_sht, cols, inside)
        tl.store(Y_T + row * stride_yt + cols, y_t.to(Y_T.dtype.element_ty), mask=inside)


@triton.jit
def norm_bwd_kernel(
    DY, X, RSTD, DX,  # rows (N, D), RSTD (N,)
    W, B, SHIFT, SCALE,
    P_SHIFT, P_SCALE, P_W, P_B,  # partial sums (programs, D), float32
    stride_dy, stride_x, stride_dx, stride_sc,
    D, ROWS, CHUNKS, CHUNK,
    RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_SHIFT: tl.constexpr,
    HAS_SCALE: tl.constexpr, NEED_X: tl.constexpr, NEED_SHIFT: tl.constexpr,
    NEED_SCALE: tl.constexpr, NEED_W: tl.constexpr, NEED_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows [c * CHUNK, (c + 1) * CHUNK) of group g (program g * CHUNKS + c): dx per row and
    the partial row sums of the parameters' gradients."""
    pid = tl.program_id(0)
    group = pid // CHUNKS
    first = (pid % CHUNKS) * CHUNK
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    w = load_row(W, 0, cols, inside) if HAS_W else 1.0
    gain = 1.0
    if HAS_SCALE:
        gain += load_row(SCALE, group * stride_sc, cols, inside)
    acc_shift = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_scale = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_w = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, CHUNK):
        r = first + i
        live = inside & (r < ROWS)
        row = (group * ROWS + r).to(tl.int64)
        dy = load_row(DY, row * stride_dy, cols, live)
        x = load_row(X, row * stride_x, cols, live)
        rstd = tl.load(RSTD + row, mask=r < ROWS, other=0.0)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(live, x - tl.sum(x, axis=0) / D, 0.0) * rstd
        dn = dy * gain
        if NEED_SHIFT:
            acc_shift += dy
        if NEED_SCALE:
            n = xhat * w
            if HAS_B:
                n += load_row(B, 0, cols, inside)
            acc_scale += dy * n
        if NEED_W:
            acc_w += dn * xhat
        if NEED_B:
            acc_b += dn
        if NEED_X:
            g = dn * w
            dx = g - xhat * (tl.sum(g * xhat, axis=0) / D)
            if not RMS:
                dx -= tl.sum(g, axis=0) / D
            tl.store(DX + row * stride_dx + cols, (dx * rstd).to(DX.dtype.element_ty), mask=live)
    if NEED_SHIFT:
        tl.store(P_SHIFT + pid * D + cols, acc_shift, mask=inside)
    if NEED_SCALE:
        tl.store(P_SCALE + pid * D + cols, acc_scale, mask=inside)
    if NEED_W:
        tl.store(P_W + pid * D + cols, acc_w, mask=inside)
    if NEED_B:
        tl.store(P_B + pid * D + cols, acc_b, mask=inside)
