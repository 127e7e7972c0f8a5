"""The kernels as torch.library ops in the ``flash_jvp`` namespace, for torch.compile.

Four ops:

* ``flash_jvp::attn_fwd`` — the fused forward: o, o_t, lse and mu, lse's tangent (o_t and mu
  empty without tangents).
* ``flash_jvp::attn_bwd`` — the backward: dq, dk, dv and dmask (empty without ``mask_grad``),
  for the cotangents of o and (optionally) lse.
* ``flash_jvp::attn_bwd_tangent`` — the backward through o and its tangent o_t (reverse mode
  through a JVP; double backward): the gradients of q, k, v, their tangents and the mask.
* ``flash_jvp::attention`` — what ``flash_jvp.attention`` calls while torch.compile,
  torch.jit.trace or a dispatch mode traces: o and lse of q, k, v (and a mask). Its Autograd
  kernel is :func:`flash_jvp._function.traced_attention`, which reads the forward-mode
  tangents of its inputs and runs the autograd.Functions whose forward/backward call the two
  ops above; where that kernel has nothing to do (no transform, nothing needing grad, no
  tangent) it redispatches the op below autograd, so a graph traced for inference records
  ``flash_jvp::attention`` itself and a run of that graph on dual tensors reaches the Autograd
  kernel again (a recorded ``attn_fwd`` would drop their tangents: its custom_op autograd
  runs it below autograd); below autograd it is ``attn_fwd``'s o. Eagerly,
  ``flash_jvp.attention`` calls those Functions directly (``flash_jvp.api._attend``): the same
  code, without the dispatcher in between, and with every torch.func transform (inside an
  op's kernel functorch has masked the dispatch key its autograd.Function support needs, so
  there only ``torch.func.jvp`` works).

Why this split: torch.library has no forward-mode (JVP) registration, and a ``custom_op``
with only ``register_autograd`` returns a zero tangent under ``torch.func.jvp`` without any
error; Dynamo, when it traces an autograd.Function, drops its ``jvp`` (zero tangents again).
An op whose Autograd-key kernel is our own Python code is opaque to Dynamo (it needs only the
fake implementation), so the tangent logic runs where AOTAutograd traces the graph, in
dispatcher order, on fake tensors — the same code that runs eagerly. The compiled graph then
holds ``attn_fwd``/``attn_bwd`` calls.

``attn_fwd``/``attn_bwd`` are ``custom_op`` s rather than ``triton_op`` s: the launchers choose
a launch config per GPU by trying launches (falling back on ``OutOfResources``) and build
tensor descriptors per config, which tracing through ``wrap_triton`` cannot do, and Inductor's
re-compilation of the forward kernel as a user-defined Triton kernel fails (an accumulator
type assertion in ``tl.dot``). As custom ops the kernels run exactly as in eager; Inductor
calls them as extern kernels.
"""

from __future__ import annotations

import torch
from torch.library import Library
from torch.nn import Parameter

from ._utils import Spec, tangent_bwd_outputs

Tensor = torch.Tensor

_LIB = Library("flash_jvp", "DEF")  # noqa: TOR901  (the Autograd kernel needs a Library)


