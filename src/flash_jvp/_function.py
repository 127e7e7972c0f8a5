"""autograd.Functions around the ops: reverse mode, forward mode and torch.func.

:func:`attention` is the Autograd-key kernel of the ``flash_jvp::attention`` op (see
``_library.py``), so it runs eagerly and, under torch.compile, where AOTAutograd traces the
graph (on fake tensors); the Functions' forward and backward call the ``attn_fwd`` /
``attn_bwd`` ops. How the tangent gets to the fused kernel: :func:`attention` unpacks the
tangents of its (dual) inputs and passes them to ``FlashAttnJVP.apply`` next to the primals,
so ``forward`` runs the one-pass kernel that yields o, o_t and lse together; ``jvp`` then
hands back that o_t. When ``jvp`` is called with tangents other than the ones the forward saw
(e.g. a ``torch.func.jvp`` outside a ``torch.func.grad``), it runs the fused kernel on them
itself.

All Functions use ``setup_context`` and define ``vmap`` (folding the vmapped dim into the
batch dim), so ``torch.func.grad/jvp/vjp/jacfwd/jacrev/vmap`` compose with them. Directly
under ``torch.func.jvp`` (the common case), :func:`attention` does functorch's part itself.
Forward-mode tangents are read and made at dual level 0 explicitly (``torch._unpack_dual``,
``torch._make_dual``): the only level autograd has, and the one torch.func uses, also where
a compiled graph re-enters it without Python's ``forward_ad`` bookkeeping.
"""

from __future__ import annotations

import dataclasses

import torch
from torch._C._functorch import (
    CJvpInterpreterPtr,
    TransformType,
    _unwrap_for_grad,
    _wrap_for_grad,
    get_interpreter_stack,
    is_functorch_wrapped_tensor,
    pop_dynamic_layer_stack,
    push_dynamic_layer_stack,
)
from torch._functorch.autograd_function import custom_function_call
from torch._functorch.pyfunctorch import dispatch_functorch
from torch._functorch.utils import unwrap_dead_wrappers

from . import _library, reference
from ._utils import Spec, no_autocast, tangent, tangent_bwd_outputs

Tensor = torch.Tensor


def _kernel_ready(*tensors) -> bool:
    """False when an enclosing torch.func transform hands us wrapped tensors: kernels need
    plain storage, so those calls use the differentiable PyTorch composites instead."""
    return not any(t is not None and is_functorch_wrapped_tensor(t) for t in tensors)


def _fold(args, in_dims, size: int) -> list:
    """Move each vmapped dim to the front and merge it into the batch dim."""
    out = []
    for a, d in zip(args, in_dims):
        if not isinstance(a, Tensor):
            out.append(a)
            continue
        a = a.unsqueeze(0).expand(size, *a.shape) if d is None else a.movedim(d, 0)
        out.append(a.reshape(size * a.shape[1], *a.shape[2:]))
    return out


def _fold_mask(mask: Tensor | None, d: int | None, size: int, batch: int) -> Tensor | None:
    """A 4-D attn_mask (batch dim 1 or ``batch``) folded like :func:`_fold` folds q."""
    if mask is None or (d is None and mask.shape[0] == 1):
        return mask  # broadcasts over the folded batch as it is
    mask = mask.unsqueeze(0).expand(size, *mask.shape) if d is None else mask.movedim(d, 0)
    mask = mask.expand(size, batch, *mask.shape[2:])
    return mask.reshape(size * batch, *mask.shape[2:])


def _unfold(outputs, size: int):
    outs = tuple(o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outputs)
    return outs, (0,) * len(outs)


def _no_varlen_vmap(spec: Spec) -> None:
    if spec.varlen:
        raise NotImplementedError("flash_jvp: vmap over varlen_attention is not supported.")


def _zero_tangent(t: Tensor) -> Tensor:
    """A zero tangent without memory traffic (tangent of the o_t and mu outputs)."""
    return t.new_zeros(()).expand(t.shape)


def _jvp_result(ctx, o_t: Tensor, mu: Tensor) -> tuple[Tensor, ...]:
    """Tangents of FlashAttnJVP's outputs: o_t for o, mu for lse, and zeros for the o_t and
    mu outputs themselves (their own tangents would be second order)."""
    if ctx.n_outputs == 2:
        return o_t, mu
    return o_t, mu, _zero_tangent(o_t), _zero_tangent(mu)


