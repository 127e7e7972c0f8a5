"""autograd.Functions around the launchers: reverse mode, forward mode and torch.func.

How the tangent gets to the fused kernel: the public function unpacks the tangents of its
(dual) inputs and passes them to ``FlashAttnJVP.apply`` next to the primals, so ``forward``
runs the one-pass kernel that yields o, o_t and lse together; ``jvp`` then hands back that
o_t. When ``jvp`` is called with tangents other than the ones the forward saw (e.g. a
``torch.func.jvp`` outside a ``torch.func.grad``), it runs the fused kernel on them itself.

All Functions use ``setup_context`` and define ``vmap`` (folding the vmapped dim into the
batch dim), so ``torch.func.grad/jvp/vjp/jacfwd/jacrev/vmap`` compose with them.
"""

from __future__ import annotations

import torch
from torch._C._functorch import is_functorch_wrapped_tensor
from torch.autograd import forward_ad as fwAD

from . import _ops, reference

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


def _unfold(outputs, size: int):
    outs = tuple(o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outputs)
    return outs, (0,) * len(outs)


def _zero_tangent(t: Tensor) -> Tensor:
    """A zero tangent without memory traffic (tangent of lse and of the o_t output)."""
    return t.new_zeros(()).expand(t.shape)


def _jvp_result(ctx, o_t: Tensor) -> tuple[Tensor, ...]:
    """Tangents of FlashAttnJVP's outputs: o_t for o; zeros for lse and the o_t output,
    which are not part of the public result."""
    lse_t = o_t.new_zeros((), dtype=torch.float32).expand(o_t.shape[:-1])
    return (o_t, lse_t) if ctx.n_outputs == 2 else (o_t, lse_t, _zero_tangent(o_t))


class FlashAttnJVP(torch.autograd.Function):
    """o, lse[, o_t] = attention(q, k, v) with the tangents q_t, k_t, v_t (or None) fused in."""

    @staticmethod
    def forward(q, k, v, q_t, k_t, v_t, scale: float, is_causal: bool):
        o, o_t, lse = _ops.attn_fwd(q, k, v, q_t, k_t, v_t, scale, is_causal)
        return (o, lse) if o_t is None else (o, lse, o_t)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, q_t, k_t, v_t, scale, is_causal = inputs
        o, lse = output[:2]
        ctx.scale, ctx.is_causal = scale, is_causal
        ctx.n_outputs = len(output)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, o, lse)
        o_t = output[2] if len(output) == 3 else None
        ctx.save_for_forward(q, k, v, q_t, k_t, v_t, o_t)

    @staticmethod
    def jvp(ctx, gq, gk, gv, *_):
        q, k, v, q_t, k_t, v_t, o_t = ctx.saved_tensors
        if o_t is not None and gq is q_t and gk is k_t and gv is v_t:
            # The forward's own o_t output without its (zero) tangent: reverse mode through
            # it reaches our backward, which refuses instead of returning silent zeros.
            return _jvp_result(ctx, fwAD.unpack_dual(o_t).primal)
        if gq is None and gk is None and gv is None:
            return _jvp_result(ctx, q.new_zeros(()).expand(*q.shape[:-1], v.shape[-1]))
        if _kernel_ready(q, k, v, gq, gk, gv):
            o_t = _ops.attn_fwd(q, k, v, gq, gk, gv, ctx.scale, ctx.is_causal)[1]
            return _jvp_result(ctx, _TangentNoGrad.apply(o_t, q, k, v, gq, gk, gv))
        o_t = reference.attention_jvp(q, k, v, gq, gk, gv, ctx.scale, ctx.is_causal)
        return _jvp_result(ctx, o_t)

    @staticmethod
    def backward(ctx, do, dlse=None, do_t=None):
        if do_t is not None:
            raise NotImplementedError(_NO_TANGENT_GRAD)
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            return (None,) * 8
        dq, dk, dv = AttnBackward.apply(do, q, k, v, o, lse, ctx.scale, ctx.is_causal)
        return dq, dk, dv, None, None, None, None, None

    @staticmethod
    def vmap(info, in_dims, *args):
        return _unfold(FlashAttnJVP.apply(*_fold(args, in_dims, info.batch_size)), info.batch_size)


class AttnBackward(torch.autograd.Function):
    """dq, dk, dv = vjp of attention at (q, k, v) with cotangent do, from the saved o and lse.

    Its ``jvp`` (forward-over-reverse: a tangent of the gradients) is exact. When only ``do``
    carries a tangent (a backward run inside a ``forward_ad.dual_level``), the gradient is
    linear in ``do`` and the same kernels give it; when q, k or v carry one (e.g.
    ``torch.func.jvp(torch.func.grad(f))``), it uses the PyTorch composite
    ``reference.attention_bwd_jvp``, which materialises the (Lq, Lk) score matrix.
    Double backward is not supported.
    """

    @staticmethod
    def forward(do, q, k, v, o, lse, scale: float, is_causal: bool):
        return _ops.attn_bwd(do, q, k, v, o, lse, scale, is_causal)

    @staticmethod
    def setup_context(ctx, inputs, output):
        do, q, k, v, o, lse, scale, is_causal = inputs
        ctx.scale, ctx.is_causal = scale, is_causal
        ctx.set_materialize_grads(False)
        ctx.save_for_forward(do, q, k, v, o, lse)

    @staticmethod
    def jvp(ctx, g_do, gq, gk, gv, *_):
        do, q, k, v, o, lse = ctx.saved_tensors
        if gq is None and gk is None and gv is None:
            if g_do is None:
                return tuple(_zero_tangent(t) for t in (q, k, v))
            if _kernel_ready(g_do, q, k, v, o, lse):
                return _ops.attn_bwd(g_do, q, k, v, o, lse, ctx.scale, ctx.is_causal)
        with torch.autocast(q.device.type, enabled=False):
            return reference.attention_bwd_jvp(
                q, k, v, do, gq, gk, gv, g_do, scale=ctx.scale, is_causal=ctx.is_causal
            )

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "flash_jvp: double backward (differentiating the gradients of attention again) "
            "is not supported."
        )

    @staticmethod
    def vmap(info, in_dims, *args):
        return _unfold(AttnBackward.apply(*_fold(args, in_dims, info.batch_size)), info.batch_size)


_NO_TANGENT_GRAD = (
    "flash_jvp: backpropagating through the JVP tangent o_t is not supported yet. Detach the "
    "tangent in the loss (as sCM/MeanFlow losses do: o_t.detach()), or use "
    "flash_jvp.reference.attention_ref for a differentiable tangent."
)


class _TangentNoGrad(torch.autograd.Function):
    """Passes a recomputed o_t through; reverse mode through it raises instead of giving
    silent zeros (the fused kernel's o_t is not differentiable yet)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(o_t, *inputs):
        return o_t.view_as(o_t)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError(_NO_TANGENT_GRAD)
