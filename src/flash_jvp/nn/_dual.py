"""Running an autograd.Function that computes outputs and their forward-mode tangents
together, at the level of the innermost forward-mode transform.

A fused layer's Function takes the primal inputs and their tangents as ordinary inputs and
returns (y, y_t); :func:`dual_apply` then attaches y_t to y as its tangent, at forward-AD
level 0 (``torch.autograd.forward_ad``) or at the level of an enclosing ``torch.func.jvp``
(unwrapping the inputs there and running the Function one level down, as
``flash_jvp._function.attention`` does for attention). Reverse mode through y and y_t is the
Function's backward.
"""

from __future__ import annotations

import torch
from torch._C._functorch import (
    TransformType,
    _wrap_for_grad,
    get_interpreter_stack,
    peek_interpreter_stack,
)

from .._function import apply_below, unwrap_level

Tensor = torch.Tensor


def fusable_context() -> bool:
    """Whether a fused layer may run its Function here: eagerly (torch.compile traces the
    plain-op path, which Inductor fuses itself and whose tangents it keeps: Dynamo drops an
    autograd.Function's ``jvp``; torch.jit.trace and dispatch modes such as fake tensors see
    plain ops too), with no torch.func transform or only one ``torch.func.jvp`` around the
    call (vmap, grad and nested jvp take the plain ops)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._get_tracing_state() is not None):  # fmt: skip
        return False
    stack = get_interpreter_stack()
    return not stack or (len(stack) == 1 and stack[0].key() == TransformType.Jvp)


def dual_apply(fn, primals: list, tangents: list, *consts):
    """``fn.apply(*primals, *tangents, *consts)`` -> (y, y_t, *rest) with y_t (None without
    tangents) made y's tangent at the innermost forward-mode level; returns y."""
    top = peek_interpreter_stack()
    if top is None:
        if all(t is None for t in tangents):
            return fn.apply(*primals, *tangents, *consts)[0]
        # the primals without their tangents: the Function gets those as inputs of its own
        primals = [None if x is None else torch._unpack_dual(x, 0)[0] for x in primals]
        y, y_t = fn.apply(*primals, *tangents, *consts)[:2]
        return torch._make_dual(y, y_t, 0)
    level = top.level()
    args = unwrap_level((*primals, *tangents), level)
    out = apply_below(top, fn.apply, *args, *consts)
    y, y_t = (None if x is None else _wrap_for_grad(x, level) for x in out[:2])
    return y if y_t is None else torch._make_dual(y, y_t, 0)


def reference_vjp(f, primals: list, tangents: list, need_p, need_t, dy, dy_t):
    """Gradients of (y, y_t) = (f(*primals), its JVP along ``tangents``) with cotangents
    (dy, dy_t), by reverse mode through ``f`` in plain ops and ``torch.func.jvp``: the
    backward through a fused layer's tangent, and any backward that builds a graph (then
    differentiable again). ``tangents[i]`` is None where primal i does not move; ``need_p``,
    ``need_t`` say which gradients to return (lists aligned with primals and tangents)."""
    create = torch.is_grad_enabled()

    def leaf(t, need):
        return t if t is None or create else t.detach().requires_grad_(need)

    with torch.enable_grad():
        ps = [leaf(p, n) for p, n in zip(primals, need_p)]
        ts = [leaf(t, n) for t, n in zip(tangents, need_t)]
        moving = [i for i, t in enumerate(ts) if t is not None]

        def g(*values):
            args = list(ps)
            for i, value in zip(moving, values):
                args[i] = value
            return f(*args)

        if moving:
            y, y_t = torch.func.jvp(g, tuple(ps[i] for i in moving), tuple(ts[i] for i in moving))
        else:
            y, y_t = g(), None
        outs = [(o, c) for o, c in ((y, dy), (y_t, dy_t)) if c is not None]
        inputs = ps + ts
        needs = list(need_p) + list(need_t)
        wanted = [t for t, n in zip(inputs, needs) if n and t is not None]
        grads = iter(torch.autograd.grad([o for o, _ in outs], wanted, [c for _, c in outs],
                                         allow_unused=True, create_graph=create))  # fmt: skip
        out = [next(grads) if n and t is not None else None for t, n in zip(inputs, needs)]
    return out[: len(ps)], out[len(ps) :]