def spec_of(scale, causal_offset, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Spec:
    return Spec(scale, causal_offset, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def spec_args(spec: Spec) -> tuple:
    """The scalar op arguments that rebuild ``spec`` (inverse of :func:`spec_of`)."""
    return (spec.scale, spec.causal_offset, spec.cu_seqlens_q, spec.cu_seqlens_k,
            spec.max_seqlen_q, spec.max_seqlen_k)  # fmt: skip


def _direct(spec: Spec, *tensors: Tensor | None) -> bool:
    """Whether an op call may run the launcher itself: eagerly (no torch.compile trace, no
    torch.jit trace, no dispatch or function mode such as fake tensors, make_fx or
    FlopCounterMode, no torch.func transform, no profiler, whose trace shows the op) on plain
    tensors and a plain float scale, where the dispatcher would only reach the same function,
    for about 20 us more host time per call (custom_op's autograd and Dynamo-disable
    wrappers)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._are_functorch_transforms_active()
            or torch._C._get_tracing_state() is not None
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._autograd._profiler_enabled()
            or type(spec.scale) is not float):  # fmt: skip
        return False
    return all(t is None or type(t) is Tensor or type(t) is Parameter for t in tensors)


def fwd(q, k, v, q_t, k_t, v_t, mask, mask_t, spec: Spec) -> tuple[Tensor | None, ...]:
    """(o, o_t, lse, mu) of the ``attn_fwd`` op on a Spec (o_t and mu unset without
    tangents: None or empty)."""
    if _direct(spec, q, k, v, q_t, k_t, v_t, mask, mask_t):
        from . import _ops

        return _ops.attn_fwd(q, k, v, q_t, k_t, v_t, mask, mask_t, spec)
    return attn_fwd(q, k, v, q_t, k_t, v_t, mask, mask_t, *spec_args(spec))


def bwd(do, q, k, v, o, lse, mask, spec: Spec, mask_grad: bool, dlse) -> tuple:
    """(dq, dk, dv, dmask) of the ``attn_bwd`` op on a Spec (dmask unset without
    ``mask_grad``: None or empty)."""
    if _direct(spec, do, q, k, v, o, lse, mask, dlse):
        from . import _ops

        return _ops.attn_bwd(do, q, k, v, o, lse, mask, spec, mask_grad, dlse)
    return attn_bwd(do, q, k, v, o, lse, mask, *spec_args(spec), mask_grad, dlse)


def _no_tensor(like: Tensor) -> Tensor:
    """Stands in for an absent output (ops cannot return None)."""
    return like.new_empty(0)


@torch.library.custom_op("flash_jvp::attn_fwd", mutates_args=())
def attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_t: Tensor | None,
    k_t: Tensor | None,
    v_t: Tensor | None,
    mask: Tensor | None,
    mask_t: Tensor | None,
    scale: float,
    causal_offset: int | None,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(o, o_t, lse, mu) of :func:`flash_jvp._ops.attn_fwd`; o_t and mu are empty without
    tangents."""
    from . import _ops  # imports triton: only where the kernels run

    spec = spec_of(scale, causal_offset, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    o, o_t, lse, mu = _ops.attn_fwd(q, k, v, q_t, k_t, v_t, mask, mask_t, spec)
    if o_t is None:
        return o, _no_tensor(o), lse, _no_tensor(lse)
    return o, o_t, lse, mu


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, q_t, k_t, v_t, mask, mask_t, scale, causal_offset, cu_seqlens_q,
                   cu_seqlens_k, max_seqlen_q, max_seqlen_k):  # fmt: skip
    o = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if cu_seqlens_q is not None:  # packed: (H, total_q)
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    if all(t is None for t in (q_t, k_t, v_t, mask_t)):
        return o, _no_tensor(o), lse, _no_tensor(lse)
    return o, q.new_empty(o.shape), lse, lse.new_empty(lse.shape)


@torch.library.custom_op("flash_jvp::attn_bwd", mutates_args=())
def attn_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    mask: Tensor | None,
    scale: float,
    causal_offset: int | None,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    mask_grad: bool,
    dlse: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dmask) of :func:`flash_jvp._ops.attn_bwd`; dmask is empty without
    ``mask_grad``."""
    from . import _ops

    spec = spec_of(scale, causal_offset, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dq, dk, dv, dmask = _ops.attn_bwd(do, q, k, v, o, lse, mask, spec, mask_grad, dlse)
    return dq, dk, dv, _no_tensor(q) if dmask is None else dmask


@attn_bwd.register_fake
def _attn_bwd_fake(do, q, k, v, o, lse, mask, scale, causal_offset, cu_seqlens_q, cu_seqlens_k,
                   max_seqlen_q, max_seqlen_k, mask_grad, dlse):  # fmt: skip
    dmask = mask.new_empty(mask.shape) if mask_grad else _no_tensor(q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask


_LIB.define(
    # SymInt: symbolic lengths (dynamic shapes, max_seqlen) pass without a guard per value
    "attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, SymInt? causal_offset, "
    "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k) "
    "-> (Tensor, Tensor)"
)


def _attention_autograd(keyset, q, k, v, mask, *spec):
    from . import _function

    if not _function.has_autograd_work(q, k, v, mask):
        # the op itself below autograd, so a graph traced for inference (AOTAutograd with
        # nothing requiring grad, torch.jit.trace) records this op rather than attn_fwd: run on
        # duals, that graph reaches this kernel again, which reads their tangents (attn_fwd's
        # custom_op autograd would drop them silently)
        after = keyset & torch._C._after_autograd_keyset
        return torch.ops.flash_jvp.attention.default.redispatch(after, q, k, v, mask, *spec)
    # torch 2.11 masks PythonTLSSnapshot here, so that a fake-tensor call from inside this
    # kernel reaches the Python key with no TLS snapshot ("tls_on_entry.has_value() INTERNAL
    # ASSERT FAILED"); let our calls take their own snapshot, as calls from user code do.
    exclude = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(
        torch._C._dispatch_tls_local_include_set(),
        exclude.remove(torch._C.DispatchKey.PythonTLSSnapshot),
    ):
        return _function.traced_attention(q, k, v, mask, spec_of(*spec))


def _attention_below_autograd(q, k, v, mask, *spec):
    o, _, lse, _ = fwd(q, k, v, None, None, None, mask, None, spec_of(*spec))
    return o, lse


def _attention_fake(q, k, v, mask, *spec):
    o, _, lse, _ = _attn_fwd_fake(q, k, v, None, None, None, mask, None, *spec)
    return o, lse


def _attention_vmap(info, in_dims, q, k, v, mask, *spec):
    """vmap folds the vmapped dim into the batch dim (varlen has none to fold into)."""
    from . import _function

    outs = _function.vmap_attention(info.batch_size, in_dims[:4], q, k, v, mask, spec_of(*spec))
    return outs, (0, 0)


_LIB.impl("attention", _attention_autograd, "Autograd", with_keyset=True)
_LIB.impl("attention", _attention_below_autograd, "CompositeExplicitAutograd")
torch.library.register_fake("flash_jvp::attention", _attention_fake, lib=_LIB)
torch.library.register_vmap("flash_jvp::attention", _attention_vmap, lib=_LIB)


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: Spec
) -> tuple[Tensor, Tensor]:
    """o and lse of ``flash_jvp::attention`` (q, k, v as the launchers take them, spec as the
    op's scalar arguments)."""
    return torch.ops.flash_jvp.attention(q, k, v, mask, *spec_args(spec))


@torch.library.custom_op("flash_jvp::attn_bwd_tangent", mutates_args=())
def attn_bwd_tangent(
    do: Tensor | None,
    do_t: Tensor | None,
    dlse: Tensor | None,
    dmu: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_t: Tensor | None,
    k_t: Tensor | None,
    v_t: Tensor | None,
    o: Tensor,
    o_t: Tensor | None,
    lse: Tensor,
    mu: Tensor | None,
    mask: Tensor | None,
    mask_t: Tensor | None,
    scale: float,
    causal_offset: int | None,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    mask_grad: bool,
    mask_t_grad: bool,
    tangent_grads: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dq_t, dk_t, dv_t, dmask, dmask_t) of
    :func:`flash_jvp._ops.attn_bwd_tangent`, the backward through o and o_t (and lse, mu);
    the ones it gives as None are empty."""
    from . import _ops

    spec = spec_of(scale, causal_offset, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    grads = _ops.attn_bwd_tangent(
        do, do_t, q, k, v, q_t, k_t, v_t, o, o_t, lse, mu, mask, mask_t, spec, dlse=dlse,
        dmu=dmu, mask_grad=mask_grad, mask_t_grad=mask_t_grad, tangent_grads=tangent_grads,
    )  # fmt: skip
    return tuple(_no_tensor(q) if g is None else g for g in grads)


@attn_bwd_tangent.register_fake
def _attn_bwd_tangent_fake(do, do_t, dlse, dmu, q, k, v, q_t, k_t, v_t, o, o_t, lse, mu, mask,
                           mask_t, scale, causal_offset, cu_seqlens_q, cu_seqlens_k,
                           max_seqlen_q, max_seqlen_k, mask_grad, mask_t_grad,
                           tangent_grads):  # fmt: skip
    given = tangent_bwd_outputs(q_t, k_t, v_t, mask_t, do_t, dmu, mask_grad, mask_t_grad,
                                 tangent_grads)  # fmt: skip
    likes = (q, k, v, q, k, v, mask, mask)
    return tuple(x.new_empty(x.shape) if g else _no_tensor(q) for x, g in zip(likes, given))


def attn_bwd_tangent_grads(
    do: Tensor | None,
    do_t: Tensor | None,
    dlse: Tensor | None,
    dmu: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_t: Tensor | None,
    k_t: Tensor | None,
    v_t: Tensor | None,
    o: Tensor,
    o_t: Tensor | None,
    lse: Tensor,
    mu: Tensor | None,
    mask: Tensor | None,
    mask_t: Tensor | None,
    spec: Spec,
    mask_grad: bool = False,
    mask_t_grad: bool = False,
    tangent_grads: bool = True,
) -> tuple[Tensor | None, ...]:
    """The ``attn_bwd_tangent`` op on a Spec; the outputs it leaves empty as None."""
    if _direct(spec, do, do_t, dlse, dmu, q, k, v, q_t, k_t, v_t, o, o_t, lse, mu, mask, mask_t):
        from . import _ops

        return _ops.attn_bwd_tangent(
            do, do_t, q, k, v, q_t, k_t, v_t, o, o_t, lse, mu, mask, mask_t, spec, dlse=dlse,
            dmu=dmu, mask_grad=mask_grad, mask_t_grad=mask_t_grad, tangent_grads=tangent_grads,
        )  # fmt: skip
    grads = attn_bwd_tangent(
        do, do_t, dlse, dmu, q, k, v, q_t, k_t, v_t, o, o_t, lse, mu, mask, mask_t,
        *spec_args(spec), mask_grad, mask_t_grad, tangent_grads,
    )  # fmt: skip
    given = tangent_bwd_outputs(q_t, k_t, v_t, mask_t, do_t, dmu, mask_grad, mask_t_grad,
                                 tangent_grads)  # fmt: skip
    return tuple(g if present else None for g, present in zip(grads, given))
