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
import torch.autograd.forward_ad as fwAD
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
            y, y_t = _jvp(g, [ps[i] for i in moving], [ts[i] for i in moving])
        else:
            y, y_t = g(), None
        # an output that depends on nothing requiring grad (y where only tangents do) has
        # no graph: it contributes nothing
        outs = [(o, c) for o, c in ((y, dy), (y_t, dy_t))
                if c is not None and o is not None and o.requires_grad]  # fmt: skip
        inputs = ps + ts
        needs = [n and t is not None for t, n in zip(inputs, [*need_p, *need_t])]
        wanted = [t for t, n in zip(inputs, needs) if n]
        grads = iter(torch.autograd.grad([o for o, _ in outs], wanted, [c for _, c in outs],
                                         allow_unused=True, create_graph=create)
                     if outs and wanted else ())  # fmt: skip
        out = [next(grads, None) if n else None for n in needs]
    return out[: len(ps)], out[len(ps) :]


def _jvp(g, primals: list, tangents: list):
    """(g(*primals), its JVP along tangents), differentiable in both: torch.func.jvp; inside
    a ``torch.autograd.forward_ad.dual_level`` (where torch.func.jvp would open a second
    forward-AD level, which torch refuses, and duals made at that level reach backward
    formulas without forward-AD support, e.g. silu_backward) by reverse mode twice: u ->
    J^T u is linear in u, so its vector-Jacobian product along the tangents is J t."""
    if fwAD._current_level < 0:
        return torch.func.jvp(g, tuple(primals), tuple(tangents))
    # a primal without grad (its gradient is not wanted) becomes a leaf that has one
    xs = [p if p.requires_grad else p.detach().requires_grad_() for p in primals]
    y = g(*xs)
    u = torch.zeros_like(y, requires_grad=True)
    vjps = torch.autograd.grad(y, xs, u, create_graph=True, allow_unused=True)
    pairs = [(v, t) for v, t in zip(vjps, tangents) if v is not None and v.requires_grad]
    if not pairs:  # y does not move with the primals: no tangent (the caller drops it)
        return y, None
    (y_t,) = torch.autograd.grad([v for v, _ in pairs], u, [t for _, t in pairs],
                                 create_graph=True, allow_unused=True)  # fmt: skip
    return y, y_t
