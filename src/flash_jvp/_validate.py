"""Input checks with SDPA-style messages, run before anything is launched.

``problems`` lists every reason a call cannot run (as (exception type, message) pairs);
``check`` raises the first one; ``flash_jvp.supports`` returns the messages.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch.nn.attention.bias import CausalBias

from ._utils import HAS_TRITON, MAX_GRID_Y, MAX_HEAD_DIM, kernel_dtypes, tangent

Problem = tuple[type[Exception], str]
FP32_MAX = torch.finfo(torch.float32).max


class MaskWithCausalError(ValueError, RuntimeError):
    """attn_mask and is_causal=True together: a ValueError, and the RuntimeError SDPA raises."""


def _desc(name: str, t: torch.Tensor) -> str:
    return f"{name} of shape {tuple(t.shape)}, dtype {t.dtype} on {t.device}"


def _tensor_problems(query, key, value) -> list[Problem]:
    out: list[Problem] = []
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            out.append((TypeError, f"Expected {name} to be a torch.Tensor, but got {type(t)}."))
        elif t.is_nested:
            out.append(
                (
                    TypeError,
                    f"flash_jvp.attention does not take nested (jagged) tensors ({name}); for "
                    "sequences of different lengths use flash_jvp.varlen_attention with "
                    "nt.values() and nt.offsets().int() as cu_seqlens.",
                )
            )
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
    qs, ks, vs = q.shape, k.shape, v.shape  # each .shape builds a torch.Size: host time
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
    if not (len(qs) == len(ks) == len(vs)) or not (qs[:-3] == ks[:-3] == vs[:-3]):
        out.append(
            (
                ValueError,
                "Expected query, key, and value to have the same batch dimensions (all but the "
                f"last three), but got query {tuple(qs)}, key {tuple(ks)}, value "
                f"{tuple(vs)}. Broadcast with .expand() (no copy is made).",
            )
        )
        return out
    if ks[-3] != vs[-3] or ks[-2] != vs[-2]:
        out.append(
            (
                ValueError,
                "Expected key and value to have the same number of heads and length, but got "
                f"key {tuple(ks)} and value {tuple(vs)}.",
            )
        )
    if qs[-1] == 0:
        out.append((ValueError, f"Expected a head_dim >= 1, but got {_desc('query', q)}."))
    if qs[-1] != ks[-1]:
        out.append(
            (
                ValueError,
                "Expected query and key to have the same head_dim (last dimension), but got "
                f"query {tuple(qs)} and key {tuple(ks)}.",
            )
        )
    hq, hkv = qs[-3], ks[-3]
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
    if ks[-2] == 0:
        out.append((ValueError, f"Expected key to have length >= 1, but got {_desc('key', k)}."))
    return out


def _kernel_problems(q, k, v, names=("query", "key", "value")) -> list[Problem]:
    """What the Triton kernels (not the CPU fallback) cannot do. ``names``: what the caller
    calls q, k, v (varlen_attention: q, k, v of shape (total, H, E), whose batch * heads the
    launcher checks)."""
    out: list[Problem] = []
    if not HAS_TRITON:
        out.append((ImportError, f"flash_jvp needs the triton package for {q.device} tensors."))
    dtypes = kernel_dtypes(q.device)
    if q.dtype.is_floating_point and q.dtype not in dtypes:
        where = "Triton's CPU interpreter" if q.device.type == "cpu" else "the Triton kernels"
        out.append(
            (
                NotImplementedError,
                f"flash_jvp: {_desc(names[0], q)} is not supported by {where}; supported dtypes "
                f"are {', '.join(str(d) for d in dtypes)}.",
            )
        )
    qs = q.shape
    for which, e in ((f"{names[0]}/{names[1]}", qs[-1]), (names[2], v.shape[-1])):
        if not 1 <= e <= MAX_HEAD_DIM:
            out.append(
                (
                    NotImplementedError,
                    f"flash_jvp: {which} head_dim {e} is not supported; supported head dims "
                    f"are 1 to {MAX_HEAD_DIM} ({names[0]} {tuple(qs)}, {names[2]} "
                    f"{tuple(v.shape)}).",
                )
            )
    batch_heads = math.prod(qs[:-2])
    if names[0] == "query" and batch_heads > MAX_GRID_Y:
        out.append(
            (
                NotImplementedError,
                f"flash_jvp: batch * heads = {batch_heads} (query {tuple(q.shape)}) is more than "
                f"this version launches ({MAX_GRID_Y}, CUDA's grid limit); split the batch.",
            )
        )
    return out


def _mask_problems(q, k, attn_mask, is_causal) -> list[Problem]:
    """attn_mask: a CausalBias of the right lengths, or a bool/float tensor that broadcasts
    to the scores (..., Hq, Lq, Lk)."""
    lq, lk = q.shape[-2], k.shape[-2]
    if isinstance(attn_mask, CausalBias):
        if is_causal:
            return [(ValueError, "CausalBias should not be used with causal=True")]
        if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (lq, lk):
            return [
                (
                    ValueError,
                    f"Expected a CausalBias for query length {lq} and key length {lk}, but got "
                    f"one for {attn_mask.seq_len_q} and {attn_mask.seq_len_kv}.",
                )
            ]
        return []
    if not isinstance(attn_mask, torch.Tensor):
        got = type(attn_mask)
        return [(TypeError, f"Expected attn_mask to be None or a Tensor, but got {got}.")]
    if attn_mask.layout != torch.strided or attn_mask.is_nested:
        return [
            (
                TypeError,
                f"Expected a dense (strided) attn_mask, but got layout {attn_mask.layout}"
                f"{' (nested)' if attn_mask.is_nested else ''}; pass attn_mask.to_dense().",
            )
        ]
    out: list[Problem] = []
    if is_causal:
        out.append(
            (
                MaskWithCausalError,
                "_scaled_dot_product_attention: Explicit attn_mask should not be set when "
                "is_causal=True",
            )
        )
    if attn_mask.dtype not in (torch.bool, torch.float32, q.dtype):
        out.append(
            (
                TypeError,
                "Expected attn_mask dtype to be bool, torch.float32 or the query's dtype, but "
                f"got attn_mask.dtype: {attn_mask.dtype} and query.dtype: {q.dtype}.",
            )
        )
    if attn_mask.device != q.device:
        out.append(
            (
                ValueError,
                f"Expected attn_mask on the device of query ({q.device}), but got "
                f"{_desc('attn_mask', attn_mask)}.",
            )
        )
    scores = (*q.shape[:-1], lk)
    try:
        broadcasts = torch.broadcast_shapes(attn_mask.shape, scores) == scores
    except RuntimeError:
        broadcasts = False
    if not broadcasts:
        out.append(
            (
                ValueError,
                f"Expected attn_mask to broadcast to the attention scores {scores} "
                "(..., heads, query length, key length), but got "
                f"{_desc('attn_mask', attn_mask)}.",
            )
        )
    return out


MAX_MASK_SPAN = 2**31  # the kernels index an attn_mask with 32-bit offsets per (batch, head)


def mask_span(attn_mask: torch.Tensor, lq: int, lk: int) -> int:
    """Elements between the first and last entry of ``attn_mask`` that one (batch, head) of
    the (lq, lk) scores reads, as the kernels index it: through the mask's strides, or of a
    contiguous copy where a mask with several leading dims of size > 1 cannot be viewed as
    4-D (flash_jvp.api._mask_4d)."""
    shape = (1,) * (2 - attn_mask.dim()) + tuple(attn_mask.shape[-2:])
    strides = (0,) * (2 - attn_mask.dim()) + tuple(attn_mask.stride()[-2:])
    rows, cols = (lq if shape[0] > 1 else 1), (lk if shape[1] > 1 else 1)  # size 1 broadcasts
    span = (rows - 1) * abs(strides[0]) + (cols - 1) * abs(strides[1])
    if sum(n > 1 for n in attn_mask.shape[:-3]) > 1:
        span = max(span, rows * cols - 1)
    return span


def _mask_span_problems(q, k, attn_mask) -> list[Problem]:
    span = mask_span(attn_mask, q.shape[-2], k.shape[-2])
    if span < MAX_MASK_SPAN:
        return []
    return [
        (
            NotImplementedError,
            f"flash_jvp: an attn_mask spanning {span} elements within one (batch, head) of the "
            f"scores is not supported (the kernels index masks with 32-bit offsets, up to "
            f"{MAX_MASK_SPAN - 1}); got {_desc('attn_mask', attn_mask)} and strides "
            f"{attn_mask.stride()} for query {tuple(q.shape)}, key {tuple(k.shape)}.",
        )
    ]


def _argument_problems(dropout_p, is_causal, scale, enable_gqa) -> list[Problem]:
    out: list[Problem] = []
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
    out = _argument_problems(dropout_p, is_causal, scale, enable_gqa)
    tensor_problems = _tensor_problems(query, key, value)
    if tensor_problems:
        return out + tensor_problems
    out += _layout_problems(query, key, value, enable_gqa)
    if attn_mask is not None:
        out += _mask_problems(query, key, attn_mask, is_causal)
    if kernels:
        out += _kernel_problems(query, key, value)
        if isinstance(attn_mask, torch.Tensor) and not isinstance(attn_mask, CausalBias):
            out += _mask_span_problems(query, key, attn_mask)
    return out


def check(*args, **kwargs) -> None:
    """Raise the first problem of :func:`problems`, if any."""
    found = problems(*args, **kwargs)
    if found:
        exc_type, message = found[0]
        raise exc_type(message)


def _cu_seqlens_type_problems(name: str, cu, device) -> list[Problem]:
    if not isinstance(cu, torch.Tensor):
        return [(TypeError, f"Expected {name} to be an int32 tensor, but got {type(cu)}.")]
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        return [
            (
                TypeError if cu.dtype != torch.int32 else ValueError,
                f"Expected {name} to be a 1-D int32 tensor of n + 1 cumulative lengths, but got "
                f"{_desc(name, cu)}.",
            )
        ]
    if cu.device != device:
        return [(ValueError, f"Expected {name} on {device}, but got {_desc(name, cu)}.")]
    return []


def _may_read_back(device: torch.device) -> bool:
    """Whether cu_seqlens may be copied to the host to check their values: not while
    torch.compile traces (no data there) or a CUDA graph captures (a sync would break it)."""
    if torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _is_int(n) -> bool:
    return isinstance(n, (numbers.Integral, torch.SymInt)) and not isinstance(n, bool)


def _max_seqlen_type_problems(*max_lens) -> list[Problem]:
    return [
        (TypeError, f"Expected {name} to be an int, but got {n!r}.")
        for name, n in zip(("max_seqlen_q", "max_seqlen_k"), max_lens)
        if not _is_int(n)
    ]


def _cu_seqlens_value_problems(name: str, values: list[int], total: int, max_name, max_len):
    lengths = [b - a for a, b in zip(values, values[1:])]
    if values[0] != 0 or any(n < 0 for n in lengths) or values[-1] != total:
        shown = f"{values[:8]}{' ...' if len(values) > 8 else ''} (last {values[-1]})"
        return [
            (
                ValueError,
                f"Expected {name} to start at 0, never decrease and end at the number of "
                f"packed tokens ({total}), but got {shown}.",
            )
        ]
    if not _is_int(max_len):
        return [(TypeError, f"Expected {max_name} to be an int, but got {max_len!r}.")]
    longest = max(lengths, default=0)
    if max_len < longest:
        return [
            (
                ValueError,
                f"Expected {max_name} >= the longest sequence ({longest}), but got {max_len}.",
            )  # fmt: skip
        ]
    return []


def _packed_layout_problems(q, k, v) -> list[Problem]:
    """dtypes, devices, heads and head dims of packed (total, H, E) q, k, v."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    rules = (
        (not q.dtype.is_floating_point, TypeError,
         f"Expected a floating-point q, but got {_desc('q', q)}."),
        (not q.dtype == k.dtype == v.dtype, ValueError,
         "Expected q, k, and v to have the same dtype, but got "
         f"q.dtype: {q.dtype}, k.dtype: {k.dtype}, v.dtype: {v.dtype}."),
        (not q.device == k.device == v.device, ValueError,
         "Expected q, k, and v to be on the same device, but got "
         f"q.device: {q.device}, k.device: {k.device}, v.device: {v.device}."),
        (k.shape[:2] != v.shape[:2], ValueError,
         f"Expected k and v to have the same number of tokens and heads, but got {shapes}."),
        (q.shape[-1] == 0 or q.shape[-1] != k.shape[-1], ValueError,
         f"Expected q and k to have the same head_dim >= 1 (last dimension), but got {shapes}."),
        (k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0, ValueError,
         "Expected q's number of heads to be a multiple of k's and v's (grouped-query "
         f"attention), but got {shapes}."),
    )  # fmt: skip
    return [(exc, message) for bad, exc, message in rules if bad]


