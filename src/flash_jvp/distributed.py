"""Context parallelism: attention over a sequence sharded across the ranks of a process group,
with forward-mode AD (JVP) and backward, over ``torch.distributed``.

Each rank passes its contiguous chunk of the sequence, in rank order, as ``(B, H, L_local, E)``
query, key and value (the same ``L_local`` on every rank), and gets back its chunk of the
output. Two algorithms:

* :func:`ulysses_attention` (DeepSpeed-Ulysses; Jacobs et al., arXiv:2309.14509): one
  all-to-all turns the sequence-sharded q, k, v into head-sharded full-length ones, each rank
  runs :func:`flash_jvp.attention` on its heads, one all-to-all brings o back. Needs the
  number of query heads divisible by the group size.
* :func:`ring_attention` (Liu et al., arXiv:2310.01889): K and V travel around the ring by
  point-to-point sends while each rank attends its queries to the block it holds; the
  per-block results are merged by their log-sum-exp. Any number of heads; causal attention
  is balanced over the ranks by zig-zag chunks.

Forward-mode tangents travel with their primals in the same collective (one all-to-all
carries q, k, v, q_t, k_t, v_t), so ``torch.func.jvp``, ``torch.autograd.forward_ad``,
reverse mode and both in one step (jvp, then backward through o, as in sCM/MeanFlow training)
work across ranks. :func:`context_parallel_sdpa` routes an unchanged model's
``F.scaled_dot_product_attention`` calls to either.

Which one. Ulysses moves, per rank and call, (P - 1) / P of its q, k, v and tangents and of o
and o_t, in two all-to-alls that need every pair of ranks connected (NVLink within a node),
and then runs one full-length flash_jvp call per rank (the kernels' best case; causal work
is balanced by construction); it needs Hq divisible by P. The ring moves each rank's K, V and
tangents P - 1 times to its neighbour only, overlapped with the blocks' compute (hidden when
a block of (L / P)^2 work outlasts moving L / P keys: long sequences), with Hkv heads (GQA
moves less); it takes any number of heads (P > Hq too) and slower links. Within a node with
Hq divisible by P, use Ulysses; for more ranks than heads, or across nodes at long L, the
ring.

Training with FSDP2 or DDP (torch 2.13, tested on CPU/gloo): ``fully_shard`` over the same
ranks works with ``torch.func.jvp`` (set the gradient divide factor to 1: each rank's loss
covers its own tokens); ``torch.autograd.forward_ad`` dual tensors fail inside FSDP2's
pre-forward hook (``RegisterPostBackwardFunction``: "returning a view ... the jvp is not
returning a view"). DDP works with ``forward_ad``; with ``torch.func.jvp`` its first step
works and the second fails in DDP's bucket rebuild (pytorch issues #182661, #102197). On torch
2.11, ``torch.func.jvp`` through FSDP2 fails (#182641). The failures are raised in torch's
hooks before any attention runs (``benchmarks/results/2026-12-02-cpu-jvp-through-fsdp2-ddp.txt``,
from ``cd tests && python distributed_workers.py wrappers``).

Every rank of the group must make the same calls in the same order, and every rank must
backpropagate through its output when one does (the backward's sends pair up across ranks).
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn import functional as F

from . import _validate, api
from ._exchange import AllToAll, Permute, RingShift, Stay, exchange, refuse_vmap
from ._utils import tangent, uses_kernels

Tensor = torch.Tensor

SEQ_LAYOUTS = ("contiguous", "head_tail")
_METHODS = ("ulysses", "ring")
_SDPA_OPTIONS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def ulysses_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: dist.ProcessGroup | dist.DeviceMesh | None = None,
    seq_layout: str = "contiguous",
    return_lse: bool = False,
    check_shards: bool = True,
    **sdpa_kwargs,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over a sequence sharded across ``group``, by all-to-all (DeepSpeed-Ulysses).

    Equal to ``flash_jvp.attention`` on the gathered sequence, each rank getting its chunk of
    the output. One ``all_to_all_single`` moves q, k, v and their forward-mode tangents
    together to head-sharded full-length tensors (rank r gets query heads
    ``[r Hq / P, (r + 1) Hq / P)``), :func:`flash_jvp.attention` runs on them, and one more
    brings o and o_t back. The backward runs the reverse all-to-alls (gradients of o, then of
    q, k, v). Communication per rank and call: ``(P - 1) / P`` of the local q, k, v (and
    tangents) out and of o (and o_t) back; independent of the ring's ``P - 1`` steps. Under
    autograd it keeps the head-sharded q, k, v and o (4 tensors of the local q chunk's size).
    The exchange packs its tensors into one send buffer and unpacks the received one, so
    while it runs a rank holds about three times the local q, k, v and tangents.

    Args:
        query: ``(B, Hq, L, E)``, this rank's contiguous chunk of the sequence (rank r holds
            positions ``[r L, (r + 1) L)``); ``Hq`` divisible by the group size P.
        key: ``(B, Hkv, S, E)``, this rank's chunk of the keys (global length ``P S``).
            With ``enable_gqa``, ``Hq`` a multiple of ``Hkv``; when ``Hkv`` is not a multiple
            of P, each key/value head is repeated ``P / gcd(Hkv, P)`` times before the
            all-to-all (more traffic, same result).
        value: ``(B, Hkv, S, Ev)``.
        group: the process group (None: the default group) or a 1-D ``DeviceMesh``. A group
            of one rank is allowed: the call is then ``flash_jvp.attention``.
        seq_layout: ``"contiguous"`` (default) or ``"head_tail"``: each rank's chunk is the
            two pieces ``r`` and ``2P - 1 - r`` of the sequence cut into ``2P`` (what
            ``torch.distributed.tensor.experimental.context_parallel`` hands to attention
            when it balances load); the output comes back in the same layout.
        return_lse: also return the log-sum-exp ``(B, Hq, L)`` of this rank's rows (through
            ``flash_jvp.attention_with_lse``; float32).
        check_shards: compare every rank's shapes, dtypes, tangent pattern and arguments
            first (one small all-gather, and on CUDA a host sync, per call); False skips it
            once they are known to agree (mismatched shards then fail inside the
            collectives, possibly by hanging).
        **sdpa_kwargs: ``is_causal`` (top-left, on the global sequence, as SDPA), ``scale``,
            ``enable_gqa``; ``attn_mask`` must be None and ``dropout_p`` 0.

    Returns:
        This rank's chunk of o, ``(B, Hq, L, Ev)`` (and the lse with ``return_lse``).

    Raises:
        TypeError: non-tensor inputs, unknown keyword arguments, ``group`` of another type.
        ValueError: shards that differ across ranks (shape, dtype, tangents, arguments),
            inputs that are not 4-D, ``Hq`` not divisible by P, a ``seq_layout`` other than
            the two, ``"head_tail"`` with an odd local length, torch.distributed not
            initialized, and what :func:`flash_jvp.attention` refuses.
        NotImplementedError: ``attn_mask``, ``dropout_p > 0``, ``torch.func.vmap``
            (``jacfwd``, ``jacrev``), and what :func:`flash_jvp.attention` refuses.
    """
    name = "ulysses_attention"
    group, opts = _prepare(name, query, key, value, group, seq_layout, return_lse,
                           check_shards, sdpa_kwargs)  # fmt: skip
    p = dist.get_world_size(group)
    if query.shape[1] % p:
        raise ValueError(
            f"{name}: query has {query.shape[1]} heads, not divisible by the group size {p}: "
            "Ulysses gives each rank Hq / P heads. Use ring_attention (any number of heads) "
            "or a group whose size divides the heads."
        )
    attend = _attention_with_lse if return_lse else api.attention
    if p == 1:
        return attend(query, key, value, **opts)
    key, value = _replicate_kv(key, value, p)
    q, k, v = exchange(AllToAll(group, to_heads=True), [query, key, value])
    reorder = seq_layout == "head_tail" and opts["is_causal"]
    if reorder:  # the causal mask needs the positions in order
        q, k, v = (_head_tail_to_natural(x, p) for x in (q, k, v))
    outs = attend(q, k, v, **opts)
    outs = list(outs) if return_lse else [outs]
    if reorder:
        outs = [_natural_to_head_tail(x, p) for x in outs]
    outs = exchange(AllToAll(group, to_heads=False), outs)
    return tuple(outs) if return_lse else outs[0]


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: dist.ProcessGroup | dist.DeviceMesh | None = None,
    seq_layout: str = "contiguous",
    return_lse: bool = False,
    check_shards: bool = True,
    **sdpa_kwargs,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over a sequence sharded across ``group``, by ring attention.

    Equal to ``flash_jvp.attention`` on the gathered sequence, each rank getting its chunk of
    the output. In ``P`` steps each rank attends its queries to the key/value block it holds
    (``flash_jvp.attention_with_lse``, which gives the block's o_b, lse_b and, under forward
    AD, their tangents) while K, V and their tangents move on to the next rank
    (``batch_isend_irecv``, overlapping the block's compute; the last step sends nothing).
    The blocks are merged by their log-sum-exp in plain torch ops, in float32:
    ``lse = logsumexp_b lse_b``, ``o = sum_b exp(lse_b - lse) o_b``, so forward AD and
    autograd differentiate the merge itself; rows no key reaches (lse = -inf) stay 0, not NaN.

    Causal attention is balanced by zig-zag chunks: the sequence is cut into ``2P`` pieces and
    rank r computes with pieces ``r`` and ``2P - 1 - r``, so every rank does the same work in
    every step. With ``seq_layout="contiguous"`` (the default) q, k, v (and tangents) are
    re-sharded into that layout by one point-to-point exchange before the ring and o (and
    o_t, lse) back after it: half of each rank's q, k, v and o cross the network once more,
    on top of the ring's ``P - 1`` key/value transfers (at P = 2 this doubles the traffic;
    pass ``seq_layout="head_tail"`` with inputs already in that layout, as torch's
    ``context_parallel`` shards them, to skip it). Non-causal calls need no re-sharding.

    Reverse mode differentiates through the rotations: the gradients of K and V travel back
    around the ring (each rotation's backward sends them to the previous rank, synchronously),
    which is the ring backward. It keeps what autograd saves: every key/value block this rank
    received (P - 1 of them: the whole K and V), each block's o_b and lse_b and the merge's
    weights, and when re-sharding the zig-zag q, k, v: about ``3P - 2`` tensors of the local
    q chunk's size (``3P + 1`` causal), where Ulysses keeps 4 and one GPU keeps o (P of
    them). Measured through the interpreter (tests' shapes, o_t held as an sCM step holds
    it): 4.6 / 11.1 local units at P = 2 / 4, causal 6.9 / 12.1; Ulysses 4.1. Without
    autograd (fwd + JVP under ``torch.no_grad`` or on inputs that do not require grad) each
    block is freed after its step.

    Args:
        query: ``(B, Hq, L, E)``, this rank's contiguous chunk of the sequence.
        key: ``(B, Hkv, S, E)``; with ``is_causal``, ``S == L`` (self-attention) and ``L``
            even (the two zig-zag pieces).
        value: ``(B, Hkv, S, Ev)``.
        group: the process group (None: the default group) or a 1-D ``DeviceMesh``. A group
            of one rank is allowed: the call is then ``flash_jvp.attention_with_lse``.
        seq_layout: ``"contiguous"`` or ``"head_tail"`` (see above and
            :func:`ulysses_attention`).
        return_lse: also return the log-sum-exp ``(B, Hq, L)`` of this rank's rows, float32
            (float64 for float64 inputs), -inf where a row sees no key.
        check_shards: as in :func:`ulysses_attention`.
        **sdpa_kwargs: ``is_causal``, ``scale``, ``enable_gqa``; ``attn_mask`` must be None
            and ``dropout_p`` 0.

    Returns:
        This rank's chunk of o, ``(B, Hq, L, Ev)`` (and the lse with ``return_lse``).

    Raises:
        As :func:`ulysses_attention`, except for the heads rule; ValueError for an odd local
        length with ``is_causal`` and NotImplementedError for causal cross-attention
        (``S != L``).
    """
    name = "ring_attention"
    group, opts = _prepare(name, query, key, value, group, seq_layout, return_lse,
                           check_shards, sdpa_kwargs)  # fmt: skip
    causal = opts["is_causal"]
    if causal and key.shape[2] != query.shape[2]:
        raise NotImplementedError(
            f"{name}: is_causal=True needs query and key chunks of the same length "
            f"(self-attention), but got query {tuple(query.shape)}, key {tuple(key.shape)}."
        )
    if causal and query.shape[2] % 2:
        raise ValueError(
            f"{name}: is_causal=True splits each rank's chunk into two zig-zag pieces, so the "
            f"local length must be even, but query has {query.shape[2]} positions "
            f"{tuple(query.shape)}; pad the global sequence to a multiple of 2 x the group "
            "size (and mask the padding out of the loss)."
        )
    p = dist.get_world_size(group)
    if p == 1:
        o, lse = _attention_with_lse(query, key, value, **opts)
        return (o, lse) if return_lse else o
    reshard = causal and seq_layout == "contiguous"
    q, k, v = query, key, value
    if reshard:
        q, k, v = exchange(Permute.zigzag(group), [q, k, v])
    o, lse = _ring(group, q, k, v, opts)
    outs = [o, lse] if return_lse else [o]
    # the merge's tangent computations hold autograd buffers as long as o_t lives, unless the
    # exchange back (or a local one) cuts them off
    outs = exchange(Permute.zigzag(group).adjoint() if reshard else Stay(), outs)
    return tuple(outs) if return_lse else outs[0]


def _ring(group, q: Tensor, k: Tensor, v: Tensor, opts: dict) -> tuple[Tensor, Tensor]:
    """The ring loop on q, k, v in the layout the blocks assume (zig-zag when causal):
    o in q's dtype and lse in the accumulation dtype, for this rank's rows.

    Without autograd the blocks are merged as they come (a running float32 (o, lse) per row
    segment, each block freed after its step); with autograd all at the end, so that the
    merge saves each block's o_b, which the block's attention saves anyway, instead of a
    float32 running sum per step."""
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    at_end = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    parts: dict[str, list[tuple[Tensor, Tensor]]] = {}  # row segment -> (o, lse) to merge
    kv = [k, v]
    for step in range(p):
        if step < p - 1:  # start sending this block on while computing with it
            shift = RingShift(group, deferred=True)
            incoming = exchange(shift, kv)
        for segment, o_b, lse_b in _block(q, *kv, (rank - step) % p, rank, opts):
            parts.setdefault(segment, []).append((o_b, lse_b))
            if not at_end:
                parts[segment] = [_merge(parts[segment], q.dtype)]
        if step < p - 1:
            shift.wait()
            kv = incoming
    merged = [_merge(parts[s], q.dtype) for s in (("lo", "hi") if opts["is_causal"] else ("all",))]
    o, lse = (torch.cat(x, dim=2) if len(x) > 1 else x[0] for x in zip(*merged))
    return o.to(q.dtype), lse


def _block(q: Tensor, k: Tensor, v: Tensor, src: int, rank: int, opts: dict) -> Iterator:
    """(row segment, o_b, lse_b) of this rank's queries against the key/value block of rank
    ``src``. Causal (zig-zag: rows and keys are pieces ``(r, 2P - 1 - r)`` of their ranks):
    the own block is causal; an earlier rank's first piece is seen by all rows, nothing of its
    second; a later rank's block only by the second half of the rows, entirely."""
    options = dict(opts, is_causal=False)
    if not opts["is_causal"]:
        yield ("all", *_attention_with_lse(q, k, v, **options))
        return
    c = q.shape[2] // 2
    if src > rank:
        yield ("hi", *_attention_with_lse(q[:, :, c:], k, v, **options))
        return
    if src == rank:
        o, lse = _attention_with_lse(q, k, v, **opts)
    else:
        o, lse = _attention_with_lse(q, k[:, :, :c], v[:, :, :c], **options)
    yield "lo", o[:, :, :c], lse[:, :, :c]
    yield "hi", o[:, :, c:], lse[:, :, c:]


