"""Jobs that tests/test_distributed.py runs in several processes (gloo, CPU).

Each job runs many checks in one set of processes (start-up costs seconds on two cores), on
every rank, and rank 0 compares the gathered results with single-process flash_jvp on the
whole sequence and with the float64 oracle, by the accuracy rule of ``flash_jvp._check``.
A job collects its failures and raises one AssertionError listing them all.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lse_reference import attention_with_lse_ref

NAMES = ("o", "o_t", "lse", "mu", "dq", "dk", "dv")
GROUPS = (("o", "o_t"), ("lse", "mu"), ("dq", "dk", "dv"))


def spawn(world: int, job: str, *args, interpret: bool = False, backend: str = "gloo") -> None:
    """Run ``job`` (a function of this module) on ``world`` processes; TRITON_INTERPRET is
    set for the children (it is read when flash_jvp is imported). With ``backend="nccl"``
    rank r uses cuda:r."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            store = os.path.join(tmp, "store")
            try:
                mp.spawn(_entry, (world, store, backend, job, args), nprocs=world)
            except mp.ProcessExitedException:
                # a signal after every rank passed its checks: gloo's teardown (below)
                if not all(os.path.exists(f"{store}.passed{r}") for r in range(world)):
                    raise
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def _entry(rank: int, world: int, store: str, backend: str, job: str, args) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world,
        timeout=timedelta(seconds=300),
    )  # fmt: skip
    try:
        failures = globals()[job](*args)
        if failures:
            raise AssertionError(f"rank {rank}, {len(failures)} failed:\n" + "\n".join(failures))
        # every rank done before any tears down: a rank leaving while its peer's last gloo
        # transfer is in flight aborted that peer now and then (SIGABRT, 1 run in ~10); it
        # still did at times after the barrier ("terminate called without an active
        # exception", torch 2.11 CPU, 2026-12-04), so a rank marks its checks passed first
        dist.barrier()
        open(f"{store}.passed{rank}", "w").close()
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# helpers


def gather_seq(x: torch.Tensor, seq_layout: str = "contiguous", dim: int = 2) -> torch.Tensor:
    """The whole sequence (along ``dim``) from every rank's chunk, in natural order."""
    p = dist.get_world_size()
    parts = [torch.empty_like(x) for _ in range(p)]
    dist.all_gather(parts, x.detach().contiguous())
    if seq_layout == "contiguous":
        return torch.cat(parts, dim=dim)
    halves = [h for part in parts for h in part.chunk(2, dim=dim)]  # head-tail: r, 2P - 1 - r
    natural = [None] * (2 * p)
    for r in range(p):
        natural[r], natural[2 * p - 1 - r] = halves[2 * r], halves[2 * r + 1]
    return torch.cat(natural, dim=dim)


def run_all(fn, q, k, v, tangents, do, dlse=None) -> dict[str, torch.Tensor]:
    """o, o_t (torch.func.jvp of fn) and the gradients of sum(o do); with ``dlse``, fn returns
    (o, lse), and lse, mu and the gradients of sum(o do) + sum(lse dlse) are taken."""
    out, out_t = torch.func.jvp(fn, (q, k, v), tangents)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    outs = fn(*leaves)
    if dlse is None:
        dq, dk, dv = torch.autograd.grad(outs, leaves, do)
        return dict(o=out, o_t=out_t, dq=dq, dk=dk, dv=dv)
    dq, dk, dv = torch.autograd.grad(outs, leaves, (do, dlse))
    return dict(o=out[0], o_t=out_t[0], lse=out[1], mu=out_t[1], dq=dq, dk=dk, dv=dv)


def _rms(t: torch.Tensor) -> float:
    t = t.double()
    t = torch.where(torch.isfinite(t), t, 0.0)
    return t.norm().item() / math.sqrt(max(t.numel(), 1))