def eager_only(fn):
    """``fn``, which Dynamo never compiles, nor any frame it calls: our eager paths (the
    Functions' vmap rules, :data:`eager_attention`, the fused layers' ``nn.*._fused``). Where a
    compiled function graph-breaks, its frames run eagerly and Dynamo tries each frame they
    call as a graph of its own; traced on fake tensors, ours lost their forward-mode tangents
    silently (under vmap it compiled ``FlashAttnJVP.vmap``, whose ``apply`` traced without the
    jvp; after such a call, ``_duals``, whose ``torch._make_dual`` AOTAutograd drops).
    ``tests/test_cases.py::test_c1_vmap_of_a_compiled_function_on_duals`` and
    ``::test_c1_duals_after_a_vmapped_call_of_a_compiled_function``. Costs ~0.5 us a call."""
    return torch.compiler.disable(fn)


class _Function(torch.autograd.Function):
    """An autograd.Function whose ``apply`` takes positional arguments only: what
    ``Function.apply`` does, less its per-call ``inspect.signature`` binding of default
    arguments (about a third of a plain forward's host time; our forwards have none).

    Under torch.func transforms it goes to functorch's interpreter directly: inside an op's
    kernel, functorch has masked the dispatch key through which ``custom_function_call``
    would reach it."""

    @classmethod
    def apply(cls, *args):
        if torch._C._are_functorch_transforms_active():
            return dispatch_functorch(custom_function_call, (cls, *args), {})
        return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))


