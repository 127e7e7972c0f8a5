"""Linear: y = x W^T + b and its tangent y_t = x_t W^T (no tangent on W or b) as one
Function, so forward AD costs one more GEMM and no per-op bookkeeping.

Under ``torch.func.jvp`` with bf16 autocast a plain ``F.linear`` costs ~1 ms of host time a
call (functorch runs its JVP through Python decompositions; benchmarks/step_profile.py --host,
H200): in an eager DiT step that, not the GPU, set the pace. Here the casts autocast would do
are done once in the forward (W, b, x and x_t to autocast's dtype) and the casts are what the
backward keeps, as autocast's own cast nodes would.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._function import _Function, eager_only
from .._utils import tangent
from ._dual import dual_apply, fusable_context, reference_vjp

Tensor = torch.Tensor
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype F.linear computes in: autocast's where it is on, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear; under forward AD (tangent on x only) through :class:`LinearFn`."""
    tensors = [t for t in (x, weight, bias) if t is not None]
    if not fusable_context() or not all(isinstance(t, Tensor) for t in tensors):
        return F.linear(x, weight, bias)  # torch's path (and its errors)
    return _fused(x, weight, bias, tensors)


@eager_only
def _fused(x: Tensor, weight: Tensor, bias: Tensor | None, tensors: list[Tensor]) -> Tensor:
    """:func:`linear` where the fused Function may run (eager: see ``_function.eager_only``)."""
    x_t = tangent(x)
    if x_t is None and not torch._C._functorch.peek_interpreter_stack():
        return F.linear(x, weight, bias)
    dtype = compute_dtype(x)
    if (tangent(weight) is not None or tangent(bias) is not None or weight.dim() != 2
            or any(t.dtype not in DTYPES or t.device != x.device for t in tensors)
            or (x_t is not None and x_t.dtype != x.dtype)
            or (not torch.is_autocast_enabled(x.device.type)
                and any(t.dtype != x.dtype for t in tensors))):  # fmt: skip
        return F.linear(x, weight, bias)  # torch's path (and its errors)
    return dual_apply(LinearFn, [x, weight, bias], [x_t], dtype)


def _cast(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """t in dtype, or None where t is None or already in it (the input itself is saved)."""
    return None if t is None or t.dtype == dtype else t.to(dtype)


def _or(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return b if a is None else a


def _rows(t: Tensor) -> Tensor:
    """t as (rows, features), also where either is 0 (reshape(-1, 0) is ambiguous)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


class LinearFn(_Function):
    """(y, y_t, casts...) = x W^T + b, x_t W^T (y_t None without x_t), computed in
    ``dtype``; the casts of x, x_t, W made for it (None where none was needed) are outputs
    so the backward can keep them."""

    @staticmethod
    def forward(x, weight, bias, x_t, dtype: torch.dtype):
        casts = [_cast(t, dtype) for t in (x, x_t, weight, bias)]
        x_c, x_t_c, w_c, b_c = (_or(c, t) for c, t in zip(casts, (x, x_t, weight, bias)))
        y = F.linear(x_c, w_c, b_c)
        y_t = None if x_t is None else F.linear(x_t_c, w_c)
        return y, y_t, *casts[:3]

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, x_t, ctx.dtype = inputs
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(t for t in output[2:] if t is not None))
        x_c, x_t_c, w_c = (_or(c, t) for c, t in zip(output[2:], (x, x_t, weight)))
        ctx.save_for_backward(x, weight, bias, x_t, x_c, x_t_c, w_c)

    @staticmethod
    def backward(ctx, dy, dy_t, *_):
        x, weight, bias, x_t, x_c, x_t_c, w_c = ctx.saved_tensors
        need = ctx.needs_input_grad
        dtype = ctx.dtype
        if torch.is_grad_enabled():  # a backward that builds a graph: plain ops
            gp, gt = reference_vjp(
                lambda *a: F.linear(*(None if t is None else t.to(dtype) for t in a)),
                [x, weight, bias], [x_t, None, None], need[:3], (need[3], False, False), dy, dy_t,
            )  # fmt: skip
            return gp[0], gp[1], gp[2], gt[0], None
        dy, dy_t = (_or(_cast(g, dtype), g) for g in (dy, dy_t))
        dx = dy @ w_c if need[0] and dy is not None else None
        dx_t = dy_t @ w_c if need[3] and dy_t is not None else None
        dw = db = None
        if need[1]:
            pairs = [(g, a) for g, a in ((dy, x_c), (dy_t, x_t_c)) if g is not None]
            for g, a in pairs:
                part = _rows(g).T @ _rows(a)
                dw = part if dw is None else dw + part
        if need[2] and dy is not None:
            db = _rows(dy).sum(0)
        grads = (dx, dw, db, dx_t)
        like = (x, weight, bias, x)
        return (*(g if g is None else _or(_cast(g, t.dtype), g) for g, t in zip(grads, like)), None)