def rel_err(x: torch.Tensor, ref: torch.Tensor, scale_rms: float) -> float:
    """flash_jvp._check.rel_err, with -inf entries (lse of rows that see no key) required to
    match exactly and left out of the norm."""
    from flash_jvp import _check

    x, ref = x.detach().double(), ref.detach().double()
    inf = torch.isinf(ref)
    if not torch.equal(torch.isinf(x), inf) or not torch.equal(x[inf], ref[inf]):
        return math.inf
    return _check.rel_err(x.masked_fill(inf, 0), ref.masked_fill(inf, 0), scale_rms)


def compare(ours: dict, single: dict, ref64: dict, dtype: torch.dtype, context: str) -> list[str]:
    """The accuracy rule: rel_err(ours) <= RTOL * rel_err(single-process flash_jvp in the same
    dtype) + FLOOR[dtype], both against the float64 oracle."""
    from flash_jvp import _check

    out = []
    for group in GROUPS:
        group = [n for n in group if n in ours]
        if not group:
            continue
        scale = max(_rms(ref64[n]) for n in group)
        for name in group:
            yard = rel_err(single[name], ref64[name], scale)
            yard = 0.0 if not math.isfinite(yard) else yard
            err = rel_err(ours[name], ref64[name], scale)
            tol = _check.RTOL * yard + _check.floor(dtype)
            if not err <= tol:
                out.append(f"{context}: {name} rel err {err:.3e} > tol {tol:.3e} "
                           f"(single-process {yard:.2e})")  # fmt: skip
    return out


@dataclass
class Case:
    method: str
    causal: bool
    dtype: torch.dtype
    hq: int = 4
    hkv: int = 4
    lq: int = 8  # local lengths
    lk: int = 8
    seq_layout: str = "contiguous"
    scale: float | None = None
    b: int = 2
    e: int = 8
    lse: bool = True  # return_lse (else o alone: flash_jvp.attention's path in Ulysses)
    device: str = "cpu"  # "cuda": this rank's GPU

    def __str__(self) -> str:
        return (f"{self.method} causal={self.causal} {self.dtype} Hq={self.hq} Hkv={self.hkv} "
                f"L={self.lq}/{self.lk} {self.seq_layout} scale={self.scale} "
                f"lse={self.lse}")  # fmt: skip


def _global_inputs(case: Case, p: int, seed: int):
    """The same global q, k, v, tangents and cotangents on every rank."""
    g = torch.Generator().manual_seed(seed)

    device = torch.device("cuda", torch.cuda.current_device()) if case.device == "cuda" else "cpu"

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device, case.dtype)

    lq, lk = case.lq * p, case.lk * p
    q, q_t = randn(case.b, case.hq, lq, case.e), randn(case.b, case.hq, lq, case.e)
    k, k_t = randn(case.b, case.hkv, lk, case.e), randn(case.b, case.hkv, lk, case.e)
    v, v_t = randn(case.b, case.hkv, lk, case.e), randn(case.b, case.hkv, lk, case.e)
    do, dlse = randn(case.b, case.hq, lq, case.e), randn(case.b, case.hq, lq)
    return q, k, v, (q_t, k_t, v_t), do, dlse


def check_case(case: Case, seed: int) -> list[str]:
    """One call of ring/ulysses attention against single-process flash_jvp on rank 0."""
    import flash_jvp
    from flash_jvp import distributed as D

    p = dist.get_world_size()
    q, k, v, tangents, do, dlse = _global_inputs(case, p, seed)
    opts = dict(is_causal=case.causal, scale=case.scale, enable_gqa=case.hq != case.hkv)
    fn = D.ring_attention if case.method == "ring" else D.ulysses_attention

    def shard(x):
        return D.shard_sequence(x, 2, seq_layout=case.seq_layout)

    dlse = dlse if case.lse else None

    def dist_fn(q, k, v):
        return fn(q, k, v, return_lse=case.lse, seq_layout=case.seq_layout, **opts)

    local = run_all(dist_fn, *(shard(x) for x in (q, k, v)), tuple(shard(t) for t in tangents),
                    shard(do), None if dlse is None else shard(dlse))  # fmt: skip
    ours = {n: gather_seq(t, case.seq_layout) for n, t in local.items()}
    if dist.get_rank() != 0:
        return []

    def single_fn(q, k, v):
        if case.lse:
            return flash_jvp.attention_with_lse(q, k, v, **opts)
        return flash_jvp.attention(q, k, v, **opts)

    def ref_fn(q, k, v):
        o, lse = attention_with_lse_ref(q, k, v, **opts)
        return (o, lse) if case.lse else o

    single = run_all(single_fn, q, k, v, tangents, do, dlse)
    d64 = [x.double() for x in (q, k, v)]
    ref64 = run_all(ref_fn, *d64, tuple(t.double() for t in tangents), do.double(),
                    None if dlse is None else dlse.double())  # fmt: skip
    return compare(ours, single, ref64, case.dtype, str(case))


