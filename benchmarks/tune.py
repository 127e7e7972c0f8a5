"""Time candidate launch configs of each kernel on the GPU; print the best (run once, keep
the winners in src/flash_jvp/kernels/configs.py).

    python benchmarks/tune.py [--kinds jvp,fwd,dkdv,dq] [--cases none,pad10,causal]
                              [--shapes B,H,L,E ...] [--configs M,N,warps,stages ...] [--out F]
    python benchmarks/tune.py --kinds dkdv+t,dq+t   # the backward through the tangent

Every kind is timed without a mask, with a 10 % boolean key-padding mask ("pad10") and causal,
because one config serves all three and they stress registers differently (loop bounds read
from the mask's range table cost registers; see scripts/compile_sm90.py). Candidates compile
first in parallel worker processes (Triton's on-disk cache), then are timed one by one.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp

import torch
from triton.testing import do_bench

from flash_jvp import _ops
from flash_jvp._utils import Spec
from flash_jvp.kernels import configs
from flash_jvp.kernels.configs import Config

SHAPES = ["4,16,8192,64", "4,8,8192,128"]  # B, H, L, E (--shapes 4,16,8192,72: bucket 96)
# Hand-pruned: each compile costs seconds of the lease. (BLOCK_M, BLOCK_N, warps, stages
# [, maxnreg]); maxnreg caps registers at an occupancy step (128 x 8 warps: 2 blocks per SM).
# Keyed by the configs' head-dim bucket (kernels/configs.py): the tile width 64, 96 or 128.
CANDIDATES = {
    ("jvp", 64): [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3),
                  (64, 64, 4, 2), (128, 64, 4, 2), (64, 32, 4, 3), (128, 128, 8, 2)],
    ("jvp", 128): [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2),
                   (128, 64, 8, 3), (64, 32, 4, 3)],
    ("fwd", 64): [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4),
                  (64, 64, 4, 3), (128, 32, 4, 3)],
    ("fwd", 128): [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
                   (128, 32, 8, 3)],
    ("dkdv", 64): [(32, 128, 4, 3), (32, 128, 4, 2), (32, 64, 4, 3), (32, 64, 4, 3, 168),
                   (64, 128, 8, 2), (32, 128, 8, 3, 128), (64, 64, 4, 3)],
    ("dkdv", 128): [(64, 128, 8, 2), (32, 64, 4, 3), (32, 128, 8, 2), (64, 64, 8, 2),
                    (32, 64, 4, 2)],
    ("dq", 64): [(128, 64, 8, 3), (128, 64, 8, 3, 128), (128, 64, 8, 2, 128), (64, 64, 4, 3),
                 (64, 64, 4, 3, 168)],
    ("dq", 128): [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (64, 32, 4, 3, 168),
                  (128, 64, 8, 2)],
    ("jvp", 96): [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2),
                  (128, 32, 8, 3)],
    ("fwd", 96): [(64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2)],
    ("dkdv", 96): [(32, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 2), (32, 128, 4, 2)],
    ("dq", 96): [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2)],
    # the backward through the tangent (TANGENT kernels: dk, dv / dq with dq_t; dk_t, dv_t
    # come from the primal dK/dV kernel; see kernels/bwd.py)
    ("dkdv+t", 64): [(32, 128, 8, 2), (32, 64, 4, 3), (32, 64, 4, 2), (64, 64, 8, 2),
                     (64, 128, 8, 2), (16, 64, 4, 2), (32, 128, 4, 2)],
    ("dkdv+t", 96): [(32, 64, 4, 3), (32, 64, 4, 2), (32, 128, 8, 2), (64, 64, 8, 2),
                     (16, 64, 4, 2)],
    ("dkdv+t", 128): [(32, 64, 4, 2), (32, 64, 8, 2), (64, 64, 8, 2), (16, 64, 4, 2),
                      (32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3)],
    ("dq+t", 64): [(128, 32, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2),
                   (64, 32, 4, 2), (128, 64, 8, 3), (64, 64, 8, 2), (32, 64, 4, 2)],
    ("dq+t", 96): [(128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2),
                   (64, 64, 8, 2), (32, 64, 4, 2)],
    ("dq+t", 128): [(128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2),
                    (64, 64, 8, 2), (32, 64, 4, 2)],
}  # fmt: skip
KERNEL_CONFIGS = {"fwd": "fwd", "jvp": "fwd", "dkdv": "bwd_dkdv", "dq": "bwd_dq",
                  "dkdv+t": "bwd_dkdv", "dq+t": "bwd_dq"}  # fmt: skip


def bucket(shape) -> int:
    """The configs' head-dim bucket of a bf16 problem (B, H, L, E)."""
    B, H, L, E = shape
    width = _ops._tile_width(_ops._tile_args(_ops._Layout(B, H, H, L, L, E, E)))
    return configs.bucket(width, torch.bfloat16)