def _needs_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def has_autograd_work(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    """Whether ``flash_jvp::attention``'s Autograd kernel has anything to do: a torch.func
    transform, an input needing a backward, or a forward-mode tangent."""
    if torch._C._are_functorch_transforms_active() or _needs_grad(q, k, v, mask):
        return True
    return any(x is not None and tangent(x) is not None for x in (q, k, v, mask))


def _nested_forward_ad(stack) -> bool:
    """Two or more torch.func forward-mode levels (jvp of jvp, jacfwd of jacfwd): the fused
    kernel gives only first-order tangents, so such calls take the PyTorch reference path.
    ``stack``: functorch's interpreter stack (C++ interpreters: no Python objects per call)."""
    return stack is not None and sum(i.key() == TransformType.Jvp for i in stack) >= 2


def unwrap_level(xs, level: int) -> list:
    """xs (tensors or None) as the level below ``level`` sees them: wrappers of ``level``
    unwrapped, and wrappers left from finished transforms (dead; e.g. a tensor kept from a
    ``torch.func.grad`` and closed over in a new jvp) taken as their values, which
    ``_unwrap_for_grad`` alone refuses with an internal assert."""
    return [None if x is None else _unwrap_for_grad(x, level) for x in unwrap_dead_wrappers(xs)]


def apply_below(top, fn, *args):
    """``fn(*args)`` one level below ``top``, the innermost interpreter, a ``torch.func.jvp``:
    what functorch's ``JvpInterpreter.lower()`` does, without its Python interpreter objects
    (measured: ~4 us of host time a call, ~0.3 ms with its per-call class generation)."""
    fwd_grad = torch._C._is_fwd_grad_enabled()
    layer = pop_dynamic_layer_stack()
    try:
        if not CJvpInterpreterPtr(top).prevFwdGradMode():
            torch._C._set_fwd_grad_enabled(False)
        return fn(*args)
    finally:
        torch._C._set_fwd_grad_enabled(fwd_grad)
        push_dynamic_layer_stack(layer)


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: Spec, need_lse: bool = True
) -> tuple[Tensor, Tensor | None]:
    """o and lse of :class:`FlashAttnJVP` (arguments as the launchers take them), carrying
    o_t and mu (lse's tangent) as their tangents. ``need_lse=False``: the caller drops lse,
    which a ``torch.func.jvp`` call then returns as None (no dual made for it).

    When the innermost transform is a ``torch.func.jvp``, the Function is applied one level
    down and o, lse are made duals of the fused o_t, mu at the JVP's level here. That is what
    functorch's generic autograd.Function support does, less its per-call class generation and
    pytree passes (measured: ~0.6 ms of host time a call), and it needs no functorch dispatch
    from inside an op's kernel (see :func:`traced_attention`). Where nothing needs a backward
    (no grad mode, or nothing requiring grad) the launcher runs without the Function.
    """
    stack = get_interpreter_stack()
    if _nested_forward_ad(stack):
        with no_autocast(q.device):
            return reference.attention_spec(q, k, v, mask, spec)
    names = ("q", "k", "v") if spec.varlen else ("query", "key", "value")  # as the API's
    tangents = [tangent(x, name) for x, name in zip((q, k, v), names)]
    additive = mask is not None and mask.dtype != torch.bool
    tangents.append(tangent(mask, "attn_mask") if additive else None)
    if not stack:
        if _needs_grad(q, k, v, mask, *tangents):
            return FlashAttnJVP.apply(q, k, v, mask, *tangents, spec)[:2]
        # as Function.apply does, wrappers left from finished torch.func transforms unwrapped
        args = unwrap_dead_wrappers((q, k, v, mask, *tangents))
        return _duals(_launch_fwd(*args, spec), need_lse, None)
    top = stack[-1]
    if top.key() != TransformType.Jvp:
        return FlashAttnJVP.apply(q, k, v, mask, *tangents, spec)[:2]
    level = top.level()
    args = unwrap_level((q, k, v, mask, *tangents), level)
    if spec.varlen:  # an op's arguments arrive wrapped at the level, cu_seqlens too
        cu_q, cu_k = unwrap_level((spec.cu_seqlens_q, spec.cu_seqlens_k), level)
        spec = dataclasses.replace(spec, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    plain = len(stack) == 1 and not _needs_grad(*args)  # the JVP alone
    out = apply_below(top, _launch_fwd if plain else FlashAttnJVP.apply, *args, spec)
    return _duals(out, need_lse, level)


# api's eager calls (the op's Autograd kernel, traced_attention, calls attention itself)
eager_attention = eager_only(attention)


def _launch_fwd(q, k, v, mask, q_t, k_t, v_t, mask_t, spec: Spec) -> tuple:
    """The outputs of :class:`FlashAttnJVP` ((o, lse), or (o, lse, o_t, mu) with tangents)
    from the ``attn_fwd`` op, without the Function's bookkeeping, for calls that nothing
    differentiates in reverse mode (plain tensors: the callers unwrap)."""
    o, o_t, lse, mu = _library.fwd(q, k, v, q_t, k_t, v_t, mask, mask_t, spec)
    if q_t is None and k_t is None and v_t is None and mask_t is None:
        return o, lse
    return o, lse, o_t, mu


def _duals(out: tuple, need_lse: bool, level: int | None) -> tuple[Tensor, Tensor | None]:
    """o and lse from (o, lse[, o_t, mu]), with o_t and mu as their tangents, at forward-AD
    level 0 (``level`` None) or wrapped for the torch.func level ``level``; lse None
    (no dual made) without ``need_lse`` where there are tangents."""
    if level is not None:  # lse and mu wrapped only where returned (~3 us a wrapper)
        keep = (True, True) if len(out) == 2 else (True, need_lse, True, need_lse)
        out = [_wrap_for_grad(x, level) if k else None for x, k in zip(out, keep)]
    if len(out) == 2:
        return out[0], out[1]
    o = torch._make_dual(out[0], out[2], 0)
    return o, torch._make_dual(out[1], out[3], 0) if need_lse else None


def traced_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: Spec
) -> tuple[Tensor, Tensor]:
    """:func:`attention` as the Autograd kernel of ``flash_jvp::attention``, which runs where
    torch.compile's AOTAutograd traces the graph. There functorch has masked the dispatch key
    through which an autograd.Function reaches a grad transform, so under ``torch.func.grad``
    / ``vjp`` / ``jacrev`` (rare inside compiled training code, which calls ``.backward()``)
    the call takes the PyTorch composite, which materialises the (Lq, Lk) scores; forward
    mode (``torch.func.jvp``, whose level :func:`attention` handles itself) and vmap (folded
    before this kernel runs) keep the fused kernels."""
    if any(i.key() != TransformType.Jvp for i in get_interpreter_stack() or []):
        with no_autocast(q.device):
            return reference.attention_spec(q, k, v, mask, spec)
    return attention(q, k, v, mask, spec)


