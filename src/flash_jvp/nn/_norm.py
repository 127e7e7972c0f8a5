"""LayerNorm / RMSNorm with affine and adaLN modulation: the plain-op path, the fused
Function (one Triton pass for y and its tangent, one for the backward) and the choice
between them. The math is in ``flash_jvp.kernels.norm``'s docstring."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from .. import _plans
from .._function import _Function, eager_only
from .._utils import HAS_TRITON, kernel_dtypes, no_autocast, tangent, uses_kernels
from ._dual import dual_apply, fusable_context, reference_vjp

Tensor = torch.Tensor
MAX_WIDTH = 16384  # widest row one program holds (BLOCK_D); wider rows take the plain ops
TARGET_PROGRAMS = 1024  # backward: programs to aim at (row chunks), enough for 132 SMs


@dataclass(frozen=True)
class NormSpec:
    """What besides the tensors defines a norm call: the kind, eps, the output dtype, and
    how the modulation's rows group: x is (groups, rows, D) with shift/scale (groups, D)."""

    rms: bool
    eps: float
    out_dtype: torch.dtype
    lead: tuple[int, ...]  # x.shape[:k], the dims the modulation varies over

    @property
    def groups(self) -> int:
        return math.prod(self.lead)


def group_dims(x: Tensor, mods: list[Tensor]) -> int | None:
    """k such that every modulation tensor varies only over x's first k dims (its shape
    broadcasts as x.shape[:k] + (1, ...) + (D,)), or None where one does not."""
    k = 0
    lead = x.shape[:-1]
    for m in mods:
        if m.dim() == 0 or m.dim() > x.dim() or m.shape[-1] != x.shape[-1]:
            return None
        shape = (1,) * (x.dim() - m.dim()) + tuple(m.shape[:-1])
        sized = [i for i, n in enumerate(shape) if n != 1]
        if any(shape[i] != lead[i] for i in sized):
            return None
        k = max(k, sized[-1] + 1 if sized else 0)
    return k


def as_groups(m: Tensor | None, lead: tuple[int, ...], ndim: int) -> Tensor | None:
    """A modulation tensor (or its tangent) that broadcasts to an x of ``ndim`` dims and varies
    over x's first dims ``lead`` only (:func:`group_dims`), as (prod(lead), D) rows of unit
    column stride (a view where one exists: the kernels take the row stride)."""
    if m is None:
        return None
    d = m.shape[-1]
    # aligned with x's trailing dims; those between lead and the last are then 1
    m = m.reshape((1,) * (ndim - m.dim()) + tuple(m.shape))
    rows = m.reshape(*m.shape[: len(lead)], d).expand(*lead, d).reshape(math.prod(lead), d)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def unit_stride(t: Tensor | None) -> Tensor | None:
    """A (D,) parameter with unit stride, as the kernels read it (a copy of a strided view)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def row_stride(m: Tensor | None) -> int:
    return 0 if m is None else m.stride(0)


def _from_groups(g: Tensor | None, like: Tensor, spec: NormSpec, ndim: int) -> Tensor | None:
    """Inverse of :func:`as_groups` for a gradient: (groups, D) summed to ``like``'s shape."""
    if g is None:
        return None
    full = g.view(*spec.lead, *(1,) * (ndim - len(spec.lead) - 1), g.shape[-1])
    return full.sum_to_size(like.shape).to(like.dtype)


def reference(x, weight, bias, shift, scale, rms: bool, eps: float, dims: int, out_dtype):
    """The norm in plain differentiable ops, all of it in at least float32 as the kernels
    compute it (any normalized rank, any broadcasting modulation): the fallback, the
    torch.compile path and the reference of the backward through the tangent."""
    work = torch.promote_types(x.dtype, torch.float32)

    def wide(t):
        return t.to(torch.promote_types(t.dtype, work))

    xf = wide(x)
    axes = tuple(range(-dims, 0))
    if not rms:
        xf = xf - xf.mean(axes, keepdim=True)
    y = xf * torch.rsqrt(xf.square().mean(axes, keepdim=True) + eps)
    if weight is not None:
        y = y * wide(weight)
    if bias is not None:
        y = y + wide(bias)
    if scale is not None:
        y = y * (1 + wide(scale))
    if shift is not None:
        y = y + wide(shift)
    return y.to(out_dtype)