def _merge(parts: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Blocks' (o_b, lse_b) over disjoint keys merged in float32 (float64 for float64
    inputs): lse = log sum_b e^lse_b, o = sum_b e^(lse_b - lse) o_b. Plain torch ops, so
    forward AD and autograd differentiate it; rows no block reached (every lse_b -inf) give
    lse -inf and o 0, with zero derivatives, not NaN."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if len(parts) == 1:
        return parts[0][0].to(acc), parts[0][1].to(acc)
    lse_b = torch.stack([lse.to(acc) for _, lse in parts])
    # any shift m gives the same result; the detached row max keeps exp() in range
    m = lse_b.amax(0).detach()
    m = m.masked_fill(m == -math.inf, 0.0)
    w = torch.exp(lse_b - m)
    total = w.sum(0)
    seen = total > 0
    total = torch.where(seen, total, 1.0)
    lse = torch.where(seen, m + torch.log(total), -math.inf)
    w = (w / total).unsqueeze(-1)
    o = sum(w[i] * o_b for i, (o_b, _) in enumerate(parts))  # float32: w's dtype wins
    return o, lse


def _attention_with_lse(query: Tensor, key: Tensor, value: Tensor, **opts):
    """``flash_jvp.attention_with_lse``, looked up when called."""
    import flash_jvp

    return flash_jvp.attention_with_lse(query, key, value, **opts)