def vmap_attention(size: int, in_dims, q, k, v, mask, spec: Spec) -> tuple[Tensor, Tensor]:
    """``flash_jvp::attention`` under vmap: the vmapped dim folded into the batch dim.
    Returns o and lse with the vmapped dim first."""
    _no_varlen_vmap(spec)
    q, k, v = _fold((q, k, v), in_dims[:3], size)
    mask = _fold_mask(mask, in_dims[3], size, q.shape[0] // size)
    return _unfold(_library.attention(q, k, v, mask, spec), size)[0]


class FlashAttnJVP(_Function):
    """o, lse[, o_t, mu] = attention(q, k, v, mask) with the tangents q_t, k_t, v_t, mask_t
    (or None) fused in; mu = rowsum(P o S_t) is lse's tangent. ``mask``: None, boolean or
    additive (4-D, broadcasting to the scores)."""

    @staticmethod
    def forward(q, k, v, mask, q_t, k_t, v_t, mask_t, spec: Spec):
        tangents = (q_t, k_t, v_t, mask_t)
        o, o_t, lse, mu = _library.fwd(q, k, v, *tangents[:3], mask, mask_t, spec)
        return (o, lse) if all(t is None for t in tangents) else (o, lse, o_t, mu)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, q_t, k_t, v_t, mask_t, spec = inputs
        o, lse = output[:2]
        ctx.spec = spec
        ctx.n_outputs = len(output)
        ctx.set_materialize_grads(False)
        o_t, mu = output[2:] if len(output) == 4 else (None, None)
        # the tangents and o_t, mu only where there are tangents (the backward through o_t)
        ctx.save_for_backward(q, k, v, o, lse, mask, q_t, k_t, v_t, mask_t, o_t, mu)
        ctx.save_for_forward(q, k, v, mask, q_t, k_t, v_t, mask_t, o_t, mu)

    @staticmethod
    def jvp(ctx, gq, gk, gv, gmask, *_):
        q, k, v, mask, q_t, k_t, v_t, mask_t, o_t, mu = ctx.saved_tensors
        if mask is not None and mask.dtype == torch.bool:
            gmask = None
        same = gq is q_t and gk is k_t and gv is v_t and gmask is mask_t
        if o_t is not None and same:
            # The forward's own o_t and mu outputs without their (zero) tangents: reverse
            # mode through them reaches our backward, which refuses instead of returning
            # silent zeros.
            return _jvp_result(ctx, torch._unpack_dual(o_t, 0)[0], torch._unpack_dual(mu, 0)[0])
        lse_shape = (q.shape[1], q.shape[0]) if ctx.spec.varlen else q.shape[:-1]
        if gq is None and gk is None and gv is None and gmask is None:
            zero = q.new_zeros(())
            o_t = zero.expand(*q.shape[:-1], v.shape[-1])
            return _jvp_result(ctx, o_t, zero.float().expand(lse_shape))
        if _kernel_ready(q, k, v, mask, gq, gk, gv, gmask):
            # o_t, mu for these tangents from the fused kernel, differentiable (its backward
            # is the one through o_t)
            o_t, mu = FlashAttnJVP.apply(q, k, v, mask, gq, gk, gv, gmask, ctx.spec)[2:]
            return _jvp_result(ctx, o_t, mu)
        o_t, mu = reference.attention_jvp(q, k, v, gq, gk, gv, mask, gmask, ctx.spec)
        return _jvp_result(ctx, o_t, mu.float())

    @staticmethod
    def backward(ctx, do, dlse=None, do_t=None, dmu=None):
        q, k, v, o, lse, mask, q_t, k_t, v_t, mask_t, o_t, mu = ctx.saved_tensors
        if do_t is not None or dmu is not None:  # reverse mode through o_t (or mu)
            need = ctx.needs_input_grad
            additive = mask is not None and mask.dtype != torch.bool
            flags = (need[3] and additive, need[7] and additive, any(need[4:7]))
            saved = (q, k, v, q_t, k_t, v_t, o, o_t, lse, mu, mask, mask_t)
            dq, dk, dv, dq_t, dk_t, dv_t, dmask, dmask_t = _tangent_backward(
                (do, do_t, dlse, dmu), saved, ctx.spec, flags
            )
            return dq, dk, dv, dmask, dq_t, dk_t, dv_t, dmask_t, None
        if do is None and dlse is None:
            return (None,) * 9
        if do is None:  # a loss on lse alone
            do = torch.zeros_like(o)
        mask_grad = ctx.needs_input_grad[3]
        if _plain_backward(do, dlse, q, k, v, mask):
            grads = _bwd(do, q, k, v, o, lse, mask, ctx.spec, mask_grad, dlse)
        else:
            grads = AttnBackward.apply(do, q, k, v, o, lse, mask, dlse, ctx.spec, mask_grad)
        dmask = grads[3] if mask_grad else None
        return grads[0], grads[1], grads[2], dmask, None, None, None, None, None

    @staticmethod
    @eager_only
    def vmap(info, in_dims, *args):
        size = info.batch_size
        q, k, v, mask, q_t, k_t, v_t, mask_t, spec = args
        _no_varlen_vmap(spec)
        d = list(in_dims)
        q, k, v, q_t, k_t, v_t = _fold((q, k, v, q_t, k_t, v_t), d[:3] + d[4:7], size)
        batch = q.shape[0] // size
        mask, mask_t = (_fold_mask(m, dm, size, batch) for m, dm in ((mask, d[3]), (mask_t, d[7])))
        return _unfold(FlashAttnJVP.apply(q, k, v, mask, q_t, k_t, v_t, mask_t, spec), size)


def _bwd(do, q, k, v, o, lse, mask, spec: Spec, mask_grad: bool, dlse=None):
    """(dq, dk, dv, dmask or None) from the ``attn_bwd`` op."""
    dq, dk, dv, dmask = _library.bwd(do, q, k, v, o, lse, mask, spec, mask_grad, dlse)
    return dq, dk, dv, dmask if mask_grad else None


def _plain_backward(*tensors) -> bool:
    """True when nothing will differentiate the gradients (no create_graph, no forward-mode
    tangent, no torch.func wrapper), so the kernels can run without AttnBackward's Function."""
    if torch.is_grad_enabled() or not _kernel_ready(*tensors):
        return False
    return all(t is None or torch._unpack_dual(t, 0)[1] is None for t in tensors)


class AttnBackward(_Function):
    """dq, dk, dv[, dmask] = vjp of attention at (q, k, v, mask) with cotangents do (of o)
    and dlse (of lse, or None), from the saved o and lse (dmask, the additive mask's
    gradient, with ``mask_grad``).

    Its ``jvp`` (forward-over-reverse: a tangent of the gradients) is exact. When only the
    cotangents carry tangents (a backward run inside a ``forward_ad.dual_level``), the
    gradient is linear in them and the same kernels give it; when q, k, v or the mask carry
    one, the fused kernels give it too where the tensors are plain (forward-AD dual tensors
    over ``autograd.grad(create_graph=True)``: one fwd+JVP pass, one backward through o_t);
    under torch.func transforms (e.g. ``torch.func.jvp(torch.func.grad(f))``), whose
    wrapped tensors the kernels cannot take, the PyTorch composite
    ``reference.attention_bwd_jvp``, which materialises the (Lq, Lk) score matrix. Its
    ``backward`` (double backward) runs on the fused kernels (see there).
    """

    @staticmethod
    def forward(do, q, k, v, o, lse, mask, dlse, spec: Spec, mask_grad: bool):
        dq, dk, dv, dmask = _bwd(do, q, k, v, o, lse, mask, spec, mask_grad, dlse)
        return (dq, dk, dv, dmask) if mask_grad else (dq, dk, dv)

    @staticmethod
    def setup_context(ctx, inputs, output):
        do, q, k, v, o, lse, mask, dlse, spec, mask_grad = inputs
        ctx.spec, ctx.mask_grad = spec, mask_grad
        ctx.set_materialize_grads(False)
        ctx.save_for_forward(do, q, k, v, o, lse, mask, dlse)
        ctx.save_for_backward(do, q, k, v, o, lse, mask, dlse)

    @staticmethod
    def jvp(ctx, g_do, gq, gk, gv, go, glse, gmask, g_dlse, *_):
        do, q, k, v, o, lse, mask, dlse = ctx.saved_tensors
        if mask is not None and mask.dtype == torch.bool:
            gmask = None
        outs = (q, k, v, mask) if ctx.mask_grad else (q, k, v)
        u = (gq, gk, gv, gmask)
        if all(t is None for t in u) and g_do is None and g_dlse is None:
            return tuple(_zero_tangent(t) for t in outs)
        if _kernel_ready(g_do, g_dlse, do, dlse, q, k, v, o, lse, mask, *u):
            # (o, lse) are functions of (q, k, v, mask): their own tangents (go, glse) are
            # the JVP along u, which the kernels take from u directly
            return _second_order(g_do, g_dlse, do, dlse, q, k, v, o, lse, mask, u, ctx.spec,
                                 ctx.mask_grad)[:len(outs)]  # fmt: skip
        with no_autocast(q.device):
            return reference.attention_bwd_jvp(
                q, k, v, do, gq, gk, gv, g_do, mask, gmask, ctx.spec, ctx.mask_grad, dlse, g_dlse
            )

    @staticmethod
    def backward(ctx, gdq, gdk, gdv, gdmask=None):
        """Double backward. By the symmetry of second derivatives, the gradient of
        <(gdq, gdk, gdv, gdmask), vjp(do, dlse)> is: for do and dlse, the JVP (o_t, mu) of
        (o, lse) along u = (gdq, gdk, gdv, gdmask); for q, k, v and the mask, the backward
        through o_t with cotangent do (and through mu with dlse) at tangents u. Both come
        from the fused kernels: one fwd+JVP pass and one tangent backward."""
        do, q, k, v, o, lse, mask, dlse = ctx.saved_tensors
        additive = mask is not None and mask.dtype != torch.bool
        u = (gdq, gdk, gdv, gdmask if ctx.mask_grad and additive else None)
        if all(t is None for t in u):
            return (None,) * 10
        # o_t, mu along u; differentiable, so a third derivative through d do works too
        _, _, o_t, mu = FlashAttnJVP.apply(q, k, v, mask, *u, ctx.spec)
        mask_grad = ctx.needs_input_grad[6] and additive
        saved = (q, k, v, *u[:3], o, o_t, lse, mu, mask, u[3])
        dq, dk, dv, *_, dmask, _ = _tangent_backward(
            (None, do, None, dlse), saved, ctx.spec, (mask_grad, False, False)
        )
        d_dlse = mu if dlse is not None else None
        return o_t, dq, dk, dv, None, None, dmask, d_dlse, None, None

    @staticmethod
    @eager_only
    def vmap(info, in_dims, *args):
        size = info.batch_size
        do, q, k, v, o, lse, mask, dlse, spec, mask_grad = args
        _no_varlen_vmap(spec)
        if mask_grad:
            raise NotImplementedError(
                "flash_jvp: vmap over the gradient of an attn_mask is not supported."
            )
        d = list(in_dims)
        do, q, k, v, o, lse, dlse = _fold((do, q, k, v, o, lse, dlse), d[:6] + d[7:8], size)
        mask = _fold_mask(mask, d[6], size, q.shape[0] // size)
        return _unfold(AttnBackward.apply(do, q, k, v, o, lse, mask, dlse, spec, False), size)


def _second_order(d_o, d_lse, g, g_lse, q, k, v, o, lse, mask, u, spec: Spec, mask_grad: bool):
    """(dq, dk, dv, dmask) = J^T (d_o, d_lse) + d/d(q, k, v, mask) <(g, g_lse), J u>, J the
    Jacobian of (o, lse) at (q, k, v, mask), on the fused kernels: the tangent of the
    gradient (forward-over-reverse) and, with d_o = d_lse = None, the double backward's
    part for q, k, v. The JVP (o_t, mu) along u = (q_t, k_t, v_t, mask_t) comes from one
    fwd+JVP pass, then one backward through o_t (cotangent g, and g_lse for mu)."""
    o_t = mu = None
    if any(t is not None for t in u):
        _, o_t, _, mu = _library.fwd(q, k, v, *u[:3], mask, u[3], spec)
    saved = (q, k, v, *u[:3], o, o_t, lse, mu, mask, u[3])
    grads = _tangent_backward((d_o, g, d_lse, g_lse), saved, spec, (mask_grad, False, False))
    return grads[0], grads[1], grads[2], grads[6]


def _tangent_backward(cots, saved, spec: Spec, flags) -> tuple[Tensor | None, ...]:
    """(dq, dk, dv, dq_t, dk_t, dv_t, dmask, dmask_t), None where not given, of the
    backward through o, o_t, lse and mu: ``cots`` = (do, do_t, dlse, dmu), ``saved`` = (q,
    k, v, q_t, k_t, v_t, o, o_t, lse, mu, mask, mask_t), ``flags`` = (mask_grad,
    mask_t_grad, tangent_grads) (see ``_ops.attn_bwd_tangent``). Runs the op directly when
    nothing will differentiate the result, else through :class:`AttnTangentBackward`."""
    if _plain_backward(*cots, *saved):
        return _library.attn_bwd_tangent_grads(*cots, *saved, spec, *flags)
    outs = iter(AttnTangentBackward.apply(*cots, *saved, spec, flags))
    q_t, k_t, v_t, mask_t = saved[3], saved[4], saved[5], saved[11]
    given = tangent_bwd_outputs(q_t, k_t, v_t, mask_t, cots[1], cots[3], *flags)
    return tuple(next(outs) if g else None for g in given)


class AttnTangentBackward(_Function):
    """The gradients of the backward through o and o_t (``attn_bwd_tangent``), the ones
    given only, as a Function, for where they may be differentiated again: forward mode
    through them is exact (a PyTorch composite), reverse mode (a third derivative) refuses
    clearly instead of giving silent zeros. Arguments as :func:`_tangent_backward`'s,
    flattened."""

    @staticmethod
    def forward(*args):
        *tensors, spec, flags = args
        grads = _library.attn_bwd_tangent_grads(*tensors, spec, *flags)
        return tuple(g for g in grads if g is not None)

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, ctx.spec, ctx.flags = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_forward(*tensors)

    @staticmethod
    def jvp(ctx, *tangents):
        """Forward mode through these gradients (a third derivative, which forward AD also
        computes for a backward run inside ``forward_ad.dual_level``): exact, by the JVP of
        the PyTorch composite reference.attention_tangent_bwd, which materialises the
        (Lq, Lk) scores. o, o_t, lse and mu count as functions of the
        other inputs (their own tangents are the JVP along those)."""
        saved = ctx.saved_tensors
        mask = saved[14]
        bool_mask = mask is not None and mask.dtype == torch.bool
        # do, do_t, dlse, dmu, q, k, v, q_t, k_t, v_t, mask, mask_t (by position)
        inputs = [i for i in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 14, 15)
                  if saved[i] is not None and not (i == 14 and bool_mask)]  # fmt: skip
        given = tangent_bwd_outputs(saved[7], saved[8], saved[9], saved[15], saved[1], saved[3],
                                    *ctx.flags)  # fmt: skip

        def grads(*xs):
            x = list(saved)
            for i, xi in zip(inputs, xs):
                x[i] = xi
            out = reference.attention_tangent_bwd(
                *x[4:10], x[14], x[15], x[0], x[1], ctx.spec, x[2], x[3], *ctx.flags[:2]
            )
            return tuple(g for g, keep in zip(out, given) if keep)

        primals = tuple(saved[i] for i in inputs)
        dirs = tuple(torch.zeros_like(saved[i]) if tangents[i] is None else tangents[i]
                     for i in inputs)  # fmt: skip
        # by reverse mode twice (autograd.functional.jvp): forward AD cannot nest here
        with no_autocast(saved[4].device), torch.enable_grad():
            return torch.autograd.functional.jvp(grads, primals, dirs)[1]

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(_THIRD_ORDER)

    @staticmethod
    @eager_only
    def vmap(info, in_dims, *args):
        *tensors, spec, flags = args
        _no_varlen_vmap(spec)
        if flags[0] or flags[1]:
            raise NotImplementedError(
                "flash_jvp: vmap over the gradient of an attn_mask is not supported."
            )
        size = info.batch_size
        rows = _fold(tensors[:14], in_dims[:14], size)  # all but mask, mask_t (the last two)
        batch = rows[4].shape[0] // size  # q's
        masks = [_fold_mask(m, d, size, batch) for m, d in zip(tensors[14:], in_dims[14:16])]
        return _unfold(AttnTangentBackward.apply(*rows, *masks, spec, flags), size)


_THIRD_ORDER = (
    "flash_jvp: reverse mode through the backward through the JVP tangent o_t (or through "
    "a double backward), a third-order derivative, is not supported; "
    "flash_jvp.reference.attention_ref is differentiable to any order."
)
