"""GELU / SiLU: the fused Function (one Triton pass for y and its tangent; the backward
through y is torch's gelu_backward / silu_backward) and the plain-op path."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _plans
from .._function import _Function, eager_only
from .._utils import HAS_TRITON, kernel_dtypes, tangent, uses_kernels
from ._dual import dual_apply, fusable_context, reference_vjp
from ._norm import on_device

Tensor = torch.Tensor
BLOCK = 2048
KINDS = {"gelu": 0, "gelu_tanh": 1, "silu": 2}


def reference(x: Tensor, kind: str) -> Tensor:
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if kind == "gelu_tanh" else "none")


def activation(x: Tensor, kind: str) -> Tensor:
    """``kind`` ("gelu", "gelu_tanh", "silu") of x: the fused Function where it applies
    (kernels on x's device, x's dtype theirs, eager, at most one torch.func.jvp around),
    else :func:`reference`."""
    if not (HAS_TRITON and x.numel() and uses_kernels(x.device) and fusable_context()
            and x.dtype in kernel_dtypes(x.device)):  # fmt: skip
        return reference(x, kind)
    return _fused(x, kind)


@eager_only
def _fused(x: Tensor, kind: str) -> Tensor:
    """:func:`activation` where the fused Function may run (eager: ``_function.eager_only``)."""
    x_t = tangent(x)
    if x_t is not None and x_t.dtype != x.dtype:
        return reference(x, kind)
    return dual_apply(ActivationFn, [x], [x_t], kind)


def fwd(x: Tensor, x_t: Tensor | None, kind: str) -> tuple[Tensor, Tensor | None]:
    from ..kernels.activation import act_fwd_kernel

    flat, flat_t = x.contiguous(), None if x_t is None else x_t.contiguous()
    y = _plans.allocate(x.shape, x.device, x.dtype)
    y_t = None if x_t is None else _plans.allocate(x.shape, x.device, x.dtype)
    n = x.numel()
    with on_device(x):
        act_fwd_kernel[(-(-n // BLOCK),)](
            flat, flat if flat_t is None else flat_t, y, y if y_t is None else y_t, n,
            KIND=KINDS[kind], TANGENT=x_t is not None, BLOCK=BLOCK, num_warps=8,
        )  # fmt: skip
    return y, y_t


class ActivationFn(_Function):
    """(y, y_t) = act(x), act'(x) x_t (y_t None without x_t)."""

    @staticmethod
    def forward(x, x_t, kind: str):
        return fwd(x, x_t, kind)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, x_t, ctx.kind = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, x_t)

    @staticmethod
    def backward(ctx, dy, dy_t):
        x, x_t = ctx.saved_tensors
        need = ctx.needs_input_grad
        if dy_t is not None or torch.is_grad_enabled():
            gp, gt = reference_vjp(lambda x: reference(x, ctx.kind), [x], [x_t], need[:1],
                                   need[1:2], dy, dy_t)  # fmt: skip
            return gp[0], gt[0], None
        if dy is None or not need[0]:
            return None, None, None
        if ctx.kind == "silu":
            return torch.ops.aten.silu_backward(dy, x), None, None
        approximate = "tanh" if ctx.kind == "gelu_tanh" else "none"
        return torch.ops.aten.gelu_backward(dy, x, approximate=approximate), None, None