def out_dtype(x: Tensor, shift: Tensor | None, scale: Tensor | None) -> torch.dtype:
    """As ``F.layer_norm`` followed by the modulation's ops: x's dtype promoted with the
    modulation's; float32 for fp16 / bf16 / fp32 x under CUDA autocast, which runs
    layer_norm and rms_norm in float32 (CPU autocast and float64 leave the dtype)."""
    dtype = x.dtype
    if (x.device.type == "cuda" and torch.is_autocast_enabled("cuda")
            and dtype in (torch.float16, torch.bfloat16)):  # fmt: skip
        dtype = torch.float32
    for m in (shift, scale):
        if m is not None:
            dtype = torch.promote_types(dtype, m.dtype)
    return dtype


def norm(x, weight, bias, shift, scale, rms: bool, eps: float, dims: int) -> Tensor:
    """The norm of x over its last ``dims`` dims, affine, modulated: the fused Function where
    it applies, else :func:`reference`."""
    dtype = out_dtype(x, shift, scale)
    mods = [m for m in (shift, scale) if m is not None]
    k = group_dims(x, mods) if dims == 1 else None
    if k is None or not _fusable(x, weight, bias, mods, dtype):
        return reference(x, weight, bias, shift, scale, rms, eps, dims, dtype)
    return _fused(x, weight, bias, shift, scale, rms, eps, dims, dtype, k)


@eager_only
def _fused(x, weight, bias, shift, scale, rms: bool, eps: float, dims: int, dtype, k: int):
    """:func:`norm` where the fused Function may run (eager: see ``_function.eager_only``)."""
    spec = NormSpec(rms, float(eps), dtype, tuple(x.shape[:k]))
    tangents = [tangent(x), tangent(shift), tangent(scale)]
    if (tangent(weight) is not None or tangent(bias) is not None
            or any(t is not None and t.dtype != p.dtype
                   for t, p in zip(tangents, (x, shift, scale)))):  # fmt: skip
        return reference(x, weight, bias, shift, scale, rms, eps, dims, dtype)
    return dual_apply(NormFn, [x, weight, bias, shift, scale], tangents, spec)


def _fusable(x: Tensor, weight, bias, mods: list[Tensor], dtype: torch.dtype) -> bool:
    if not (HAS_TRITON and uses_kernels(x.device) and fusable_context()):
        return False
    dtypes = kernel_dtypes(x.device)
    tensors = [t for t in (x, weight, bias, *mods) if t is not None]
    return (
        x.numel() > 0
        and x.shape[-1] <= MAX_WIDTH
        and dtype in dtypes
        and all(t.dtype in dtypes and t.device == x.device for t in tensors)
        and all(t.shape == x.shape[-1:] for t in (weight, bias) if t is not None)
    )


def rows_of(x: Tensor) -> Tensor:
    """x as (N, D) rows with unit column stride (a copy only where the view cannot be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def width_config(d: int) -> tuple[int, int]:
    """BLOCK_D (the next power of two) and num_warps for rows of width d."""
    block = 1 << max(d - 1, 0).bit_length()
    return block, 4 if block <= 1024 else 8 if block <= 4096 else 16


def on_device(x: Tensor) -> contextlib.AbstractContextManager:
    """x's CUDA device current for the launch (Triton launches on the current device)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def fwd(x, x_t, weight, bias, shift, scale, shift_t, scale_t, spec: NormSpec, tangent_out: bool):
    """(y, y_t or None, rstd) from one pass of ``norm_fwd_kernel``."""
    from ..kernels.norm import norm_fwd_kernel

    rows, rows_t = rows_of(x), None if x_t is None else rows_of(x_t)
    weight, bias = unit_stride(weight), unit_stride(bias)
    n, d = rows.shape
    y = _plans.allocate((n, d), x.device, spec.out_dtype)
    y_t = _plans.allocate((n, d), x.device, spec.out_dtype) if tangent_out else None
    rstd = _plans.allocate((n,), x.device, torch.float32)
    mods = [as_groups(m, spec.lead, x.dim()) for m in (shift, scale, shift_t, scale_t)]
    block, warps = width_config(d)
    with on_device(x):
        norm_fwd_kernel[(n,)](
            rows, rows if rows_t is None else rows_t, y, y if y_t is None else y_t, rstd,
            *(rows if t is None else t for t in (weight, bias, *mods)),
            rows.stride(0), 0 if rows_t is None else rows_t.stride(0), y.stride(0),
            y.stride(0), *(row_stride(m) for m in mods), d, n // spec.groups, spec.eps,
            RMS=spec.rms, HAS_W=weight is not None, HAS_B=bias is not None,
            HAS_SHIFT=mods[0] is not None, HAS_SCALE=mods[1] is not None,
            HAS_X_T=rows_t is not None, HAS_SHIFT_T=mods[2] is not None,
            HAS_SCALE_T=mods[3] is not None, TANGENT=tangent_out, BLOCK_D=block,
            num_warps=warps,
        )  # fmt: skip
    shape = (*x.shape[:-1], d)
    return y.view(shape), None if y_t is None else y_t.view(shape), rstd