def run_cases(cases: list[Case]) -> list[str]:
    failures = []
    for i, case in enumerate(cases):
        try:
            failures += check_case(case, seed=1000 + i)
        except Exception:  # noqa: BLE001 - reported with the case, the job fails at the end
            failures.append(f"{case}: raised\n{traceback.format_exc()}")
            raise
    return failures


# ----------------------------------------------------------------------------------------
# jobs


def job_equality(cases: list[Case], kernels: bool) -> list[str]:
    """The cases, after checking that flash_jvp runs the path the test means (the Triton
    kernels, or the PyTorch fallback)."""
    from flash_jvp import _utils

    device = torch.device(cases[0].device)
    if _utils.uses_kernels(device) != kernels:
        return [f"flash_jvp on {device}: uses_kernels is {not kernels}, the test needs {kernels}"]
    return run_cases(cases)


def job_api() -> list[str]:
    """forward_ad duals, a group of one rank, a DeviceMesh, and refusals of bad input."""
    return _forward_ad() + _group_of_one() + _device_mesh() + _errors()


def _forward_ad() -> list[str]:
    """torch.autograd.forward_ad duals with a tangent on query only: o_t as single-process."""
    import torch.autograd.forward_ad as fwAD

    import flash_jvp
    from flash_jvp import distributed as D

    failures = []
    q, k, v, (q_t, _, _), _, _ = _global_inputs(Case("ring", True, torch.float64), 2, seed=7)
    with fwAD.dual_level():
        ref = fwAD.unpack_dual(flash_jvp.attention(fwAD.make_dual(q, q_t), k, v, is_causal=True))
        for fn in (D.ring_attention, D.ulysses_attention):
            dual = fwAD.make_dual(D.shard_sequence(q, 2), D.shard_sequence(q_t, 2))
            out = fn(dual, D.shard_sequence(k, 2), D.shard_sequence(v, 2), is_causal=True)
            o, o_t = (gather_seq(t) for t in fwAD.unpack_dual(out))
            for name, ours, theirs in (("o", o, ref.primal), ("o_t", o_t, ref.tangent)):
                err = rel_err(ours, theirs, 0.0)
                if not err < 1e-12:
                    failures.append(f"forward_ad {fn.__name__} {name}: rel err {err:.2e}")
    return failures


def _group_of_one() -> list[str]:
    """A one-rank group: the call is flash_jvp on the local tensors."""
    import flash_jvp
    from flash_jvp import distributed as D

    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank calls
    mine = groups[dist.get_rank()]
    q, k, v, tangents, _, _ = _global_inputs(Case("ring", True, torch.float64), 1, seed=8)
    failures = []
    ref = torch.func.jvp(lambda *a: flash_jvp.attention(*a, is_causal=True), (q, k, v), tangents)
    for fn in (D.ring_attention, D.ulysses_attention):
        call = functools.partial(fn, group=mine, is_causal=True)
        out = torch.func.jvp(call, (q, k, v), tangents)
        errs = [rel_err(a, b, 0.0) for a, b in zip(out, ref)]
        if not max(errs) < 1e-12:
            failures.append(f"group of one: {fn.__name__} vs flash_jvp.attention: {errs}")
    return failures