def _replicate_kv(key: Tensor, value: Tensor, p: int) -> tuple[Tensor, Tensor]:
    """Key/value heads repeated so that their number is a multiple of P and each rank's query
    heads find their group's key/value head among its own (GQA with Hkv < P)."""
    repeat = p // math.gcd(key.shape[1], p)
    if repeat == 1:
        return key, value
    return key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)


def _head_tail_order(p: int) -> list[int]:
    """For i in the head-tail layout (rank i // 2, piece i % 2), the index of its piece in the
    natural order of the 2P pieces."""
    return [i // 2 if i % 2 == 0 else 2 * p - 1 - i // 2 for i in range(2 * p)]


def _head_tail_to_natural(x: Tensor, p: int) -> Tensor:
    order = _head_tail_order(p)
    c = x.shape[2] // (2 * p)
    at = {piece: i for i, piece in enumerate(order)}
    return torch.cat([x.narrow(2, at[piece] * c, c) for piece in range(2 * p)], dim=2)


def _natural_to_head_tail(x: Tensor, p: int) -> Tensor:
    c = x.shape[2] // (2 * p)
    return torch.cat([x.narrow(2, piece * c, c) for piece in _head_tail_order(p)], dim=2)


def shard_sequence(
    x: Tensor,
    dim: int,
    *,
    group: dist.ProcessGroup | dist.DeviceMesh | None = None,
    seq_layout: str = "contiguous",
) -> Tensor:
    """This rank's chunk of the full tensor ``x`` along ``dim`` (its length divisible by P,
    by 2P for ``"head_tail"``): contiguous chunk r, or pieces r and 2P - 1 - r of 2P.
    Plain slicing (differentiable in every mode); no communication."""
    group = _process_group("shard_sequence", group)
    _check_layout("shard_sequence", seq_layout)
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = p if seq_layout == "contiguous" else 2 * p
    if x.shape[dim] % parts:
        raise ValueError(
            f"shard_sequence: x has length {x.shape[dim]} along dim {dim} {tuple(x.shape)}, "
            f"not divisible by {parts} ({seq_layout!r} layout over {p} ranks)."
        )
    pieces = x.chunk(parts, dim)
    if seq_layout == "contiguous":
        return pieces[rank]
    return torch.cat([pieces[rank], pieces[2 * p - 1 - rank]], dim)


@contextlib.contextmanager
def context_parallel_sdpa(
    group: dist.ProcessGroup | dist.DeviceMesh | None = None,
    *,
    method: str = "ring",
    seq_layout: str = "contiguous",
    sharded: Callable[[Tensor, Tensor, Tensor], bool] | None = None,
    check_shards: bool = True,
) -> Iterator[None]:
    """Within the block, ``torch.nn.functional.scaled_dot_product_attention`` calls run as
    context-parallel attention over ``group``, for models whose other layers act per token.

    The caller shards the model's inputs (and tangents, and positional tensors) along the
    sequence, e.g. with :func:`shard_sequence` or torch's ``context_parallel`` (then
    ``seq_layout="head_tail"`` when its global length is a multiple of 2P, as it balances only
    then), and gathers the outputs. Each SDPA call for which ``sharded(query, key, value)``
    holds goes to :func:`ring_attention` or :func:`ulysses_attention` (``method``); the others
    (e.g. cross-attention to a text context every rank holds whole) go to
    :func:`flash_jvp.attention` on the local chunk. The default ``sharded`` takes calls whose
    key length equals the query's local length as sharded self-attention. Calls with an
    ``attn_mask`` or ``dropout_p > 0`` raise (a sharded sequence cannot be handed back to
    torch's SDPA, which would attend within the chunk only).

    Replaces the module attribute as :func:`flash_jvp.patch_sdpa` does (code that bound the
    function earlier keeps torch's); on exit the previous function is restored, if the
    attribute is still this router.

    Raises:
        ValueError: an unknown ``method`` or ``seq_layout``.
    """
    if method not in _METHODS:
        raise ValueError(
            f"context_parallel_sdpa: method must be one of {_METHODS}, got {method!r}."
        )
    _check_layout("context_parallel_sdpa", seq_layout)
    group = _process_group("context_parallel_sdpa", group)
    attention = ring_attention if method == "ring" else ulysses_attention
    sharded = _same_length if sharded is None else sharded
    from .integrations.sdpa import _sdpa_arguments

    def scaled_dot_product_attention(*args, **kwargs):
        """flash_jvp.distributed.context_parallel_sdpa's router."""
        q, k, v, options, extra = _sdpa_arguments(*args, **kwargs)
        if extra:
            raise TypeError(f"scaled_dot_product_attention got unexpected keywords {extra}.")
        if not sharded(q, k, v):
            return api.attention(q, k, v, **options)
        return attention(q, k, v, group=group, seq_layout=seq_layout,
                         check_shards=check_shards, **options)  # fmt: skip

    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        if F.scaled_dot_product_attention is scaled_dot_product_attention:
            F.scaled_dot_product_attention = previous


def _same_length(query: Tensor, key: Tensor, value: Tensor) -> bool:
    return key.shape[-2] == query.shape[-2]


# ----------------------------------------------------------------------------------------
# argument checks


def _prepare(name, query, key, value, group, seq_layout, return_lse, check_shards, kwargs):
    """The process group and SDPA options of a call, after every check. The arguments' own
    rules are checked first, but a refusal is raised only after the ranks have compared their
    calls (``check_shards``), so that a call one rank refuses raises on every rank (the others
    name that rank's refusal) instead of leaving them waiting in a collective."""
    refuse_vmap()  # the same on every rank (vmap wraps the program), and first: under vmap
    group = _process_group(name, group)  # the comparison below cannot read tangents
    try:
        opts = _sdpa_options(name, kwargs)
        _check_layout(name, seq_layout)
        for flag_name, flag in (("return_lse", return_lse), ("check_shards", check_shards)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected {flag_name} to be a bool, but got {flag!r}.")
        refused = None
    except (TypeError, ValueError, NotImplementedError) as err:
        refused, opts = err, dict.fromkeys(_SDPA_OPTIONS_COMPARED)
    if check_shards is not False:  # a non-bool check_shards is refused, after the comparison
        try:
            _check_shards(name, group, query, key, value, opts, seq_layout, return_lse, refused)
        except ValueError as disagreement:
            raise (refused or disagreement) from None
    if refused is not None:
        raise refused
    kernels = isinstance(query, Tensor) and uses_kernels(query.device)
    found = _validate.problems(query, key, value, None, 0.0, opts["is_causal"], opts["scale"],
                               opts["enable_gqa"], kernels)  # fmt: skip
    if found:
        exc_type, message = found[0]
        raise exc_type(f"{name}: {message}")
    for arg, x in (("query", query), ("key", key), ("value", value)):
        if x.dim() != 4:
            raise ValueError(
                f"{name}: expected {arg} to be 4-D (B, H, L_local, E), but got shape "
                f"{tuple(x.shape)}."
            )
        if x.shape[2] == 0:
            raise ValueError(f"{name}: {arg} has an empty sequence chunk {tuple(x.shape)}.")
    if seq_layout == "head_tail":
        for arg, x in (("query", query), ("key", key)):
            if x.shape[2] % 2:
                raise ValueError(
                    f"{name}: seq_layout='head_tail' holds two pieces per rank, so {arg}'s "
                    f"local length must be even, but got {tuple(x.shape)}."
                )
    return group, opts


def _sdpa_options(name: str, kwargs: dict) -> dict:
    unknown = sorted(set(kwargs) - set(_SDPA_OPTIONS))
    if unknown:
        raise TypeError(
            f"{name}: unexpected keyword arguments {unknown}; takes SDPA's {_SDPA_OPTIONS} and "
            "group, seq_layout, return_lse, check_shards."
        )
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError(
            f"{name}: attn_mask is not supported (a mask over the sharded sequence would need "
            "sharding too); is_causal is."
        )
    dropout_p = kwargs.get("dropout_p", 0.0)
    if dropout_p != 0.0:
        raise NotImplementedError(f"{name}: dropout_p must be 0.0, but got {dropout_p!r}.")
    return {
        "is_causal": kwargs.get("is_causal", False),
        "scale": kwargs.get("scale"),
        "enable_gqa": kwargs.get("enable_gqa", False),
    }


def _check_layout(name: str, seq_layout) -> None:
    if seq_layout not in SEQ_LAYOUTS:
        raise ValueError(f"{name}: seq_layout must be one of {SEQ_LAYOUTS}, got {seq_layout!r}.")


def _process_group(name: str, group) -> dist.ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"{name}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first (torchrun sets up its environment)."
        )
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"{name}: group must be a 1-D DeviceMesh, but got one with {group.ndim} dims "
                f"{group.mesh_dim_names}; pass its context-parallel dim, e.g. mesh['cp']."
            )
        return group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{name}: group must be a ProcessGroup, a 1-D DeviceMesh or None, but got "
            f"{type(group).__name__}."
        )
    if dist.get_rank(group) < 0:
        raise ValueError(f"{name}: this rank ({dist.get_rank()}) is not a member of group.")
    return group


