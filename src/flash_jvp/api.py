"""Public API: a drop-in for torch.nn.functional.scaled_dot_product_attention."""

from __future__ import annotations

import math

import torch
from torch._C._functorch import TransformType, is_batchedtensor
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd import forward_ad as fwAD

from . import _validate, reference
from ._utils import uses_kernels

Tensor = torch.Tensor


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Attention ``softmax(scale * query @ key^T [+ causal mask]) @ value``, with fused
    forward-mode (JVP) and reverse-mode derivatives.

    Same signature and semantics as :func:`torch.nn.functional.scaled_dot_product_attention`,
    so ``F.scaled_dot_product_attention = flash_jvp.scaled_dot_product_attention`` works.

    Args:
        query: ``(N, ..., Hq, L, E)``; float16, bfloat16 or float32; any strides.
        key: ``(N, ..., Hkv, S, E)``, same dtype and device as ``query``.
        value: ``(N, ..., Hkv, S, Ev)``.
        attn_mask: must be None for now (masks come in a later release).
        dropout_p: must be 0.0 (dropout is not supported).
        is_causal: SDPA's top-left aligned causal mask, ``ones(L, S).tril()``: query ``i``
            attends keys ``j <= i``. For L=3, S=5 (``x`` = attends)::

                x . . . .
                x x . . .
                x x x . .

            This is not flash-attn's bottom-right alignment when L != S.
        scale: score scale; default ``1 / sqrt(E)``.
        enable_gqa: allow ``Hq`` to be a multiple of ``Hkv`` (grouped-query attention);
            query head ``h`` uses key/value head ``h // (Hq // Hkv)``.

    Returns:
        ``(N, ..., Hq, L, Ev)``, dtype of ``query``.

    Raises:
        TypeError: a non-tensor input, an integer dtype, a non-bool ``is_causal``.
        ValueError: wrong ndim; mismatched batch dims, heads, lengths, head dims, dtypes or
            devices; ``Hq != Hkv`` without ``enable_gqa``; ``S == 0``.
        NotImplementedError: ``attn_mask`` given; ``dropout_p > 0``; on the kernel path a dtype
            other than float16/bfloat16/float32 (float16/float32 under Triton's interpreter)
            or a head dim above 256.

    Differentiation:
        * reverse mode (``.backward()``, ``torch.autograd.grad``): FlashAttention-2 backward.
        * forward mode (``torch.func.jvp``, ``torch.autograd.forward_ad`` dual tensors), with
          tangents on any subset of query/key/value: the tangent comes from the same fused
          pass that computes the output. Math: with S = scale * q k^T, P = softmax(S),
          S_t = scale * (q_t k^T + q k_t^T), o_t = (P o S_t) v - rowsum(P o S_t) o + P v_t
          (the JVP of flash attention in Lu & Song, "Simplifying, Stabilizing and Scaling
          Continuous-Time Consistency Models", arXiv:2410.11081, 2024).
        * both in one step (primals that require grad, a JVP, a loss on ``o`` and
          ``o_t.detach()``): supported. Backpropagating through an undetached tangent raises
          ``NotImplementedError``; so does double backward.
        * ``torch.func`` ``grad``, ``vjp``, ``jacrev``, ``jacfwd``, ``vmap`` compose with it.
          Forward-over-reverse (``jvp`` of ``grad``) is exact but materialises the score matrix.
        * ``torch.compile``: not tested yet; compile the surrounding code with a graph break.

    Devices:
        CUDA tensors run the Triton kernels. CPU tensors run the same kernels under
        ``TRITON_INTERPRET=1`` (slow; for tests), and otherwise fall back to
        :func:`flash_jvp.reference.attention_ref`, plain PyTorch with the same semantics.
        Other devices use that fallback too. Under autocast the inputs are cast to the
        autocast dtype first, as SDPA does.

    Precision:
        fp32 products use IEEE fp32 unless ``torch.backends.cuda.matmul.allow_tf32`` is set
        (then TF32); fp16/bf16 products accumulate in fp32. Softmax statistics are fp32.

    Shape legend:
        N, ...: batch dims; Hq, Hkv: query and key/value heads; L, S: query and key lengths;
        E: query/key head dim; Ev: value head dim.

    Example::

        import torch, flash_jvp
        q, k, v = (torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        q_t, k_t, v_t = (torch.randn_like(q) for _ in range(3))
        o, o_t = torch.func.jvp(
            lambda q, k, v: flash_jvp.attention(q, k, v, is_causal=True),
            (q, k, v), (q_t, k_t, v_t))
    """
    query, key, value = _autocast(query, key, value)
    kernels = _kernels(query)
    _validate.check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, kernels)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    if not kernels or _nested_forward_ad():
        return reference.attention_ref(
            query, key, value, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    from ._function import FlashAttnJVP  # imports triton: only on the kernel path

    lead = query.shape[:-3]
    q, k, v = (x.reshape(math.prod(lead), *x.shape[-3:]) for x in (query, key, value))
    tangents = [_tangent(x, name) for x, name in zip((q, k, v), ("query", "key", "value"))]
    o = FlashAttnJVP.apply(q, k, v, *tangents, scale, is_causal)[0]
    return o.reshape(*lead, *o.shape[1:])


attention = scaled_dot_product_attention


def supports(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> list[str]:
    """Reasons :func:`scaled_dot_product_attention` would refuse these arguments ([] = none).

    Lets callers route unsupported calls (e.g. with ``attn_mask``) to torch's SDPA themselves.
    """
    query, key, value = _autocast(query, key, value)
    found = _validate.problems(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, _kernels(query)
    )
    return [message for _, message in found]


def _kernels(query) -> bool:
    """Whether this call runs the Triton kernels (else the PyTorch fallback)."""
    return isinstance(query, Tensor) and uses_kernels(query.device)


def _tangent(x: Tensor, name: str) -> Tensor | None:
    """x's forward-mode tangent at the current level, None if absent or a symbolic zero.

    Under a vmap inside the JVP the tangent cannot be unpacked here; FlashAttnJVP.jvp then
    receives it instead.
    """
    if is_batchedtensor(x):
        return None
    t = fwAD.unpack_dual(x).tangent
    if t is None or t._is_zerotensor():
        return None
    if t.dtype != x.dtype:
        raise ValueError(
            f"Expected the forward-mode tangent of {name} to have its dtype {x.dtype}, but got "
            f"{t.dtype}."
        )
    return t


def _nested_forward_ad() -> bool:
    """Two or more torch.func forward-mode levels (jvp of jvp, jacfwd of jacfwd): the fused
    kernel gives only first-order tangents, so such calls take the PyTorch reference path."""
    jvp_levels = sum(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())
    return jvp_levels >= 2


def _autocast(*xs):
    """Cast float32 inputs to the autocast dtype when autocast is on, as SDPA (an op that
    autocast runs in lower precision) does; other dtypes pass through."""
    if not all(isinstance(x, Tensor) for x in xs):
        return xs
    device_type = xs[0].device.type
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return xs
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(x.to(dtype) if x.dtype == torch.float32 else x for x in xs)
