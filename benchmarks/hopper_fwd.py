"""The Gluon warp-specialised forward (kernels/fwd_hopper.py) against our Triton forward
(kernels/fwd.py), side by side in one run on Hopper: which (tangent, HEAD_DIM) configs.HOPPER
should route to it.

    python benchmarks/hopper_fwd.py --out benchmarks/results [--lengths 1024 4096 8192] [--sweep]

Rows per shape (bf16, B=4, H=16 at E=64 and 8 at E=128, as ``flash_jvp.bench``; causal and
not): ``fwd`` and ``fwd+jvp`` (torch.func.jvp, every tangent present), each through the Gluon
forward (every entry kernels/fwd_hopper.py compiles without spills routed to it) and through
the Triton forward (configs.HOPPER emptied), plus cuDNN SDPA's forward. ``diff``: the relative
difference of the two routes' o (and o_t) in float64 (both are checked against float64 in
tests/test_hopper.py). Times: medians of triton.testing.do_bench (``flash_jvp.bench``).
Writes ``<date>-<gpu>-hopper-fwd.{json,md}`` under --out; with --sweep, the times of each
variant in configs.HOPPER_CANDIDATES against the Triton forward (``-hopper-fwd-sweep``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import sys

import torch

from flash_jvp import _check, _ops, attention, bench
from flash_jvp._env import environment
from flash_jvp.kernels import configs


@contextlib.contextmanager
def route(gluon: bool | dict):
    """Every compiled variant routed to the Gluon forward (True), none (False) or those of a
    dict like configs.HOPPER; launch plans made under another routing are dropped
    (_ops.forget_configs)."""
    saved = configs.HOPPER
    configs.HOPPER = gluon if isinstance(gluon, dict) else configs.HOPPER_COMPILED if gluon else {}
    _ops.forget_configs()
    try:
        yield
    finally:
        configs.HOPPER = saved
        _ops.forget_configs()


def _run(mode: str, s: bench.Shape):
    return (bench._jvp if mode == "fwd+jvp" else bench._fwd)(attention, s)


def _diff(mode: str, s: bench.Shape, gluon: bool | dict = True) -> float:
    """Relative difference of o (and o_t) between the Gluon route ``gluon`` and the Triton
    forward, in float64."""
    torch.manual_seed(0)
    q, k, v, tangents, _ = bench._tensors(s, False)
    outs = []
    for routing in (gluon, False):
        with route(routing):
            if mode == "fwd+jvp":
                fn = lambda q, k, v: attention(q, k, v, is_causal=s.is_causal)  # noqa: E731
                outs.append(torch.func.jvp(fn, (q, k, v), tangents))
            else:
                outs.append((attention(q, k, v, is_causal=s.is_causal),))
    return max(_check.rel_err(a, b.double()) for a, b in zip(*outs))


def sweep(lengths: list[int]) -> tuple[list[dict], list[str]]:
    """Each configs.HOPPER_CANDIDATES entry against the Triton forward (both routes' ms, same
    run, and the relative difference of their outputs: a wrong variant shows there too)."""
    rows = []
    lines = ["| E | L | causal | mode | BLOCK_N | stages | o_tma | overlap | regs | consumers "
             "| gluon ms | triton ms | triton / gluon | diff |", "|---" * 14 + "|"]  # fmt: skip
    for (tangent, E), candidates in configs.HOPPER_CANDIDATES.items():
        mode = "fwd+jvp" if tangent else "fwd"
        for L in lengths:
            for causal in (False, True):
                s = bench.Shape(4, 16 if E == 64 else 8, L, E, causal)
                with route(False):
                    triton_ms = bench._measure(lambda s, m=mode: _run(m, s), s)[0]
                for cfg in candidates:
                    with route({(tangent, E): cfg}):
                        ms = bench._measure(lambda s, m=mode: _run(m, s), s)[0]
                    diff = _diff(mode, s, {(tangent, E): cfg})
                    rows.append(dict(E=E, L=L, causal=causal, mode=mode, **cfg._asdict(),
                                     gluon_ms=ms, triton_ms=triton_ms, diff=diff))  # fmt: skip
                    cells = (E, L, causal, mode, *cfg, f"{ms:.3f}", f"{triton_ms:.3f}",
                             f"{triton_ms / ms:.3f}", f"{diff:.1e}")  # fmt: skip
                    lines.append("| " + " | ".join(map(str, cells)) + " |")
                    print(lines[-1], flush=True)
    return rows, lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument(
        "--sweep", action="store_true", help="time each of configs.HOPPER_CANDIDATES instead"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs a Hopper GPU", file=sys.stderr)
        return 1
    if args.sweep:
        rows, lines = sweep(args.lengths)
        return _write(args.out, "hopper-fwd-sweep", rows, lines)
    rows = []
    lines = ["| E | L | causal | mode | gluon ms | triton ms | triton / gluon | gluon TFLOP/s "
             "| cuDNN fwd ms | diff |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for E in (64, 128):
        for L in args.lengths:
            for causal in (False, True):
                s = bench.Shape(4, 16 if E == 64 else 8, L, E, causal)
                cudnn = bench._measure(
                    lambda s: bench._fwd(bench._backend(bench.SDPBackend.CUDNN_ATTENTION), s), s
                )[0]
                for mode in ("fwd", "fwd+jvp"):
                    ms = {}
                    for gluon in (True, False):
                        with route(gluon):
                            ms[gluon] = bench._measure(lambda s, m=mode: _run(m, s), s)[0]
                    row = dict(E=E, L=L, causal=causal, mode=mode, gluon_ms=ms[True],
                               triton_ms=ms[False], speedup=ms[False] / ms[True],
                               gluon_tflops=s.flops(mode) / ms[True] / 1e9, cudnn_fwd_ms=cudnn,
                               diff=_diff(mode, s))  # fmt: skip
                    rows.append(row)
                    lines.append(
                        f"| {E} | {L} | {causal} | {mode} | {ms[True]:.3f} | {ms[False]:.3f} "
                        f"| {row['speedup']:.3f} | {row['gluon_tflops']:.0f} | {cudnn:.3f} "
                        f"| {row['diff']:.1e} |"
                    )
                    print(lines[-1], flush=True)
    return _write(args.out, "hopper-fwd", rows, lines)


def _write(out: str, name: str, rows: list[dict], lines: list[str],
           title: str = "Gluon forward vs Triton forward") -> int:  # fmt: skip
    """``<date>-<gpu>-<name>.{json,md}`` under ``out``."""
    meta = {"date": dt.date.today().isoformat(), **environment()}
    stem = f"{meta['date']}-{meta['gpu'].split()[1].lower()}-{name}"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write(f"# {title}\n\n{json.dumps(meta)}\n\n")
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
