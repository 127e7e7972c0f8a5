"""Input checks with SDPA-style messages, run before anything is launched.

``problems`` lists every reason a call cannot run (as (exception type, message) pairs);
``check`` raises the first one; ``flash_jvp.supports`` returns the messages.
"""

from __future__ import annotations

import numbers

import torch

from ._utils import HAS_TRITON, MAX_HEAD_DIM, kernel_dtypes

Problem = tuple[type[Exception], str]
FP32_MAX = torch.finfo(torch.float32).max


def _desc(name: str, t: torch.Tensor) -> str:
    return f"{name} of shape {tuple(t.shape)}, dtype {t.dtype} on {t.device}"


def _tensor_problems(query, key, value) -> list[Problem]:
    out: list[Problem] = []
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            out.append((TypeError, f"Expected {name} to be a torch.Tensor, but got {type(t)}."))
        elif t.dim() < 3:
            out.append(
                (
                    ValueError,
                    f"Expected {name} to have at least 3 dimensions (..., heads, length, "
                    f"head_dim), but got {_desc(name, t)}.",
                )
            )
    return out


def _layout_problems(q, k, v, enable_gqa: bool) -> list[Problem]:
    out: list[Problem] = []
    if not q.dtype.is_floating_point:
        out.append((TypeError, f"Expected a floating-point query, but got {_desc('query', q)}."))
    if not (q.dtype == k.dtype == v.dtype):
        out.append(
            (
                ValueError,
                "Expected query, key, and value to have the same dtype, but got "
                f"query.dtype: {q.dtype}, key.dtype: {k.dtype}, value.dtype: {v.dtype}.",
            )
        )
    if not (q.device == k.device == v.device):
        out.append(
            (
                ValueError,
                "Expected query, key, and value to be on the same device, but got "
                f"query.device: {q.device}, key.device: {k.device}, value.device: {v.device}.",
            )
        )
    if not (q.dim() == k.dim() == v.dim()) or not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3]):
        out.append(
            (
                ValueError,
                "Expected query, key, and value to have the same batch dimensions (all but the "
                f"last three), but got query {tuple(q.shape)}, key {tuple(k.shape)}, value "
                f"{tuple(v.shape)}. Broadcast with .expand() (no copy is made).",
            )
        )
        return out
    if k.shape[-3] != v.shape[-3] or k.shape[-2] != v.shape[-2]:
        out.append(
            (
                ValueError,
                "Expected key and value to have the same number of heads and length, but got "
                f"key {tuple(k.shape)} and value {tuple(v.shape)}.",
            )
        )
    if q.shape[-1] == 0:
        out.append((ValueError, f"Expected a head_dim >= 1, but got {_desc('query', q)}."))
    if q.shape[-1] != k.shape[-1]:
        out.append(
            (
                ValueError,
                "Expected query and key to have the same head_dim (last dimension), but got "
                f"query {tuple(q.shape)} and key {tuple(k.shape)}.",
            )
        )
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq != hkv:
        if not enable_gqa:
            out.append(
                (
                    ValueError,
                    f"Expected query and key/value to have the same number of heads (query has "
                    f"{hq}, key/value {hkv}); pass enable_gqa=True for grouped-query attention.",
                )
            )
        elif hkv == 0 or hq % hkv != 0:
            out.append(
                (
                    ValueError,
                    f"With enable_gqa=True the number of query heads ({hq}) must be a multiple of "
                    f"the number of key/value heads ({hkv}).",
                )
            )
    if k.shape[-2] == 0:
        out.append((ValueError, f"Expected key to have length >= 1, but got {_desc('key', k)}."))
    return out


def _kernel_problems(q, k, v) -> list[Problem]:
    """What the Triton kernels (not the CPU fallback) cannot do."""
    out: list[Problem] = []
    if not HAS_TRITON:
        out.append((ImportError, f"flash_jvp needs the triton package for {q.device} tensors."))
    dtypes = kernel_dtypes(q.device)
    if q.dtype.is_floating_point and q.dtype not in dtypes:
        where = "Triton's CPU interpreter" if q.device.type == "cpu" else "the Triton kernels"
        out.append(
            (
                NotImplementedError,
                f"flash_jvp: {_desc('query', q)} is not supported by {where}; supported dtypes "
                f"are {', '.join(str(d) for d in dtypes)}.",
            )
        )
    for name, e in (("query/key head_dim", q.shape[-1]), ("value head_dim", v.shape[-1])):
        if not 1 <= e <= MAX_HEAD_DIM:
            out.append(
                (
                    NotImplementedError,
                    f"flash_jvp: {name} {e} is not supported; supported head dims are 1 to "
                    f"{MAX_HEAD_DIM} (query {tuple(q.shape)}, value {tuple(v.shape)}).",
                )
            )
    return out


def _argument_problems(attn_mask, dropout_p, is_causal, scale, enable_gqa) -> list[Problem]:
    out: list[Problem] = []
    if attn_mask is not None:
        out.append(
            (
                NotImplementedError,
                "flash_jvp: attn_mask is not supported yet (got a mask of shape "
                f"{tuple(getattr(attn_mask, 'shape', ()))}); use is_causal=True for causal "
                "masking, or torch's scaled_dot_product_attention for other masks.",
            )
        )
    if not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p <= 1.0:
        out.append((ValueError, f"Expected dropout_p in [0, 1], but got {dropout_p!r}."))
    elif dropout_p > 0.0:
        out.append(
            (
                NotImplementedError,
                f"flash_jvp: dropout_p={dropout_p} is not supported; only dropout_p=0.0 is.",
            )
        )
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            out.append((TypeError, f"Expected {name} to be a bool, but got {flag!r}."))
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            out.append(
                (TypeError, f"Expected scale to be None or a real number, but got {scale!r}.")
            )
        elif not abs(scale) <= FP32_MAX:  # also catches NaN; ints beyond float range too
            out.append(
                (
                    ValueError,
                    f"Expected a finite scale within float32 range, but got {repr(scale)[:32]}.",
                )
            )
    return out


def problems(
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, kernels: bool
) -> list[Problem]:
    """Every reason this call cannot run, as (exception type, message); [] if it can.

    ``kernels``: the call would run the Triton kernels (not the PyTorch fallback).
    """
    out = _argument_problems(attn_mask, dropout_p, is_causal, scale, enable_gqa)
    tensor_problems = _tensor_problems(query, key, value)
    if tensor_problems:
        return out + tensor_problems
    out += _layout_problems(query, key, value, enable_gqa)
    if kernels:
        out += _kernel_problems(query, key, value)
    return out


def check(*args, **kwargs) -> None:
    """Raise the first problem of :func:`problems`, if any."""
    found = problems(*args, **kwargs)
    if found:
        exc_type, message = found[0]
        raise exc_type(message)
