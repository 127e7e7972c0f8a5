"""Time candidate launch configs of each kernel on the GPU; print the best (run once, keep
the winners in src/flash_jvp/kernels/configs.py). Usage: python benchmarks/tune.py [--out F]"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from flash_jvp import _ops
from flash_jvp._utils import Spec
from flash_jvp.kernels import configs
from flash_jvp.kernels.configs import Config

SHAPES = [(4, 16, 8192, 64, False), (4, 8, 8192, 128, False)]
# Hand-pruned: each compile costs seconds of the lease. (BLOCK_M, BLOCK_N, warps, stages)
CANDIDATES = {
    ("jvp", 64): [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3),
                  (64, 64, 4, 2), (128, 64, 4, 2), (64, 32, 4, 3), (128, 128, 8, 2)],
    ("jvp", 128): [(128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2),
                   (128, 64, 8, 3), (64, 32, 4, 3)],
    ("fwd", 64): [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4),
                  (64, 64, 4, 3), (128, 32, 4, 3)],
    ("fwd", 128): [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
                   (128, 32, 8, 3)],
    ("dkdv", 64): [(32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3),
                   (32, 128, 8, 2)],
    ("dkdv", 128): [(32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 8, 2)],
    ("dq", 64): [(128, 32, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 2)],
    ("dq", 128): [(128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3)],
}  # fmt: skip


def candidates(kind: str, E: int) -> list[Config]:
    return [Config(*c) for c in CANDIDATES[(kind, E)]]


def time_config(kind, cfg, shape):
    B, H, L, E, causal = shape
    q, k, v, qt, kt, vt, do = (
        torch.randn(B, H, L, E, device="cuda", dtype=torch.bfloat16) for _ in range(7)
    )
    spec = Spec(E**-0.5, 0 if causal else None)
    names = {"fwd": "fwd", "jvp": "fwd", "dkdv": "bwd_dkdv", "dq": "bwd_dq"}
    saved = getattr(configs, names[kind])
    setattr(configs, names[kind], lambda *a: [cfg])
    _ops._CHOSEN.clear()
    try:
        if kind == "fwd":
            fn = lambda: _ops.attn_fwd(q, k, v, None, None, None, None, None, spec)  # noqa: E731
        elif kind == "jvp":
            fn = lambda: _ops.attn_fwd(q, k, v, qt, kt, vt, None, None, spec)  # noqa: E731
        else:
            o, _, lse = _ops.attn_fwd(q, k, v, None, None, None, None, None, spec)
            fn = lambda: _ops.attn_bwd(do, q, k, v, o, lse, None, spec)  # noqa: E731
        fn()
        return do_bench(fn, warmup=10, rep=40, return_mode="median")
    except Exception as err:  # out of resources etc.: not a candidate
        return f"{type(err).__name__}"
    finally:
        setattr(configs, names[kind], saved)
        _ops._CHOSEN.clear()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--kinds", default="jvp,fwd,dkdv,dq")
    args = parser.parse_args()
    results = []
    for shape in SHAPES:
        for kind in args.kinds.split(","):
            timed = [(time_config(kind, c, shape), c) for c in candidates(kind, shape[3])]
            ok = sorted((t, c) for t, c in timed if isinstance(t, float))
            for t, c in ok[:3]:
                print(f"{kind:5} {shape}: {t:.3f} ms {c}", flush=True)
            results.append({"kind": kind, "shape": shape,
                            "timings": [(str(t), c.__dict__) for t, c in timed]})  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