def problem(shape, case):
    """The timed function's inputs: q, k, v, tangents, do, mask, spec."""
    B, H, L, E = shape
    torch.manual_seed(0)
    q, k, v, qt, kt, vt, do = (
        torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16) for _ in range(7)
    )
    mask = None
    if case == "pad10":  # (B, 1, 1, L): the last 10 % of keys are padding
        mask = (torch.arange(L, device="cuda") < int(0.9 * L)).expand(B, 1, 1, L)
    spec = Spec(E**-0.5, 0 if case == "causal" else None)
    return q, k, v, (qt, kt, vt), do, mask, spec


def time_config(kind, cfg, shape, case, compile_only=False):
    """Median ms of the kernel(s) of ``kind`` with ``cfg`` (the backward is timed whole,
    the other backward kernel keeping its configured choice), or the error's name."""
    q, k, v, (qt, kt, vt), do, mask, spec = problem(shape, case)
    name = KERNEL_CONFIGS[kind]
    configured = getattr(configs, name)
    # only this kind's variant: the backward through the tangent runs the primal kernels too
    tangent_kind = kind == "jvp" or kind.endswith("+t")

    def only_this(width, dtype, tangent=False, *more):
        return [cfg] if tangent == tangent_kind else configured(width, dtype, tangent, *more)

    setattr(configs, name, only_this)
    _ops.forget_configs()
    try:
        if kind in ("fwd", "jvp"):
            tangents = (qt, kt, vt) if kind == "jvp" else (None, None, None)
            fn = lambda: _ops.attn_fwd(q, k, v, *tangents, mask, None, spec)  # noqa: E731
        elif kind.endswith("+t"):  # through o and o_t, every tangent (a TVM step)
            o, o_t, lse, mu = _ops.attn_fwd(q, k, v, qt, kt, vt, mask, None, spec)
            fwd_out = (q, k, v, qt, kt, vt, o, o_t, lse, mu, mask, None, spec)
            fn = lambda: _ops.attn_bwd_tangent(do, do, *fwd_out)  # noqa: E731
        else:
            o, _, lse, _ = _ops.attn_fwd(q, k, v, None, None, None, mask, None, spec)
            fn = lambda: _ops.attn_bwd(do, q, k, v, o, lse, mask, spec)  # noqa: E731
        fn()
        if compile_only:
            return 0.0
        return do_bench(fn, warmup=10, rep=40, return_mode="median")
    except Exception as err:  # out of resources etc.: not a candidate
        return f"{type(err).__name__}: {str(err)[:100]}"
    finally:
        setattr(configs, name, configured)
        _ops.forget_configs()


def _compile(job):
    kind, cfg, shape, case = job
    return time_config(kind, cfg, shape, case, compile_only=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--kinds", default="jvp,fwd,dkdv,dq")
    parser.add_argument("--cases", default="none,pad10,causal")
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="B,H,L,E each")
    parser.add_argument("--configs", nargs="+", help="M,N,warps,stages[,maxnreg] each "
                        "(default: CANDIDATES)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=12, help="parallel compile processes")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    chosen = args.configs and [tuple(int(x) for x in c.split(",")) for c in args.configs]
    jobs = [
        (kind, Config(*c), shape, case)
        for shape in shapes
        for kind in args.kinds.split(",")
        for c in chosen or CANDIDATES[(kind, bucket(shape))]
        for case in args.cases.split(",")
    ]
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        pool.map(_compile, jobs, chunksize=1)
    results = []
    for kind, cfg, shape, case in jobs:
        t = time_config(kind, cfg, shape, case)
        ok = isinstance(t, float)
        results.append({"kind": kind, "shape": shape, "case": case, "config": cfg.__dict__,
                        "ms": t if ok else None, "error": None if ok else t})  # fmt: skip
        shown = f"{t:.3f} ms" if ok else t
        print(f"{kind:5} {shape} {case:6}: {shown} {cfg}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
