"""The Gluon warp-specialised backward (kernels/bwd_hopper.py) against our Triton backward
(kernels/bwd.py) and cuDNN SDPA's, side by side in one run on Hopper: which HEAD_DIMs,
variants and lengths configs.HOPPER_BWD and HOPPER_BWD_MIN_L should route.

    python benchmarks/hopper_bwd.py --out benchmarks/results [--lengths 2048 4096 8192]

Rows per shape (bf16, B=4, H=16 at E=64 and 8 at E=128, as ``flash_jvp.bench``; causal and
not): the backward alone (dq, dk, dv of one forward) through each variant of CANDIDATES
(routed at every length), through the Triton kernels (the route emptied) and through cuDNN.
``diff``: the largest relative difference of the two routes' dq, dk, dv in float64 (both
are checked against float64 in tests/test_hopper_bwd.py). Times: medians of
triton.testing.do_bench (``flash_jvp.bench``). Writes ``<date>-<gpu>-hopper-bwd.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
from hopper_fwd import _write

from flash_jvp import _check, _ops, attention, bench
from flash_jvp.kernels import configs

# HEAD_DIM -> the variants timed (the shipped one first)
CANDIDATES = {
    64: [configs.HOPPER_BWD[64]],
    128: [
        configs.HopperBwdConfig(32, 3, 208, 72),
        configs.HopperBwdConfig(32, 2, 208, 72),
        configs.HopperBwdConfig(32, 3, 216, 64),
    ],  # fmt: skip
}


@contextlib.contextmanager
def route(routes: dict):
    """Only ``routes`` (like configs.HOPPER_BWD) routed to the Gluon backward, at every
    length; launch plans made under another routing are dropped (_ops.forget_configs)."""
    saved = configs.HOPPER_BWD, configs.HOPPER_BWD_MIN_L
    configs.HOPPER_BWD, configs.HOPPER_BWD_MIN_L = routes, 1
    _ops.forget_configs()
    try:
        yield
    finally:
        configs.HOPPER_BWD, configs.HOPPER_BWD_MIN_L = saved
        _ops.forget_configs()


def _diff(s: bench.Shape, routes: dict) -> float:
    """Largest relative difference of dq, dk, dv between ``routes`` and the Triton kernels."""
    torch.manual_seed(0)
    q, k, v, _, do = bench._tensors(s, True)
    grads = []
    for routing in (routes, {}):
        with route(routing):
            o = attention(q, k, v, is_causal=s.is_causal)
            grads.append(torch.autograd.grad(o, (q, k, v), do))
    return max(_check.rel_err(a, b.double()) for a, b in zip(*grads))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs a Hopper GPU", file=sys.stderr)
        return 1
    cudnn_fn = bench._backend(bench.SDPBackend.CUDNN_ATTENTION)
    rows = []
    lines = ["| E | L | causal | BLOCK_M | stages | regs | dq regs | gluon ms | triton ms "
             "| cuDNN ms | triton / gluon | gluon / cuDNN | diff |", "|---" * 13 + "|"]  # fmt: skip
    for E, candidates in CANDIDATES.items():
        for L in args.lengths:
            for causal in (False, True):
                s = bench.Shape(4, 16 if E == 64 else 8, L, E, causal)
                cudnn = bench._measure(lambda s: bench._bwd(cudnn_fn, s), s)[0]
                with route({}):
                    triton_ms = bench._measure(lambda s: bench._bwd(attention, s), s)[0]
                for cfg in candidates:
                    with route({E: cfg}):
                        ms = bench._measure(lambda s: bench._bwd(attention, s), s)[0]
                    diff = _diff(s, {E: cfg})
                    rows.append(dict(E=E, L=L, causal=causal, **cfg._asdict(), gluon_ms=ms,
                                     triton_ms=triton_ms, cudnn_ms=cudnn, diff=diff))  # fmt: skip
                    cells = (E, L, causal, *cfg, f"{ms:.3f}", f"{triton_ms:.3f}",
                             f"{cudnn:.3f}", f"{triton_ms / ms:.3f}", f"{ms / cudnn:.3f}",
                             f"{diff:.1e}")  # fmt: skip
                    lines.append("| " + " | ".join(map(str, cells)) + " |")
                    print(lines[-1], flush=True)
    return _write(args.out, "hopper-bwd", rows, lines, "Gluon backward vs Triton and cuDNN")


if __name__ == "__main__":
    sys.exit(main())
