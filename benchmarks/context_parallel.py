"""Context parallelism on P GPUs against one (issue 19): ulysses_attention and ring_attention,
fwd+JVP and the sCM step (fwd+JVP+bwd), at the same global sequence as one GPU's
flash_jvp.attention.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc-per-node 2 benchmarks/context_parallel.py [--lengths 32768 65536 131072]

Rank 0 first times flash_jvp on the whole sequence alone (the one-GPU baseline; the other ranks
wait), then every rank times both methods on its chunk. Per row: time (the slowest rank; fixed
iteration counts, CUDA events), tokens/s, peak memory per GPU (the largest over the ranks; the
inputs included, and above them), speed-up and memory against one GPU, and communication: the
same collectives timed alone (``comm`` = their share of the time if nothing overlapped) and the
compute timed alone with the routes replaced by local copies (``exposed`` = (time - compute)
/ time: the communication the computation did not hide, plus the routes' packing copies).
Targets (issue 19, fwd+JVP, 2 GPUs, L = 32k-128k, E = 128): Ulysses >= 1.8x one GPU, ring >=
1.7x, peak memory per GPU <= 0.55x.

A row that fails (out of memory, an error) is recorded with its error and the run goes on (a
failure on one rank only can leave the others waiting in a collective until NCCL's timeout).
``--device cpu`` runs it on gloo with tiny shapes (a smoke test of the script).

Output (rank 0): ``<out>/<date>-<gpu>-context-parallel-p<P>.{json,md}`` and the table on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import traceback
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

import flash_jvp
from flash_jvp import distributed as D
from flash_jvp._env import environment
from flash_jvp._exchange import AllToAll, Permute, RingShift

GIB = 2**30
MODES = ("fwd+jvp", "fwd+jvp+bwd")


@dataclass
class Row:
    method: str  # one_gpu, ulysses, ring
    mode: str
    L: int  # global length
    causal: bool
    ms: float = math.nan
    tokens_per_s: float = math.nan
    peak_gib: float = math.nan  # per GPU, inputs included
    peak_above_inputs_gib: float = math.nan
    comm_ms: float = math.nan  # the collectives alone
    compute_ms: float = math.nan  # the compute alone (routes replaced by local copies)
    speedup: float = math.nan  # one GPU's time / this time (same global tokens)
    memory_ratio: float = math.nan  # this peak / one GPU's peak (inputs included)
    error: str = ""
    extra: dict = field(default_factory=dict)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--methods", nargs="+", choices=["ulysses", "ring"], default=["ulysses", "ring"])
    p.add_argument("--iters", type=int, default=3, help="timed calls per row (after one warm-up)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default="benchmarks/results")
    return p.parse_args()


class Bench:
    def __init__(self, args):
        self.args = args
        self.p, self.rank = dist.get_world_size(), dist.get_rank()
        self.cuda = args.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else "cpu"
        self.dtype = getattr(torch, args.dtype)
        self.group = dist.group.WORLD

    # -- helpers -------------------------------------------------------------------------

    def randn(self, *shape, requires_grad=False):
        x = torch.randn(*shape, device=self.device, dtype=self.dtype)
        return x.requires_grad_(requires_grad)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn, collective: bool = True) -> tuple[float, float, float]:
        """(ms per call, peak GiB above what was allocated before, that base in GiB): one
        warm-up call, then ``--iters`` calls between CUDA events; ms and peak are the largest
        over the ranks when ``collective``."""
        fn()
        self.sync()
        base, peak = 0, 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        if collective:
            dist.barrier()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = dt.datetime.now()
        for _ in range(self.args.iters):
            fn()
        if self.cuda:
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / self.args.iters
            peak = torch.cuda.max_memory_allocated() - base
        else:
            ms = (dt.datetime.now() - t0).total_seconds() * 1e3 / self.args.iters
        out = torch.tensor([ms, peak / GIB, base / GIB], dtype=torch.float64, device=self.device)
        if collective:
            dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return tuple(out.tolist())

    def call(self, fn, mode: str, shape_q, shape_kv):
        """A closure running ``fn(q, k, v)`` in ``mode`` on fresh random inputs."""
        grad = mode == "fwd+jvp+bwd"
        q = self.randn(*shape_q, requires_grad=grad)
        k, v = (self.randn(*shape_kv, requires_grad=grad) for _ in range(2))
        tangents = tuple(self.randn(*x.shape) for x in (q, k, v))
        do = self.randn(*shape_q)

        def fwd_jvp():
            with torch.no_grad():
                return torch.func.jvp(fn, (q, k, v), tangents)

        def step():
            o, o_t = torch.func.jvp(fn, (q, k, v), tangents)
            torch.autograd.grad(o, (q, k, v), do + o_t.detach())

        return fwd_jvp if mode == "fwd+jvp" else step

    # -- rows ----------------------------------------------------------------------------

    def one_gpu(self, L: int, causal: bool, mode: str) -> Row:
        a = self.args
        row = Row("one_gpu", mode, L, causal)
        shape = (a.batch, a.heads, L, a.head_dim)
        failed = torch.zeros((), device=self.device)
        if self.rank == 0:
            try:
                fn = self.call(lambda q, k, v: flash_jvp.attention(q, k, v, is_causal=causal),
                               mode, shape, shape)  # fmt: skip
                row.ms, above, base = self.timed(fn, collective=False)
                row.peak_gib, row.peak_above_inputs_gib = above + base, above
            except Exception as e:  # noqa: BLE001 - recorded in the row, the run goes on
                row.error = _why(e)
                failed.fill_(1)
            finally:
                _free(self.cuda)
        dist.all_reduce(failed)  # the other ranks waited here
        row.tokens_per_s = _ratio(a.batch * L, row.ms * 1e-3)
        return row

    def distributed(self, method: str, L: int, causal: bool, mode: str) -> Row:
        a = self.args
        row = Row(method, mode, L, causal)
        local = (a.batch, a.heads, L // self.p, a.head_dim)
        attend = D.ulysses_attention if method == "ulysses" else D.ring_attention

        def fn(q, k, v):
            return attend(q, k, v, is_causal=causal)

        try:
            row.ms, above, base = self.timed(self.call(fn, mode, local, local))
            row.peak_gib, row.peak_above_inputs_gib = above + base, above
            _free(self.cuda)
            row.comm_ms = self.timed(self.comm_only(method, causal, mode, local))[0]
            _free(self.cuda)
            with _local_routes():
                row.compute_ms = self.timed(self.call(fn, mode, local, local), collective=False)[0]
            row.compute_ms = _all_max(row.compute_ms, self.device)
        except Exception as e:  # noqa: BLE001 - recorded in the row, the run goes on
            row.error = _why(e)
        finally:
            _free(self.cuda)
        row.tokens_per_s = _ratio(a.batch * L, row.ms * 1e-3)
        row.extra = {
            "comm_share": _ratio(row.comm_ms, row.ms),
            "exposed_share": _ratio(row.ms - row.compute_ms, row.ms),
        }
        return row

    def comm_only(self, method: str, causal: bool, mode: str, local):
        """The collectives one call of ``method`` makes, on tensors of the same sizes."""
        g, p = self.group, self.p
        q, k, v, q_t, k_t, v_t = (self.randn(*local) for _ in range(6))
        bwd = mode == "fwd+jvp+bwd"
        if method == "ulysses":
            head = (local[0], local[1] // p, local[2] * p, local[3])
            o, o_t = self.randn(*head), self.randn(*head)

            def run():
                AllToAll(g, True)([q, k, v, q_t, k_t, v_t])
                AllToAll(g, False)([o, o_t])
                if bwd:
                    AllToAll(g, True)([q])  # do
                    AllToAll(g, False)([o, o, o])  # dq, dk, dv

            return run
        zigzag = Permute.zigzag(g)

        def run():
            if causal:
                zigzag([q, k, v, q_t, k_t, v_t])
            for _ in range(p - 1):
                RingShift(g)([k, v, k_t, v_t])
            if causal:
                zigzag.adjoint()([q, q_t])  # o, o_t
            if bwd:
                if causal:
                    zigzag([q])  # do
                for _ in range(p - 1):
                    RingShift(g, -1)([k, v])  # dk, dv
                if causal:
                    zigzag.adjoint()([q, k, v])  # dq, dk, dv

        return run


class _LocalRoute:
    """A route that moves nothing (a copy in place of the transfer): the compute alone."""

    deferred = False

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def zigzag(cls, group):
        return cls()

    def __call__(self, xs):
        return [x.clone() for x in xs]

    def adjoint(self):
        return self

    def fresh(self):
        return self

    def wait(self):
        pass


@contextlib.contextmanager
def _local_routes():
    saved = D.AllToAll, D.Permute, D.RingShift
    D.Permute = D.RingShift = _LocalRoute
    D.AllToAll = _UlyssesLocal
    try:
        yield
    finally:
        D.AllToAll, D.Permute, D.RingShift = saved


class _UlyssesLocal(_LocalRoute):
    """Ulysses' all-to-all without the transfer: tensors of the shapes it would give."""

    def __init__(self, group, to_heads: bool):
        self.group, self.to_heads = group, to_heads
        self.p = dist.get_world_size(group)

    def __call__(self, xs):
        p = self.p
        if self.to_heads:  # (B, H, L, ...) -> (B, H/P, P L, ...): this rank's heads, repeated
            return [x[:, : x.shape[1] // p].repeat_interleave(p, dim=2) for x in xs]
        return [x[:, :, : x.shape[2] // p].repeat(1, p, *([1] * (x.dim() - 2))) for x in xs]

    def adjoint(self):
        return _UlyssesLocal(self.group, not self.to_heads)


def _ratio(a: float, b: float) -> float:
    """a / b, nan where b is 0 or nan (no memory statistics on CPU, a failed row)."""
    return a / b if b and not math.isnan(b) else math.nan


def _all_max(x: float, device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _free(cuda: bool) -> None:
    if cuda:
        torch.cuda.empty_cache()


def _why(e: Exception) -> str:
    if isinstance(e, torch.OutOfMemoryError):
        return "out of memory"
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def main() -> None:
    args = parse()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=dt.timedelta(minutes=30))
    bench = Bench(args)
    causal = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    rows: list[Row] = []
    for L in args.lengths:
        for c in causal:
            for mode in args.modes:
                base = bench.one_gpu(L, c, mode)
                rows.append(base)
                for method in args.methods:
                    try:
                        row = bench.distributed(method, L, c, mode)
                    except Exception:  # noqa: BLE001 - a bug in the script itself
                        row = Row(method, mode, L, c, error=traceback.format_exc(limit=2))
                    row.speedup = _ratio(base.ms, row.ms)
                    row.memory_ratio = _ratio(row.peak_gib, base.peak_gib)
                    rows.append(row)
                if bench.rank == 0:
                    for r in rows[-1 - len(args.methods) :]:
                        print(_line(r), flush=True)
    if bench.rank == 0:
        _write(args, rows, bench.p)
    dist.destroy_process_group()


HEADER = ("| method | mode | L | causal | ms | tokens/s | speed-up vs 1 GPU | peak GiB/GPU "
          "(above inputs) | memory vs 1 GPU | comm alone ms (share) | exposed comm | error |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip


def _line(r: Row) -> str:
    comm = f"{r.comm_ms:.1f} ({r.extra.get('comm_share', math.nan):.0%})" if r.extra else ""
    exposed = f"{r.extra.get('exposed_share', math.nan):.0%}" if r.extra else ""
    return (f"| {r.method} | {r.mode} | {r.L} | {r.causal} | {r.ms:.1f} | {r.tokens_per_s:.3g} | "
            f"{r.speedup:.2f} | {r.peak_gib:.2f} ({r.peak_above_inputs_gib:.2f}) | "
            f"{r.memory_ratio:.2f} | {comm} | {exposed} | {r.error} |")  # fmt: skip


def _write(args, rows: list[Row], p: int) -> None:
    env = environment()
    env["world_size"] = p
    gpu = env.get("gpu", "cpu").replace("NVIDIA ", "").split()[0].lower()
    stem = f"{dt.date.today().isoformat()}-{gpu}-context-parallel-p{p}"
    os.makedirs(args.out, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump({"environment": env, "config": config, "rows": [asdict(r) for r in rows]}, f,
                  indent=1)  # fmt: skip
    table = "\n".join([HEADER, *(_line(r) for r in rows)])
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(f"# Context parallelism, {p} ranks\n\n{json.dumps(env)}\n\n")
        f.write(f"{json.dumps(config)}\n\n")
        f.write(table + "\n")
    print(table)
    print(f"wrote {os.path.join(args.out, stem)}.{{json,md}}")


if __name__ == "__main__":
    main()
