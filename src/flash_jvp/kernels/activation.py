"""GELU (exact and tanh) and SiLU with their forward-mode tangent in one elementwise pass.

y = act(x), y_t = act'(x) * x_t, in float32:

    GELU (exact): act(x) = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)),
                  act'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
    GELU (tanh):  u = sqrt(2 / pi) (x + 0.044715 x^3), act(x) = 0.5 x (1 + tanh u),
                  act'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u'(x)
    SiLU:         act(x) = x sigmoid(x), act'(x) = sigmoid(x) (1 + x (1 - sigmoid(x)))

(Hendrycks & Gimpel 2016; Elfwing et al. 2018.) The backward through y is torch's own
gelu_backward / silu_backward.
"""

import triton
import triton.language as tl

GELU, GELU_TANH, SILU = 0, 1, 2
SQRT_HALF = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_C = tl.constexpr(0.044715)


@triton.jit
def act_fwd_kernel(X, X_T, Y, Y_T, n, KIND: tl.constexpr, TANGENT: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    """BLOCK elements per program of the flat (contiguous) x: y and, with TANGENT, y_t."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(X + offs, mask=inside, other=0.0).to(tl.float32)
    if KIND == 0:
        cdf = 0.5 * (1.0 + tl.math.erf(x * SQRT_HALF))
        y = x * cdf
        slope = cdf + x * INV_SQRT_2PI * tl.exp(-0.5 * x * x)
    elif KIND == 1:
        u = SQRT_2_OVER_PI * (x + GELU_C * x * x * x)
        e = tl.exp(-2.0 * tl.abs(u))  # tanh(u) = sign(u) (1 - e) / (1 + e), never overflowing
        th = tl.where(u < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
        y = 0.5 * x * (1.0 + th)
        slope = 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * SQRT_2_OVER_PI * (
            1.0 + 3.0 * GELU_C * x * x
        )
    else:
        sig = 1.0 / (1.0 + tl.exp(-x))
        y = x * sig
        slope = sig * (1.0 + x * (1.0 - sig))
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=inside)
    if TANGENT:
        x_t = tl.load(X_T + offs, mask=inside, other=0.0).to(tl.float32)
        tl.store(Y_T + offs, (slope * x_t).to(Y_T.dtype.element_ty), mask=inside)
