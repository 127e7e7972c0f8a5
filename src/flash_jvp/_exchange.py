"""Moving tensors between the ranks of a process group as a differentiable op that carries
forward-mode tangents in the same collective.

A route is a fixed permutation of data across the ranks (which rank sends which slice where):
a linear map, so its JVP is the same route applied to the tangents and its backward is the
inverse permutation (its adjoint). :func:`exchange` sends a list of tensors through a route
together with their forward-mode tangents: the tangents are read off the inputs (as
``flash_jvp.attention`` reads them) and packed with the primals into one byte buffer, so
q, k, v, q_t, k_t, v_t cost one collective, not six.

Two routes:

* :class:`AllToAll`: Ulysses' exchange, ``(B, H, L, ...)`` sequence-sharded to
  ``(B, H / P, P * L, ...)`` head-sharded (``all_to_all_single``), or back.
* :class:`RingShift`: every tensor one rank on around the ring by point-to-point
  (``batch_isend_irecv``), completion deferred so that the ring's compute overlaps it.
* :class:`Permute`: pieces of the sequence dim moved between ranks by point-to-point: the
  zig-zag re-sharding of causal ring attention.

Outputs are fresh tensors, never views of a shared receive buffer: forward AD copies the
tangent of a primal that is a view when it makes the dual, which would copy data that a
deferred receive has not written yet.

The sequence dim is dim 2 of every tensor (``(B, H, L, E)`` and the log-sum-exp ``(B, H, L)``).
Every rank must call the same routes with tensors of the same shapes, dtypes and tangent
pattern, in the same order (the callers check this, see ``distributed._check_shards``).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch._C._functorch import (
    TransformType,
    _wrap_for_grad,
    get_interpreter_stack,
    peek_interpreter_stack,
)
from torch.autograd.function import once_differentiable

from ._function import apply_below, unwrap_level
from ._utils import tangent

Tensor = torch.Tensor

_ALIGN = 16  # bytes: every packed segment starts 16-byte aligned (dtype views, TMA loads)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * dtype.itemsize


def _unpack(buf: Tensor, likes: list[tuple[torch.Size, torch.dtype]]) -> list[Tensor]:
    """Views of the uint8 ``buf`` as consecutive tensors of the given shapes and dtypes, each
    starting 16-byte aligned."""
    out, at = [], 0
    for shape, dtype in likes:
        n = _nbytes(shape, dtype)
        out.append(buf[at : at + n].view(dtype).view(shape))
        at += _padded(n)
    return out


def _buffer(likes: list[tuple[torch.Size, torch.dtype]], device, rows: tuple = ()) -> Tensor:
    """An uninitialised uint8 buffer ``(*rows, bytes)`` for tensors laid out by
    :func:`_unpack` (in each row)."""
    nbytes = sum(_padded(_nbytes(*like)) for like in likes)
    return torch.empty(*rows, nbytes, dtype=torch.uint8, device=device)


def _pack(pieces: list[Tensor], device: torch.device) -> Tensor:
    """One uint8 buffer holding ``pieces`` as :func:`_unpack` reads them (one strided copy
    each)."""
    likes = [(p.shape, p.dtype) for p in pieces]
    buf = _buffer(likes, device)
    for view, p in zip(_unpack(buf, likes), pieces):
        view.copy_(p)
    return buf


class AllToAll:
    """Ulysses' all-to-all over ``group`` (P ranks).

    ``to_heads=True``: ``(B, H, L, ...)`` holding this rank's sequence chunk of every head ->
    ``(B, H / P, P * L, ...)`` holding the whole sequence of this rank's heads (rank r gets
    heads ``[r H / P, (r + 1) H / P)``, the chunks in rank order). ``to_heads=False`` is the
    inverse. One ``all_to_all_single`` for all tensors, whatever their dtypes.
    """

    def __init__(self, group: dist.ProcessGroup, to_heads: bool):
        self.group, self.to_heads = group, to_heads
        self.size = dist.get_world_size(group)

    def adjoint(self) -> AllToAll:
        return AllToAll(self.group, not self.to_heads)

    def fresh(self) -> AllToAll:
        return self

    def __call__(self, xs: list[Tensor]) -> list[Tensor]:
        p = self.size
        # per tensor (P, ...): row j goes to rank j
        if self.to_heads:
            rows = [x.unflatten(1, (p, x.shape[1] // p)).movedim(1, 0) for x in xs]
        else:
            rows = [x.unflatten(2, (p, x.shape[2] // p)).movedim(2, 0) for x in xs]
        likes = [(r.shape[1:], r.dtype) for r in rows]
        send = _buffer(likes, xs[0].device, rows=(p,))
        for view, r in zip(_row_views(send, likes), rows):
            view.copy_(r)  # one strided copy per tensor
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        del send
        out = []
        for got in _row_views(recv, likes):  # (P, B, H/P, L, ...) from the P ranks
            if self.to_heads:  # -> (B, H/P, P*L, ...)
                out.append(got.movedim(0, 2).flatten(2, 3))
            else:  # (P, B, H/P, L/P, ...) -> (B, H, L/P, ...)
                out.append(got.movedim(0, 1).flatten(1, 2))
        return out


def _row_views(buf: Tensor, likes) -> list[Tensor]:
    """Views ``(P, *shape)`` of the rows of the uint8 ``buf`` (P, bytes), laid out as
    :func:`_unpack` lays out one row."""
    out, at = [], 0
    for shape, dtype in likes:
        n = _nbytes(shape, dtype)
        out.append(buf[:, at : at + n].view(dtype).unflatten(1, shape))
        at += _padded(n)
    return out


class RingShift:
    """Every tensor moves one rank on around the ring of ``group``: rank r sends to rank
    r + ``step`` and receives from r - ``step`` (mod P), one point-to-point message per tensor
    (``batch_isend_irecv``: coalesced on NCCL; tagged by position on gloo). The outputs are
    fresh contiguous tensors. With ``deferred`` the call returns once the transfers are
    started: call :meth:`wait` before reading the outputs (the ring computes meanwhile)."""

    def __init__(self, group: dist.ProcessGroup, step: int = 1, deferred: bool = False):
        self.group, self.step, self.deferred = group, step, deferred
        self._pending: list = []

    def adjoint(self) -> RingShift:
        return RingShift(self.group, -self.step)

    def fresh(self) -> RingShift:
        """The same route as a new, synchronous instance (for the backward and the JVP)."""
        return RingShift(self.group, self.step)

    def __call__(self, xs: list[Tensor]) -> list[Tensor]:
        p, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        to = _global(self.group, (rank + self.step) % p)
        frm = _global(self.group, (rank - self.step) % p)
        out = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
        ops = [dist.P2POp(dist.isend, x.contiguous(), to, tag=i) for i, x in enumerate(xs)]
        ops += [dist.P2POp(dist.irecv, o, frm, tag=i) for i, o in enumerate(out)]
        # the ops hold the send buffers (copies of non-contiguous inputs) until the wait
        self._pending = [ops, dist.batch_isend_irecv(ops)]
        if not self.deferred:
            self.wait()
        return out

    def wait(self) -> None:
        """Block until this rank's sends and receives of the last call are complete (on CUDA:
        make the current stream wait for them)."""
        if self._pending:
            for request in self._pending[1]:
                request.wait()
        self._pending = []


class Permute:
    """Equal pieces of the sequence dim (dim 2) moved between the ranks of ``group`` by
    point-to-point sends.

    Every rank holds ``slots`` pieces of each tensor's dim 2. Piece ``g`` of the global
    sequence (``0 <= g < slots * P``) is held at ``src[g] = (rank, slot)`` and goes to
    ``dst[g]``. Pieces sent between the same two ranks travel in one message (all tensors
    packed); pieces that stay are copied locally.
    """

    def __init__(self, group, slots: int, src: list[tuple[int, int]], dst: list[tuple[int, int]]):
        self.group, self.slots, self.src, self.dst = group, slots, src, dst
        self.rank = dist.get_rank(group)

    @classmethod
    def zigzag(cls, group) -> Permute:
        """Contiguous chunks (rank r holds pieces 2r, 2r + 1 of 2P) -> zig-zag chunks (rank r
        holds pieces r and 2P - 1 - r), which balance causal attention over the ranks."""
        p = dist.get_world_size(group)
        dst = [(g, 0) if g < p else (2 * p - 1 - g, 1) for g in range(2 * p)]
        return cls(group, 2, [(g // 2, g % 2) for g in range(2 * p)], dst)

    def adjoint(self) -> Permute:
        return Permute(self.group, self.slots, self.dst, self.src)

    def fresh(self) -> Permute:
        return self

    def _piece(self, x: Tensor, slot: int) -> Tensor:
        n = x.shape[2] // self.slots
        return x.narrow(2, slot * n, n)

    def __call__(self, xs: list[Tensor]) -> list[Tensor]:
        outgoing, incoming = defaultdict(list), defaultdict(list)  # peer -> [piece ids]
        out = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
        for g, ((s_rank, s_slot), (d_rank, d_slot)) in enumerate(zip(self.src, self.dst)):
            if s_rank == self.rank == d_rank:
                for o, x in zip(out, xs):
                    self._piece(o, d_slot).copy_(self._piece(x, s_slot))
            elif s_rank == self.rank:
                outgoing[d_rank].append(g)
            elif d_rank == self.rank:
                incoming[s_rank].append(g)
        device = xs[0].device
        ops, received = [], []
        for peer, ids in outgoing.items():
            pieces = [self._piece(x, self.src[g][1]) for g in ids for x in xs]
            ops.append(dist.P2POp(dist.isend, _pack(pieces, device), _global(self.group, peer)))
        for peer, ids in incoming.items():
            likes = [(self._piece(x, 0).shape, x.dtype) for _ in ids for x in xs]
            buf = _buffer(likes, device)
            ops.append(dist.P2POp(dist.irecv, buf, _global(self.group, peer)))
            received.append((ids, buf, likes))
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()
        for ids, buf, likes in received:
            views = iter(_unpack(buf, likes))
            for g in ids:
                for o in out:
                    self._piece(o, self.dst[g][1]).copy_(next(views))
        return out


class Stay:
    """The route that moves nothing (a copy on this rank). Through :func:`exchange` it gives
    tensors whose forward-mode tangents have no autograd graph of their own: what computed
    them (e.g. the ring's merge, in plain ops) is freed at once instead of living as long as
    the tangent (until after the backward in an sCM step)."""

    def __call__(self, xs: list[Tensor]) -> list[Tensor]:
        return [x.clone() for x in xs]

    def adjoint(self) -> Stay:
        return self

    def fresh(self) -> Stay:
        return self


def _global(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (what P2POp takes on every torch)."""
    return dist.get_global_rank(group, group_rank)


class _Exchange(torch.autograd.Function):
    """outputs = route(inputs), where the inputs are primals followed by the forward-mode
    tangents of ``primals[i] for i in has_t`` (:func:`exchange` attaches those outputs to the
    primal outputs as their tangents). Backward: the adjoint route on the incoming
    gradients."""

    @staticmethod
    def forward(route, has_t: tuple[int, ...], *xs):
        return tuple(route(list(xs)))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.route, ctx.n = inputs[0], len(inputs) - 2 - len(inputs[1])
        ctx.set_materialize_grads(False)
        ctx.save_for_forward(*inputs[2:])

    @staticmethod
    def jvp(ctx, _route_t, _has_t_t, *xs_t):
        """Tangents the forward did not carry (e.g. a forward-mode transform below a
        ``torch.func.grad``): a second exchange. Missing ones are zeros (autograd refuses a
        None here)."""
        xs = ctx.saved_tensors
        present = [i for i, t in enumerate(xs_t) if t is not None]
        moved = dict(zip(present, ctx.route.fresh()([xs_t[i] for i in present]))) if present else {}
        out = []
        for i, x in enumerate(xs):
            out.append(moved[i] if i in moved else x.new_zeros(()).expand(x.shape))
        return tuple(out)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        if any(g is not None for g in grads[ctx.n :]):
            raise NotImplementedError(_NO_TANGENT_GRAD)
        present = [i for i, g in enumerate(grads) if g is not None]
        out: list[Tensor | None] = [None] * len(grads)
        if present:
            for i, g in zip(present, ctx.route.adjoint()([grads[i] for i in present])):
                out[i] = g
        return (None, None, *out)


_NO_TANGENT_GRAD = (
    "flash_jvp.distributed: backpropagating through a forward-mode tangent (o_t) is not "
    "supported; detach it in the loss (as sCM/MeanFlow losses do: o_t.detach())."
)


def refuse_vmap() -> None:
    """NotImplementedError under torch.func.vmap: a collective cannot be batched."""
    if any(i.key() == TransformType.Vmap for i in get_interpreter_stack() or []):
        raise NotImplementedError(
            "flash_jvp.distributed: torch.func.vmap (also jacfwd, jacrev) over a collective "
            "is not supported; use torch.func.jvp / vjp / grad or forward_ad."
        )


def exchange(route, xs: list[Tensor]) -> list[Tensor]:
    """``route`` applied to ``xs`` and, in the same collective, to their forward-mode tangents
    (``torch.func.jvp`` or ``torch.autograd.forward_ad``); the results carry the moved
    tangents. Differentiable in reverse mode (the backward runs the inverse route).

    The tangents are taken off the inputs and passed to the Function as inputs of their own,
    and its outputs are made duals again here (as ``flash_jvp.attention`` does): under
    ``torch.func.jvp`` one level down, the tensors unwrapped from the transform's level and
    wrapped again; under ``forward_ad``, with the primals' plain values. The tangents go in
    detached: a gradient reaching a moved tangent raises NotImplementedError (as through
    flash_jvp's o_t), and autograd does not walk the tangents' own graphs with empty
    gradients (which also fails where torch's forward-AD formulas wrote in place, e.g.
    ``logsumexp`` under ``forward_ad``). ``vmap`` (and so ``jacfwd``/``jacrev``) is refused.
    """
    refuse_vmap()
    n = len(xs)
    tangents = [tangent(x) for x in xs]
    has_t = tuple(i for i, t in enumerate(tangents) if t is not None)
    moved = [tangents[i] for i in has_t]
    top = peek_interpreter_stack()
    if top is None or top.key() != TransformType.Jvp:
        primals = [x if t is None else torch._unpack_dual(x, 0)[0] for x, t in zip(xs, tangents)]
        outs = _Exchange.apply(route, has_t, *primals, *(t.detach() for t in moved))
        result = list(outs[:n])
        for j, i in enumerate(has_t):
            result[i] = torch._make_dual(result[i], outs[n + j], 0)
        return result
    level = top.level()
    args = unwrap_level((*xs, *moved), level)
    outs = apply_below(top, lambda: _Exchange.apply(route, has_t, *args[:n],
                                                    *(t.detach() for t in args[n:])))  # fmt: skip
    result = [_wrap_for_grad(o, level) for o in outs[:n]]
    for j, i in enumerate(has_t):
        result[i] = torch._make_dual(result[i], _wrap_for_grad(outs[n + j], level), 0)
    return result