def varlen_problems(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    is_causal,
    scale,
    kernels,
    return_lse=False,
) -> list[Problem]:
    """Every reason a :func:`flash_jvp.varlen_attention` call cannot run."""
    out = _argument_problems(0.0, is_causal, scale, False)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.is_nested:
            return out + [
                (
                    TypeError,
                    f"flash_jvp.varlen_attention takes packed tensors, not nested ones ({name}); "
                    "pass nt.values() and nt.offsets().int() as cu_seqlens.",
                )
            ]
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            got = _desc(name, t) if isinstance(t, torch.Tensor) else type(t)
            return out + [
                (
                    ValueError if isinstance(t, torch.Tensor) else TypeError,
                    f"Expected {name} to be a packed (total, heads, head_dim) tensor, but got "
                    f"{got}.",
                )
            ]
    out += _packed_layout_problems(q, k, v)
    if not isinstance(return_lse, bool):
        out.append((TypeError, f"Expected return_lse to be a bool, but got {return_lse!r}."))
    if kernels and not out:
        out += _kernel_problems(q, k, v, names=("q", "k", "v"))
    if out:
        return out
    found = _cu_seqlens_type_problems("cu_seqlens_q", cu_seqlens_q, q.device)
    found += _cu_seqlens_type_problems("cu_seqlens_k", cu_seqlens_k, q.device)
    if found:
        return found
    n = cu_seqlens_q.numel()
    if cu_seqlens_k.numel() != n:
        return [
            (
                ValueError,
                "Expected cu_seqlens_q and cu_seqlens_k of the same length (one entry per "
                f"sequence, plus one), but got {n} and {cu_seqlens_k.numel()}.",
            )
        ]
    if not _may_read_back(q.device):
        return _max_seqlen_type_problems(max_seqlen_q, max_seqlen_k)
    values = torch.cat([cu_seqlens_q, cu_seqlens_k]).tolist()  # the one device-to-host copy
    found = _cu_seqlens_value_problems(
        "cu_seqlens_q", values[:n], q.shape[0], "max_seqlen_q", max_seqlen_q
    )
    return found + _cu_seqlens_value_problems(
        "cu_seqlens_k", values[n:], k.shape[0], "max_seqlen_k", max_seqlen_k
    )


def check_varlen(*args) -> None:
    """Raise the first problem of :func:`varlen_problems`, if any."""
    found = varlen_problems(*args)
    if found:
        exc_type, message = found[0]
        raise exc_type(message)


def check_fallback_tangents(**named) -> None:
    """On the PyTorch fallback, the tangent dtype check the kernel path makes as it reads the
    tangents (else torch's 'expected scalar type' error, naming no argument). Skipped while
    torch.compile traces, where the kernel path's check is in the traced op too."""
    if torch.compiler.is_compiling():
        return
    for name, x in named.items():
        tangent(x, name)
