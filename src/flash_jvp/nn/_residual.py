"""Gated residual ``x + gate * y``: the fused Function (one Triton pass for out and its
tangent; the backward in plain elementwise ops, exact to any order) and the plain-op path."""

from __future__ import annotations

import torch

from .. import _plans
from .._function import _Function, eager_only
from .._utils import HAS_TRITON, kernel_dtypes, tangent, uses_kernels
from ._dual import dual_apply, fusable_context
from ._norm import (
    MAX_WIDTH,
    as_groups,
    group_dims,
    on_device,
    row_stride,
    rows_of,
    width_config,
)

Tensor = torch.Tensor


def gated_residual(x: Tensor, gate: Tensor, y: Tensor) -> Tensor:
    """x + gate * y: fused where x and y are rows of one shape, gate varies over x's leading
    dims only (e.g. (B, 1, D) for x (B, L, D)) and the kernels apply; else plain ops."""
    k = group_dims(x, [gate]) if x.shape == y.shape and x.dim() >= 1 else None
    dtype = torch.promote_types(torch.promote_types(x.dtype, gate.dtype), y.dtype)
    tensors = (x, gate, y)
    if (k is None or not HAS_TRITON or not x.numel() or x.shape[-1] > MAX_WIDTH
            or not uses_kernels(x.device) or not fusable_context()
            or any(t.dtype not in kernel_dtypes(x.device) or t.device != x.device
                   for t in tensors)):  # fmt: skip
        return reference(x, gate, y, dtype)
    return _fused(x, gate, y, k, dtype)


@eager_only
def _fused(x: Tensor, gate: Tensor, y: Tensor, k: int, dtype: torch.dtype) -> Tensor:
    """:func:`gated_residual` where the fused Function may run (eager: see
    ``_function.eager_only``)."""
    tensors = (x, gate, y)
    tangents = [tangent(t) for t in tensors]
    if any(t is not None and t.dtype != p.dtype for t, p in zip(tangents, tensors)):
        return reference(x, gate, y, dtype)
    return dual_apply(GatedResidualFn, list(tensors), tangents, tuple(x.shape[:k]), dtype)


def reference(x: Tensor, gate: Tensor, y: Tensor, dtype: torch.dtype) -> Tensor:
    """x + gate * y in plain ops, in the result's dtype throughout (as the kernel computes
    it, in float32 for a float32 residual stream with bf16 gate and update)."""
    return x.to(dtype) + gate.to(dtype) * y.to(dtype)


def fwd(x, gate, y, x_t, gate_t, y_t, lead, dtype, tangent_out: bool):
    """(out, out_t or None) from one pass of ``gated_residual_kernel``."""
    from ..kernels.residual import gated_residual_kernel

    rows, rows_y = rows_of(x), rows_of(y)
    rows_xt, rows_yt = (None if t is None else rows_of(t) for t in (x_t, y_t))
    g, g_t = as_groups(gate, lead, x.dim()), as_groups(gate_t, lead, x.dim())
    n, d = rows.shape
    out = _plans.allocate((n, d), x.device, dtype)
    out_t = _plans.allocate((n, d), x.device, dtype) if tangent_out else None
    block, warps = width_config(d)
    with on_device(x):
        gated_residual_kernel[(n,)](
            rows, g, rows_y, *(rows if t is None else t for t in (rows_xt, g_t, rows_yt)),
            out, out if out_t is None else out_t,
            rows.stride(0), g.stride(0), rows_y.stride(0),
            *(row_stride(t) for t in (rows_xt, g_t, rows_yt)), d, d, d, n // g.shape[0],
            HAS_X_T=rows_xt is not None, HAS_G_T=g_t is not None, HAS_Y_T=rows_yt is not None,
            TANGENT=tangent_out, BLOCK_D=block, num_warps=warps,
        )  # fmt: skip
    return out.view(x.shape), None if out_t is None else out_t.view(x.shape)


class GatedResidualFn(_Function):
    """(out, out_t) = x + gate * y and x_t + gate_t * y + gate * y_t (out_t None without
    tangents)."""

    @staticmethod
    def forward(x, gate, y, x_t, gate_t, y_t, lead, dtype):
        has_t = any(t is not None for t in (x_t, gate_t, y_t))
        return fwd(x, gate, y, x_t, gate_t, y_t, lead, dtype, has_t)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, gate, y, _, gate_t, y_t = inputs[:6]
        ctx.set_materialize_grads(False)
        ctx.x_dtype = x.dtype  # x and x_t enter linearly: only their dtype is needed
        ctx.save_for_backward(gate, y, gate_t, y_t)

    @staticmethod
    def backward(ctx, dout, dout_t):
        gate, y, gate_t, y_t = ctx.saved_tensors
        need = ctx.needs_input_grad

        def sum_to(t, like):
            return None if t is None else t.sum_to_size(like.shape).to(like.dtype)

        def add(a, b):
            return b if a is None else a if b is None else a + b

        def prod(a, b):
            return None if a is None or b is None else a * b

        # out = x + gate y; out_t = x_t + gate_t y + gate y_t (terms without a cotangent
        # or a tangent are None and drop out)
        dx, dx_t = (None if g is None or not n else g.to(ctx.x_dtype)
                    for g, n in ((dout, need[0]), (dout_t, need[3])))  # fmt: skip
        dgate = add(prod(dout, y), prod(dout_t, y_t)) if need[1] else None
        dy = add(prod(dout, gate), prod(dout_t, gate_t)) if need[2] else None
        dgate_t = prod(dout_t, y) if need[4] else None
        dy_t = prod(dout_t, gate) if need[5] else None
        grads = (dgate, dy, dgate_t, dy_t)
        dgate, dy, dgate_t, dy_t = (sum_to(g, t) for g, t in zip(grads, (gate, y, gate, y)))
        return dx, dgate, dy, dx_t, dgate_t, dy_t, None, None