def bwd(dy, x, rstd, weight, bias, shift, scale, spec: NormSpec, need) -> list:
    """[dx, dweight, dbias, dshift, dscale] (None where ``need`` says no) from one pass of
    ``norm_bwd_kernel`` and sums of its per-program partial rows."""
    from ..kernels.norm import norm_bwd_kernel

    rows, drows = rows_of(x), rows_of(dy)
    weight, bias = unit_stride(weight), unit_stride(bias)
    n, d = rows.shape
    per_group = n // spec.groups
    chunk = max(1, min(per_group, -(-n // TARGET_PROGRAMS)))
    chunks = -(-per_group // chunk)
    programs = spec.groups * chunks
    need_x, need_w, need_b, need_shift, need_scale = need
    dx = _plans.allocate((n, d), x.device, x.dtype) if need_x else None
    partial = {
        name: _plans.allocate((programs, d), x.device, torch.float32) if flag else None
        for name, flag in (("shift", need_shift), ("scale", need_scale), ("w", need_w),
                           ("b", need_b))
    }  # fmt: skip
    mods = [as_groups(m, spec.lead, x.dim()) for m in (shift, scale)]
    block, warps = width_config(d)
    with on_device(x):
        norm_bwd_kernel[(programs,)](
            drows, rows, rstd, rows if dx is None else dx,
            *(rows if t is None else t for t in (weight, bias, *mods)),
            *(rstd if p is None else p for p in partial.values()),
            drows.stride(0), rows.stride(0), d if dx is None else dx.stride(0),
            row_stride(mods[1]), d, per_group, chunks, chunk,
            RMS=spec.rms, HAS_W=weight is not None, HAS_B=bias is not None,
            HAS_SHIFT=mods[0] is not None, HAS_SCALE=mods[1] is not None,
            NEED_X=need_x, NEED_SHIFT=need_shift, NEED_SCALE=need_scale, NEED_W=need_w,
            NEED_B=need_b, BLOCK_D=block, num_warps=warps,
        )  # fmt: skip
    p = partial
    return [
        None if dx is None else dx.view(x.shape),
        None if p["w"] is None else p["w"].sum(0).to(weight.dtype),
        None if p["b"] is None else p["b"].sum(0).to(bias.dtype),
        None
        if p["shift"] is None
        else _from_groups(_group_sum(p["shift"], spec), shift, spec, x.dim()),
        None
        if p["scale"] is None
        else _from_groups(_group_sum(p["scale"], spec), scale, spec, x.dim()),
    ]


def _group_sum(partial: Tensor, spec: NormSpec) -> Tensor:
    return partial.view(spec.groups, -1, partial.shape[-1]).sum(1)


class NormFn(_Function):
    """(y, y_t) = norm(x, weight, bias, shift, scale) and its tangent along (x_t, shift_t,
    scale_t) (y_t None without tangents), fused; the backward through y runs a fused kernel,
    the backward through y_t (and a backward that builds a graph) the plain ops."""

    @staticmethod
    def forward(x, weight, bias, shift, scale, x_t, shift_t, scale_t, spec: NormSpec):
        has_t = any(t is not None for t in (x_t, shift_t, scale_t))
        return fwd(x, x_t, weight, bias, shift, scale, shift_t, scale_t, spec, has_t)

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, spec = inputs
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(output[2])
        ctx.save_for_backward(*tensors, output[2])

    @staticmethod
    def backward(ctx, dy, dy_t, _drstd=None):
        *inputs, rstd = ctx.saved_tensors
        x, weight, bias, shift, scale = inputs[:5]
        need = ctx.needs_input_grad
        if dy_t is not None or torch.is_grad_enabled():
            spec = ctx.spec
            x_t, shift_t, scale_t = inputs[5:]
            with no_autocast(x.device):
                gp, gt = reference_vjp(
                    lambda *a: reference(*a, spec.rms, spec.eps, 1, spec.out_dtype),
                    inputs[:5], [x_t, None, None, shift_t, scale_t], need[:5],
                    (need[5], False, False, need[6], need[7]), dy, dy_t,
                )  # fmt: skip
            return (*gp, gt[0], gt[3], gt[4], None)
        if dy is None:
            return (None,) * 9
        grads = bwd(dy, x, rstd, weight, bias, shift, scale, ctx.spec, need[:5])
        return (*grads, None, None, None, None)
