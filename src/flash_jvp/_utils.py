"""Small shared helpers: where the Triton kernels run, and which dtypes they take."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass

import torch
from torch._C._functorch import is_batchedtensor

# Triton reads TRITON_INTERPRET when kernels are defined, so this is fixed at import too.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None

# dtypes the kernels take; the interpreter computes bfloat16 wrongly, so it only gets fp16/fp32.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRETER_DTYPES = (torch.float16, torch.float32)
MAX_HEAD_DIM = 256
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension: batch * heads in the kernels


def uses_kernels(device: torch.device) -> bool:
    """True when tensors on `device` go through the Triton kernels.

    CUDA tensors always do. CPU tensors do only under ``TRITON_INTERPRET=1``; otherwise
    :func:`flash_jvp.attention` takes the pure-PyTorch reference path.
    """
    if device.type == "cuda":
        return True
    return device.type == "cpu" and INTERPRET and HAS_TRITON


def tangent(x, name: str | None = None) -> torch.Tensor | None:
    """x's forward-mode tangent at dual level 0 (``forward_ad``'s, and a ``torch.func.jvp``'s
    once its wrappers are taken off); None where x is no tensor, has no tangent or a symbolic
    zero, or is vmapped (a batched tensor's tangent cannot be unpacked here: it reaches the
    Function's ``jvp`` instead).

    With ``name`` (the argument's name in the public API), a tangent of another dtype than x's
    raises ``ValueError`` naming it: torch's make_dual pairs any floating dtypes, while the
    kernels and the fallback compute a tangent in its primal's dtype.
    """
    if not isinstance(x, torch.Tensor) or is_batchedtensor(x):
        return None
    t = torch._unpack_dual(x, 0)[1]
    if t is None or t._is_zerotensor():
        return None
    if name is not None and t.dtype != x.dtype:
        raise ValueError(
            f"Expected the forward-mode tangent of {name} to have its dtype {x.dtype}, but got "
            f"{t.dtype}."
        )
    return t


def no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off for ``device`` (where autocast exists), so the float32 internals of the
    plain-PyTorch paths stay float32; their inputs were cast as autocast casts SDPA's."""
    if device.type in ("cuda", "cpu"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def kernel_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    return INTERPRETER_DTYPES if device.type == "cpu" else KERNEL_DTYPES


@dataclass(frozen=True)
class Spec:
    """Everything but q, k, v (and the mask) that defines one attention call.

    causal_offset: None (no causal mask), or query row i sees keys j <= i + causal_offset
    (0: SDPA's top-left ``is_causal``; Lk - Lq: ``causal_lower_right``). Packed batches give
    ``cu_seqlens_q/k`` (int32, (n + 1,)) and the longest lengths; q/k/v are then
    (total, H, E) and every sequence is its own batch entry.
    """

    scale: float
    causal_offset: int | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None


def tangent_bwd_runs(q_t, k_t, v_t, mask_t, do_t, dmu) -> bool:
    """Whether the backward runs through the tangent: the forward had a tangent and o_t or mu
    (lse's tangent) has a cotangent."""
    has_tangent = any(t is not None for t in (q_t, k_t, v_t, mask_t))
    return has_tangent and (do_t is not None or dmu is not None)


def tangent_bwd_outputs(
    q_t, k_t, v_t, mask_t, do_t, dmu, mask_grad, mask_t_grad, tangent_grads
) -> tuple[bool, ...]:
    """Which of (dq, dk, dv, dq_t, dk_t, dv_t, dmask, dmask_t) the tangent backward gives
    (``_ops.attn_bwd_tangent`` allocates by it, the op's fake and callers read it)."""
    grad_t = tangent_grads and tangent_bwd_runs(q_t, k_t, v_t, mask_t, do_t, dmu)
    return (True, True, True, *(grad_t and t is not None for t in (q_t, k_t, v_t)), mask_grad,
            mask_t_grad)  # fmt: skip
