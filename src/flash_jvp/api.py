"""Public API: a drop-in for torch.nn.functional.scaled_dot_product_attention."""

from __future__ import annotations

import math

import torch
from torch.nn.attention.bias import CausalBias

from . import _library, _validate, reference
from ._utils import Spec, no_autocast, uses_kernels

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
        attn_mask: boolean (True = take part) or additive float (float32 or query's dtype)
            mask of any shape that broadcasts to ``(N, ..., Hq, L, S)`` — e.g. ``(L, S)``,
            key padding ``(N, 1, 1, S)``, ``(N, Hq, L, S)`` or an expanded view; read
            through its strides, never copied. Additive entries ``<= finfo(query.dtype).min``
            (or ``-inf``) mask their key out exactly, so a row with every key masked gives
            zeros in the output, its tangent and all gradients (math SDPA gives zeros for
            all ``-inf`` rows and a plain average for all ``finfo.min`` rows). An additive
            mask that requires grad gets its gradient; one that carries a forward-mode
            tangent adds it to the tangent scores. Also accepted:
            ``torch.nn.attention.bias.causal_upper_left(L, S)`` / ``causal_lower_right(L, S)``.
            Key blocks a mask hides from a whole query block are skipped.
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
        TypeError: a non-tensor input, an integer dtype, a non-bool ``is_causal``, an
            ``attn_mask`` of another dtype than bool, float32 or query's.
        ValueError: wrong ndim; mismatched batch dims, heads, lengths, head dims, dtypes or
            devices; ``Hq != Hkv`` without ``enable_gqa``; ``S == 0``; an ``attn_mask`` that
            does not broadcast to the scores; ``attn_mask`` together with ``is_causal=True``
            (SDPA's message; the error is also a ``RuntimeError``, as SDPA's is).
        NotImplementedError: ``dropout_p > 0``; on the kernel path a dtype other than
            float16/bfloat16/float32 (float16/float32 under Triton's interpreter) or a head
            dim above 256.

    Differentiation:
        * reverse mode (``.backward()``, ``torch.autograd.grad``): FlashAttention-2 backward.
        * forward mode (``torch.func.jvp``, ``torch.autograd.forward_ad`` dual tensors), with
          tangents on any subset of query/key/value: the tangent comes from the same fused
          pass that computes the output. Math: with S = scale * q k^T, P = softmax(S),
          S_t = scale * (q_t k^T + q k_t^T) [+ mask_t],
          o_t = (P o S_t) v - rowsum(P o S_t) o + P v_t
          (the JVP of flash attention in Lu & Song, "Simplifying, Stabilizing and Scaling
          Continuous-Time Consistency Models", arXiv:2410.11081, 2024).
        * both in one step (primals that require grad, a JVP, a loss on ``o`` and ``o_t``):
          supported, with ``o_t`` detached (sCM, MeanFlow) or not (Terminal Velocity
          Matching, flow maps): the backward through ``o_t`` gives the gradients of
          query/key/value, of their tangents and of an additive mask and its tangent, in
          fused kernels with O(L) extra memory (reference.attention_tangent_bwd has the math).
        * double backward (``torch.autograd.grad(..., create_graph=True)``, then again) and
          forward-over-reverse with forward-AD dual tensors: fused (one fwd+JVP pass and one
          backward through the tangent). Reverse mode once more (a third derivative) raises
          ``NotImplementedError``; forward mode through those gradients (e.g. a backward run
          inside ``forward_ad.dual_level``) takes a PyTorch composite that materialises the
          score matrix.
        * ``torch.func`` ``grad``, ``vjp``, ``jacrev``, ``jacfwd``, ``vmap`` compose with it
          (except ``vmap``/``jacrev`` of the gradient with respect to an additive mask).
          ``torch.func.jvp`` of ``torch.func.grad`` is exact but materialises the score
          matrix (functorch hands the kernels wrapped tensors there).
        * ``torch.compile``: fullgraph, no graph break, in every mode (the kernels are
          ``torch.library`` ops; README's support table says which combinations compile).

    Devices:
        CUDA tensors run the Triton kernels. CPU tensors run the same kernels under
        ``TRITON_INTERPRET=1`` (slow; for tests), and otherwise fall back to
        :func:`flash_jvp.reference.attention_ref`, plain PyTorch with the same semantics.
        Other devices use that fallback too. Under autocast, query, key, value and a float
        attn_mask in fp16, bf16 or fp32 are cast to the autocast dtype first, as autocast
        does for SDPA (float64 stays float64).

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
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return _attention(*args, with_lse=False)


def attention_with_lse(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor]:
    """:func:`scaled_dot_product_attention` that also returns the scores' log-sum-exp.

    Arguments, shapes, errors and supported features as :func:`scaled_dot_product_attention`.

    Returns:
        ``o`` ``(N, ..., Hq, L, Ev)`` in query's dtype and ``lse`` ``(N, ..., Hq, L)``,
        float32 (float64 on the CPU fallback for float64 inputs): the natural-log
        ``logsumexp_j(scale * q_i . k_j [+ mask_ij])`` over the visible keys of each query
        row; ``-inf`` for a row with no visible key (whose ``o`` is 0). With it, results
        over disjoint key sets merge exactly: ``lse = logsumexp_b lse_b``,
        ``o = sum_b exp(lse_b - lse) o_b`` (ring attention, split-KV decoding).

    Differentiation: both outputs in both modes. The tangent of lse is
    ``mu = rowsum(P o S_t)`` (``S_t`` the scores' tangent, the mask's tangent included),
    computed in the same fused pass as o_t; its cotangent enters the backward as
    ``dS += P * dlse`` (dS the scores' gradient); a cotangent of mu (reverse mode through
    lse's tangent) adds P * dmu to the tangent scores' gradient.
    """
    args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return _attention(*args, with_lse=True)


def _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, with_lse):
    query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    kernels = _kernels(query)
    _validate.check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, kernels)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    if not kernels:
        _validate.check_fallback_tangents(query=query, key=key, value=value, attn_mask=attn_mask)
        with no_autocast(query.device):
            return reference.attention_ref(
                query, key, value, attn_mask, is_causal, scale, enable_gqa, return_lse=with_lse
            )
    lead = query.shape[:-3]
    q, k, v = (_batch_3d(x, lead) for x in (query, key, value))
    offset = reference.causal_offset(is_causal, attn_mask, q.shape[-2], k.shape[-2])
    mask = None if isinstance(attn_mask, CausalBias) else _mask_4d(attn_mask, lead)
    o, lse = _attend(q, k, v, mask, Spec(scale, offset), with_lse)
    if len(lead) != 1:
        o = o.reshape(*lead, *o.shape[1:])
        lse = lse.reshape(*lead, *lse.shape[1:]) if with_lse else None
    return (o, lse) if with_lse else o


def _batch_3d(x: Tensor, lead: tuple[int, ...]) -> Tensor:
    """(*lead, H, L, E) -> (prod(lead), H, L, E); 4-D inputs pass as they are (a reshape of
    a torch.func-wrapped tensor costs ~15 us of host time even when it changes nothing)."""
    return x if len(lead) == 1 else x.reshape(math.prod(lead), *x.shape[-3:])


def _mask_4d(mask: Tensor | None, lead: tuple[int, ...]) -> Tensor | None:
    """attn_mask (broadcasting to (*lead, H, Lq, Lk)) as a 4-D view (B or 1, h, lq, lk) whose
    size-1 dims broadcast; only a mask with several distinct leading dims is copied."""
    if mask is None:
        return None
    mask = mask.reshape((1,) * (len(lead) + 3 - mask.dim()) + tuple(mask.shape))
    if all(n == 1 for n in mask.shape[:-3]):
        return mask.reshape(1, *mask.shape[-3:])
    mask = mask.expand(*lead, *mask.shape[-3:])
    return mask.reshape(math.prod(lead), *mask.shape[-3:])


attention = scaled_dot_product_attention


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over a packed batch of variable-length sequences (no padding), with the
    same differentiation support as :func:`scaled_dot_product_attention`.

    The layout of ``flash_attn_varlen_func``: sequence ``i`` is rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]`` of ``q`` and attends only to keys
    ``cu_seqlens_k[i]:cu_seqlens_k[i + 1]`` of ``k``/``v``.

    Args:
        q: ``(total_q, Hq, E)``; float16, bfloat16 or float32; any strides.
        k: ``(total_k, Hkv, E)``, same dtype and device; ``Hq`` a multiple of ``Hkv`` (GQA).
        v: ``(total_k, Hkv, Ev)``.
        cu_seqlens_q, cu_seqlens_k: int32 ``(n + 1,)`` on q's device: 0, then the running
            total of each sequence's length (lengths 0 and 1 allowed); both for ``n``
            sequences; the last entry equals ``total_q`` / ``total_k``.
        max_seqlen_q, max_seqlen_k: the longest query / key sequence (at least the true
            maxima; they size the launch grid, capped at the totals).
        is_causal: per sequence, SDPA's top-left alignment (query ``i`` attends keys
            ``j <= i`` of its own sequence); flash-attn's varlen causal is bottom-right
            when a sequence's query and key lengths differ.
        scale: score scale; default ``1 / sqrt(E)``.

        return_lse: also return the log-sum-exp, as :func:`attention_with_lse` does.

    Returns:
        ``(total_q, Hq, Ev)``, dtype of ``q``. A sequence with no keys gives zeros. With
        ``return_lse``, ``(o, lse)`` with lse ``(Hq, total_q)`` float32 (flash-attn's
        layout), ``-inf`` for rows with no keys.

    Raises:
        TypeError: non-tensor inputs, cu_seqlens not int32, a nested (jagged) tensor.
        ValueError: wrong ndim, mismatched heads/head dims/dtypes/devices, cu_seqlens that do
            not start at 0, decrease, differ in length or do not end at the totals, a
            max_seqlen below the longest sequence.
        NotImplementedError: unsupported dtype or head dim on the kernel path.

    The cu_seqlens are checked on the host before launch (one small device-to-host copy).
    Nested jagged tensors are not accepted: pass ``nt.values()`` and ``nt.offsets()``
    (converted to int32) instead. ``torch.func.vmap`` over this function is not supported.
    """
    q, k, v = _autocast(q, k, v)
    kernels = _kernels(q)
    _validate.check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, kernels,
        return_lse,
    )  # fmt: skip
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not kernels:
        _validate.check_fallback_tangents(q=q, k=k, v=v)
        with no_autocast(q.device):
            return reference.varlen_attention_dense(
                q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal, scale, with_lse=return_lse
            )
    spec = Spec(scale, 0 if is_causal else None, cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q, max_seqlen_k)  # fmt: skip
    o, lse = _attend(q, k, v, None, spec, return_lse)
    return (o, lse) if return_lse else o


def _attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: Spec, need_lse: bool
) -> tuple[Tensor, Tensor | None]:
    """o and lse on the kernel path (lse may be None without ``need_lse``). While
    torch.compile traces, through the ``flash_jvp::attention`` op, which Dynamo treats as
    opaque (its tangent logic runs where AOTAutograd traces, see _library.py); eagerly, the
    autograd.Functions directly: the same code, with every torch.func transform composing
    and without the dispatcher's host time."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._get_tracing_state() is not None):  # fmt: skip
        # traced (torch.compile; make_fx, as in torch.func.linearize or export; torch.jit):
        # the op, whose graph then reads tangents where it runs (see _library.py)
        return _library.attention(q, k, v, mask, spec)
    from . import _function  # imports functorch internals Dynamo must not trace

    return _function.eager_attention(q, k, v, mask, spec, need_lse)


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
    query, key, value, attn_mask = _autocast(query, key, value, attn_mask)
    found = _validate.problems(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, _kernels(query)
    )
    return [message for _, message in found]


def _kernels(query) -> bool:
    """Whether this call runs the Triton kernels (else the PyTorch fallback)."""
    return isinstance(query, Tensor) and uses_kernels(query.device)


# what autocast casts for an op it runs in lower precision, such as SDPA (not float64)
_AUTOCAST_FROM = (torch.float32, torch.float16, torch.bfloat16)


def _autocast(*xs):
    """With autocast on for the first tensor's device, xs with a dtype in _AUTOCAST_FROM cast
    to the autocast dtype, as autocast does for SDPA's arguments; all else passes through
    (other dtypes, None, a CausalBias, non-tensors, which validation then reports)."""
    if not isinstance(xs[0], Tensor):
        return xs
    device_type = xs[0].device.type
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return xs
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        x.to(dtype)
        if isinstance(x, Tensor) and not isinstance(x, CausalBias) and x.dtype in _AUTOCAST_FROM
        else x
        for x in xs
    )