_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


_SDPA_OPTIONS_COMPARED = ("is_causal", "scale", "enable_gqa")


def _signature(name, query, key, value, opts, seq_layout, return_lse, refused) -> dict:
    """What every rank must agree on, as numbers: shapes, dtypes, devices' types, which
    inputs carry forward-mode tangents, the arguments, and whether the rank refused its
    arguments (``refused``: the exception, or None)."""

    def shape(x):
        return tuple(x.shape) if isinstance(x, Tensor) else ("not a tensor",)

    def dtype(x):
        return str(x.dtype) if isinstance(x, Tensor) else "-"

    scale = opts["scale"]
    sig = {"function": name, "seq_layout": seq_layout, "return_lse": return_lse}
    sig["refusal"] = None if refused is None else f"{type(refused).__name__}: {refused}"
    for arg, x in (("query", query), ("key", key), ("value", value)):
        sig[f"{arg}.shape"] = shape(x)
        sig[f"{arg}.dtype"] = dtype(x)
        sig[f"{arg}.device type"] = x.device.type if isinstance(x, Tensor) else "-"
        sig[f"{arg} has a forward-mode tangent"] = tangent(x) is not None
    sig["is_causal"] = opts["is_causal"]
    sig["scale"] = scale if isinstance(scale, numbers.Real) or scale is None else repr(scale)
    sig = {k: list(v) if isinstance(v, tuple) else v for k, v in sig.items()}  # as JSON reads
    sig["enable_gqa"] = opts["enable_gqa"]
    return sig