def _device_mesh() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    failures = []
    for method in ("ring", "ulysses"):
        case = Case(method, True, torch.float64, lse=False)
        failures += _with_group(case, mesh)
    return failures


def _with_group(case: Case, group) -> list[str]:
    """o and o_t of one call with ``group`` equal those with the default group."""
    from flash_jvp import distributed as D

    fn = D.ring_attention if case.method == "ring" else D.ulysses_attention
    q, k, v, tangents, _, _ = _global_inputs(case, dist.get_world_size(), seed=9)
    args = [D.shard_sequence(x, 2) for x in (q, k, v)]
    ts = tuple(D.shard_sequence(t, 2) for t in tangents)
    a = torch.func.jvp(lambda *x: fn(*x, is_causal=case.causal, group=group), tuple(args), ts)
    b = torch.func.jvp(lambda *x: fn(*x, is_causal=case.causal), tuple(args), ts)
    if all(torch.equal(x, y) for x, y in zip(a, b)):
        return []
    return [f"{case}: group={type(group).__name__} differs from the default group"]


def _errors() -> list[str]:
    """Each bad call raises the expected error, with the expected words, on every rank."""
    import torch.autograd.forward_ad as fwAD
    from torch.distributed.device_mesh import init_device_mesh

    from flash_jvp import distributed as D

    rank, p = dist.get_rank(), dist.get_world_size()
    ring, ulysses = D.ring_attention, D.ulysses_attention

    def qkv(h=4, lq=8, lk=8, hkv=None, dtype=torch.float64):
        hkv = h if hkv is None else hkv
        return (torch.randn(2, h, lq, 8, dtype=dtype), torch.randn(2, hkv, lk, 8, dtype=dtype),
                torch.randn(2, hkv, lk, 8, dtype=dtype))  # fmt: skip

    def tangent_on_rank_0():
        q, k, v = qkv()
        with fwAD.dual_level():
            if rank == 0:
                q = fwAD.make_dual(q, torch.randn_like(q))
            ring(q, k, v)

    def backprop_tangent(fn):
        leaves = [x.requires_grad_() for x in qkv()]
        _, o_t = torch.func.jvp(lambda *a: fn(*a, is_causal=True), tuple(leaves),
                                tuple(torch.randn_like(x) for x in leaves))  # fmt: skip
        o_t.sum().backward()

    mesh_2d = init_device_mesh("cpu", (1, p), mesh_dim_names=("dp", "cp"))
    q, k, v = qkv()
    expected = [
        # (exception, words in the message, call)
        (ValueError, "disagree on query.shape", lambda: ring(*qkv(lq=8 + 2 * rank))),
        (
            ValueError,
            "disagree on query.dtype",
            lambda: ulysses(*qkv(dtype=torch.float32 if rank else torch.float64)),
        ),
        (ValueError, "disagree on is_causal", lambda: ring(*qkv(), is_causal=rank == 0)),
        (ValueError, "disagree on query has a forward-mode tangent", tangent_on_rank_0),
        (ValueError, "disagree on function", lambda: (ring if rank else ulysses)(*qkv())),
        (ValueError, "4-D", lambda: ring(*(x[0] for x in qkv()))),
        (ValueError, "not divisible by the group size", lambda: ulysses(*qkv(h=3))),
        (ValueError, "must be even", lambda: ring(*qkv(lq=7, lk=7), is_causal=True)),
        (NotImplementedError, "same length", lambda: ring(*qkv(lk=6), is_causal=True)),
        (
            ValueError,
            "local length must be even",
            lambda: ulysses(*qkv(lq=7, lk=7), seq_layout="head_tail"),
        ),
        (ValueError, "enable_gqa", lambda: ring(*qkv(hkv=2))),
        (ValueError, "empty sequence chunk", lambda: ring(*qkv(lq=0))),
        (
            NotImplementedError,
            "attn_mask",
            lambda: ring(*qkv(), attn_mask=torch.ones(8, 8, dtype=torch.bool)),
        ),
        (NotImplementedError, "dropout_p", lambda: ulysses(*qkv(), dropout_p=0.1)),
        # refused on rank 0 only: it raises its own error, the others name its refusal (they
        # used to wait in the comparison's collective; found by an adversarial run)
        (
            NotImplementedError if rank == 0 else ValueError,
            "dropout_p" if rank == 0 else "disagree on refusal",
            lambda: ring(*qkv(), dropout_p=0.1 if rank == 0 else 0.0),
        ),
        (
            TypeError if rank == 0 else ValueError,
            "unexpected keyword" if rank == 0 else "disagree on refusal",
            lambda: ulysses(*qkv(), **({"window": 4} if rank == 0 else {})),
        ),
        (TypeError, "unexpected keyword", lambda: ring(*qkv(), window=4)),
        (TypeError, "group must be", lambda: ring(*qkv(), group="world")),
        (ValueError, "1-D DeviceMesh", lambda: ring(*qkv(), group=mesh_2d)),
        (ValueError, "seq_layout must be", lambda: ring(*qkv(), seq_layout="zigzag")),
        (TypeError, "return_lse", lambda: ring(*qkv(), return_lse="yes")),
        (TypeError, "query to be a torch.Tensor", lambda: ulysses(None, *qkv()[1:])),
        (NotImplementedError, "vmap", lambda: torch.func.vmap(lambda q: ring(q, k, v))(q[None])),
        (
            ValueError,
            "not divisible by 4",
            lambda: D.shard_sequence(torch.zeros(2, 5), 1, seq_layout="head_tail"),
        ),
        (ValueError, "method must be", lambda: D.context_parallel_sdpa(method="all").__enter__()),
        (NotImplementedError, "through a forward-mode tangent", lambda: backprop_tangent(ring)),
        (NotImplementedError, "through a forward-mode tangent", lambda: backprop_tangent(ulysses)),
    ]
    failures = []
    for exc_type, words, call in expected:
        try:
            call()
        except exc_type as e:
            if words not in str(e):
                failures.append(f"{exc_type.__name__} without {words!r}: {e}")
        except Exception as e:  # noqa: BLE001 - the wrong error is the finding
            failures.append(f"expected {exc_type.__name__} ({words!r}), got {e!r}")
        else:
            failures.append(f"expected {exc_type.__name__} ({words!r}), nothing raised")
    # the group still works after all that
    failures += run_cases([Case("ring", True, torch.float64, lse=False)])
    return failures