def _check_shards(name, group, query, key, value, opts, seq_layout, return_lse, refused) -> None:
    """Raise ValueError on every rank if the ranks' calls disagree (one all-gather of a
    small byte tensor on query's device)."""
    sig = _signature(name, query, key, value, opts, seq_layout, return_lse, refused)
    data = json.dumps(sig, default=repr).encode()
    device = query.device if isinstance(query, Tensor) else torch.device("cpu")
    p = dist.get_world_size(group)
    if p == 1:
        return
    lengths = _all_gather(torch.tensor([len(data)], device=device), group)
    width = max(int(n) for n in lengths)
    mine = torch.zeros(width, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8, device=device)
    rows = _all_gather(mine, group)
    texts = [bytes(r[: int(n)].tolist()).decode() for r, n in zip(rows, lengths)]
    if all(t == texts[0] for t in texts):
        return
    sigs = [json.loads(t) for t in texts]
    for field in sigs[dist.get_rank(group)]:
        values = [s.get(field) for s in sigs]
        if any(x != values[0] for x in values):
            per_rank = ", ".join(f"rank {i}: {x!r}" for i, x in enumerate(values))
            raise ValueError(
                f"{name}: the ranks of the group disagree on {field} ({per_rank}). Every rank "
                "must pass its chunk of the same global sequence, all chunks of the same shape "
                "(pad the global sequence to a multiple of the group size), with the same "
                "dtypes, the same inputs carrying tangents and the same arguments."
            )


def _all_gather(x: Tensor, group) -> list[Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return [o.cpu() for o in out]