# ----------------------------------------------------------------------------------------
# models: the sCM step (jvp, then backward through the output) over sharded sequences


class Block(torch.nn.Module):
    """Attention through F.scaled_dot_product_attention (looked up at call time) and an MLP."""

    def __init__(self, dim: int = 16, heads: int = 4, causal: bool = True):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.Tanh(),
                                       torch.nn.Linear(2 * dim, dim))  # fmt: skip

    def forward(self, x):  # (B, L, dim)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(o.transpose(1, 2).flatten(2))
        return x + self.mlp(x)


@dataclass
class Models:
    """Where the model checks run: CPU in float64 (the fallback; 1e-10 agreement) or CUDA in
    float32 (the kernels, IEEE fp32: 1e-4)."""

    device: str = "cpu"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64 if self.device == "cpu" else torch.float32

    @property
    def tol(self) -> float:
        return 1e-10 if self.device == "cpu" else 1e-4

    def here(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else "cpu"

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(Block(), Block()).to(self.here(), self.dtype)

    def inputs(self) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(11)
        p = dist.get_world_size()
        return [torch.randn(2, 4 * p, 16, generator=g, dtype=torch.float64).to(self.here(),
                self.dtype) for _ in range(3)]  # fmt: skip


def scm_step(model, x, x_t, target):
    """pred, dpred = jvp(model); loss on pred and dpred.detach(); backward (sum over this
    rank's tokens: the ranks' gradients add up to the whole sequence's)."""
    pred, dpred = torch.func.jvp(model, (x,), (x_t,))
    loss = ((pred - target) ** 2).sum() + (pred * dpred.detach()).sum()
    loss.backward()
    return pred.detach(), dpred.detach()


def _reference(m: Models, x, x_t, target):
    import flash_jvp

    model = m.model()
    with flash_jvp.patch_sdpa():
        pred, dpred = scm_step(model, x, x_t, target)
    return pred, dpred, [prm.grad for prm in model.parameters()]


def _compare_model(m: Models, name, pred, dpred, grads, ref) -> list[str]:
    failures = []
    pairs = [("pred", pred, ref[0]), ("dpred", dpred, ref[1])]
    pairs += [(f"grad {i}", g, r) for i, (g, r) in enumerate(zip(grads, ref[2]))]
    for what, ours, theirs in pairs:
        err = rel_err(ours, theirs, 0.0)
        if not err < m.tol:
            failures.append(f"{name}: {what} rel err {err:.2e}")
    return failures


def job_models(device: str = "cpu", parts=("cp", "torch_cp", "fsdp2", "ddp")) -> list[str]:
    """The sCM step (torch.func.jvp, then backward) through context_parallel_sdpa against the
    single-process model: with shard_sequence (``cp``), inside torch's context_parallel
    (head-tail layout, ``torch_cp``), with FSDP2's fully_shard on the same ranks (``fsdp2``),
    and with DDP under forward_ad (``ddp``)."""
    from flash_jvp import distributed as D

    m = Models(device)
    x, x_t, target = m.inputs()
    ref = _reference(m, x, x_t, target)
    failures = []
    for method in ("ring", "ulysses"):
        if "cp" in parts:
            model = m.model()
            with D.context_parallel_sdpa(method=method):
                local = (D.shard_sequence(t, 1) for t in (x, x_t, target))
                pred, dpred = scm_step(model, *local)
            grads = [_all_reduce(prm.grad) for prm in model.parameters()]
            failures += _compare_model(m, f"context_parallel_sdpa {method}",
                                       gather_seq(pred, dim=1), gather_seq(dpred, dim=1), grads,
                                       ref)  # fmt: skip
        if "torch_cp" in parts:
            failures += _torch_context_parallel(m, method, x, x_t, target, ref)
        if "fsdp2" in parts:
            failures += _fsdp2(m, method, x, x_t, target, ref)
    if "ddp" in parts:
        failures += _ddp_forward_ad(m, x, x_t, target, ref)
    return failures


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def _mesh(m: Models):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(m.device, (dist.get_world_size(),))


def _torch_context_parallel(m: Models, method, x, x_t, target, ref) -> list[str]:
    """torch's context_parallel shards the buffers (head-tail order: the global length is a
    multiple of 2P); our router serves the SDPA calls."""
    from torch.distributed.tensor.experimental import context_parallel

    from flash_jvp import distributed as D

    mesh = _mesh(m)
    bufs = [t.clone() for t in (x, x_t, target)]
    model = m.model()
    shard = context_parallel(mesh, buffers=bufs, buffer_seq_dims=[1, 1, 1])
    with shard, D.context_parallel_sdpa(mesh, method=method, seq_layout="head_tail"):
        pred, dpred = scm_step(model, *bufs)
    grads = [_all_reduce(prm.grad) for prm in model.parameters()]
    return _compare_model(m, f"torch context_parallel + {method}",
                          gather_seq(pred, "head_tail", 1), gather_seq(dpred, "head_tail", 1),
                          grads, ref)  # fmt: skip


def _fsdp2(m: Models, method, x, x_t, target, ref) -> list[str]:
    """fully_shard over the context-parallel ranks: its reduce-scatter adds the ranks'
    partial gradients (divide factor 1: each rank's loss covers its own tokens only)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from flash_jvp import distributed as D

    mesh = _mesh(m)
    model = m.model()
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    for _ in range(2):  # the second step too: DDP, for one, fails only there
        model.zero_grad()
        with D.context_parallel_sdpa(mesh, method=method):
            pred, dpred = scm_step(model, *(D.shard_sequence(t, 1) for t in (x, x_t, target)))
    grads = [prm.grad.full_tensor() for prm in model.parameters()]
    return _compare_model(m, f"FSDP2 + {method}", gather_seq(pred, dim=1),
                          gather_seq(dpred, dim=1), grads, ref)  # fmt: skip


def _ddp_forward_ad(m: Models, x, x_t, target, ref) -> list[str]:
    """DDP with forward_ad dual tensors, two steps (torch.func.jvp through DDP fails in its
    second step inside DDP's bucket rebuild, torch's own issue; see the module docs)."""
    import torch.autograd.forward_ad as fwAD
    from torch.nn.parallel import DistributedDataParallel as DDP

    from flash_jvp import distributed as D

    model = DDP(m.model())
    x, x_t, target = (D.shard_sequence(t, 1) for t in (x, x_t, target))
    for _ in range(2):
        model.zero_grad()
        with D.context_parallel_sdpa(method="ring"), fwAD.dual_level():
            pred, dpred = fwAD.unpack_dual(model(fwAD.make_dual(x, x_t)))
            loss = ((pred - target) ** 2).sum() + (pred * dpred.detach()).sum()
        loss.backward()
    grads = [prm.grad * dist.get_world_size() for prm in model.parameters()]  # DDP averages
    return _compare_model(m, "DDP + forward_ad + ring", gather_seq(pred, dim=1),
                          gather_seq(dpred, dim=1), grads, ref)  # fmt: skip


def job_wrappers() -> list[str]:
    """What works where (printed by rank 0, nothing asserted): two sCM steps of the ring
    through context_parallel_sdpa, for FSDP2 and DDP each under torch.func.jvp and under
    forward_ad dual tensors, compared with the single-process model."""
    import torch.autograd.forward_ad as fwAD
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from flash_jvp import distributed as D

    m = Models()
    x, x_t, target = m.inputs()
    ref = _reference(m, x, x_t, target)
    local = [D.shard_sequence(t, 1) for t in (x, x_t, target)]

    def fsdp2():
        model = m.model()
        for module in (*model, model):
            fully_shard(module, mesh=_mesh(m))
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
        return model, lambda g: g.full_tensor()

    def ddp():
        return DDP(m.model()), lambda g: g * dist.get_world_size()  # DDP averages

    def func_jvp(model):
        return scm_step(model, *local)

    def forward_ad(model):
        with fwAD.dual_level():
            pred, dpred = fwAD.unpack_dual(model(fwAD.make_dual(local[0], local[1])))
            loss = ((pred - local[2]) ** 2).sum() + (pred * dpred.detach()).sum()
        loss.backward()
        return pred.detach(), dpred.detach()

    lines = []
    for wrap_name, wrap in (("FSDP2 fully_shard", fsdp2), ("DDP", ddp)):
        for ad_name, step in (("torch.func.jvp", func_jvp), ("forward_ad", forward_ad)):
            model, full_grad = wrap()
            outcome = []
            for i in range(2):
                model.zero_grad()
                try:
                    with D.context_parallel_sdpa(method="ring"):
                        pred, dpred = step(model)
                except Exception as e:  # noqa: BLE001 - the finding
                    outcome.append(f"step {i + 1} fails: {type(e).__name__}: {str(e)[:150]}")
                    break
                grads = [full_grad(prm.grad) for prm in model.parameters()]
                bad = _compare_model(m, "", gather_seq(pred, dim=1), gather_seq(dpred, dim=1),
                                     grads, ref)  # fmt: skip
                outcome.append(f"step {i + 1} {'matches' if not bad else 'DIFFERS: ' + bad[0]}")
            lines.append(f"{wrap_name} + {ad_name}: " + "; ".join(outcome))
    if dist.get_rank() == 0:
        print(f"torch {torch.__version__}, gloo, 2 ranks, CPU, float64, flash_jvp's fallback:")
        print("\n".join(lines), flush=True)
    return []


if __name__ == "__main__":
    import sys

    spawn(2, f"job_{sys.argv[1]}")
