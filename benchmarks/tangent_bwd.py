"""The backward through the JVP tangent (Terminal Velocity Matching, issue #18) on the GPU:
time and peak memory, side by side in one run, at L in {1024, 4096, 8192}, E in {64, 72,
128}, bf16, non-causal and (our rows) causal.

    python benchmarks/tangent_bwd.py --out benchmarks/results [--lengths 4096 8192]
                                     [--dims 64 128] [--no-causal] [--kernels]

Rows per shape (B=4, or 8 at L <= 1024 (DiT: B*H = 128 at E=72); H=16 at E <= 72, else 8):

* ``flash_jvp tangent bwd``: the backward through (o, o_t), cotangents do and do_t, every
  tangent present (q_t, k_t, v_t), after one fwd+JVP (retain_graph; the forward not timed);
* ``flash_jvp bwd``: our primal backward (FlashAttention-2 style), the yardstick of the
  time target (tangent bwd <= 3.0x, aim 2.5x);
* ``flash_jvp tvm step`` / ``flash_jvp fwd+bwd``: a whole step, fwd+JVP then the backward
  through both, against the primal fwd+bwd: the peak-memory target (<= 1.3x);
* ``sdpa_math tangent bwd`` / ``sdpa_math tvm step``: the plain-op route (math SDPA,
  materialised softmax(QK^T)V) under torch.func.jvp and backward; out of memory is recorded;
* ``sdpa_flash bwd``, ``sdpa_cudnn bwd``: PyTorch's flash and cuDNN primal backward.

Causal shapes run our four rows only. ``--kernels``: the CUDA time of each kernel of one
tangent backward (torch.profiler), per non-causal shape, in the JSON and printed.

Times are medians of ``triton.testing.do_bench``; peak memory is the peak allocated during
one call above what was allocated before it (``flash_jvp.bench._measure``): for the backward
rows the forward's saved state is already there, for the step rows only the inputs. Every
row runs in its own try/except (a failure is recorded, the run goes on). FLOP convention
(TFLOP/s columns): fwd = 4 B H L^2 E; bwd = 2.5 fwd (5 GEMMs); the tangent backward = 3 x
bwd = 7.5 fwd (15 GEMMs; our kernels do 23, recomputing S, S_t and dO_t V^T, see
kernels/bwd.py); the TVM step = fwd+JVP (3 fwd) + tangent bwd = 10.5 fwd; fwd+bwd = 3.5 fwd;
halved when causal.
Writes ``<date>-<gpu>-tangent-bwd.{json,md}`` under --out with date, GPU and versions.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import torch

from flash_jvp import attention, bench
from flash_jvp._env import environment
from flash_jvp.reference import math_sdpa

FLOPS = {"bwd": 2.5, "tangent bwd": 7.5, "tvm step": 10.5, "fwd+bwd": 3.5}


def _shape(L: int, E: int, causal: bool) -> bench.Shape:
    return bench.Shape(8 if L <= 1024 else 4, 16 if E <= 72 else 8, L, E, causal)


def _inputs(s: bench.Shape):
    """q, k, v and their tangents (leaves that require grad), do and do_t."""
    q, k, v, tangents, do = bench._tensors(s, True)
    tangents = tuple(t.requires_grad_() for t in tangents)
    return (q, k, v), tangents, do, torch.randn_like(do)


def _jvp(fn, primals, tangents, is_causal):
    return torch.func.jvp(lambda q, k, v: fn(q, k, v, is_causal=is_causal), primals, tangents)


def tangent_bwd(fn):
    """Backward through (o, o_t) after one fwd+JVP (not timed)."""

    def factory(s: bench.Shape):
        primals, tangents, do, do_t = _inputs(s)
        o, o_t = _jvp(fn, primals, tangents, s.is_causal)
        leaves = (*primals, *tangents)
        return lambda: torch.autograd.grad((o, o_t), leaves, (do, do_t), retain_graph=True)

    return factory


def tvm_step(fn):
    """fwd+JVP, then the backward through o and o_t."""

    def factory(s: bench.Shape):
        primals, tangents, do, do_t = _inputs(s)

        def step():
            o, o_t = _jvp(fn, primals, tangents, s.is_causal)
            torch.autograd.grad((o, o_t), (*primals, *tangents), (do, do_t))

        return step

    return factory


_FLASH = bench._backend(bench.SDPBackend.FLASH_ATTENTION)
_CUDNN = bench._backend(bench.SDPBackend.CUDNN_ATTENTION)
# (method, mode, factory)
ROWS = (
    ("flash_jvp", "tangent bwd", tangent_bwd(attention)),
    ("flash_jvp", "bwd", lambda s: bench._bwd(attention, s)),
    ("flash_jvp", "tvm step", tvm_step(attention)),
    ("flash_jvp", "fwd+bwd", lambda s: bench._fwd_bwd(attention, s)),
    ("sdpa_flash", "bwd", lambda s: bench._bwd(_FLASH, s)),
    ("sdpa_cudnn", "bwd", lambda s: bench._bwd(_CUDNN, s)),
    ("sdpa_math", "tangent bwd", tangent_bwd(math_sdpa)),
    ("sdpa_math", "tvm step", tvm_step(math_sdpa)),
)  # fmt: skip


@dataclass
class Row:
    method: str
    mode: str
    B: int
    H: int
    L: int
    E: int
    causal: bool
    dtype: str
    ms: float
    tflops: float
    peak_gib: float
    note: str = ""


def measure(method: str, mode: str, factory, s: bench.Shape) -> Row:
    try:
        ms, peak, note = bench._measure(factory, s)
    except Exception as err:  # noqa: BLE001 - one failing row must not end the run
        ms, peak, note = math.nan, math.nan, f"{type(err).__name__}: {str(err)[:160]}"
        torch.cuda.empty_cache()
    flops = 4.0 * s.B * s.H * s.L * s.L * s.E * FLOPS[mode] * (0.5 if s.is_causal else 1.0)
    tflops = flops / (ms * 1e-3) / 1e12 if math.isfinite(ms) else math.nan
    return Row(method, mode, s.B, s.H, s.L, s.E, s.is_causal, s.dtype, ms, tflops, peak, note)


def kernel_ms(s: bench.Shape) -> dict[str, float]:
    """CUDA ms of each kernel of one of our tangent backwards (summed by kernel name)."""
    fn = tangent_bwd(attention)(s)
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / 1e3, 3) for e in prof.key_averages()
            if e.device_time_total > 0}  # fmt: skip


def ratios(rows: list[Row]) -> list[dict]:
    """The targets' ratios per shape (nan where a row failed)."""
    by = {(r.method, r.mode, r.L, r.E, r.causal): r for r in rows}
    out = []
    for L, E, causal in sorted({(r.L, r.E, r.causal) for r in rows}):

        def get(method, mode, attr, L=L, E=E, causal=causal):
            row = by.get((method, mode, L, E, causal))
            return getattr(row, attr) if row else math.nan

        ours = get("flash_jvp", "tangent bwd", "ms")
        out.append({
            "L": L, "E": E, "causal": causal,
            "tangent bwd / our bwd (target <= 3.0, aim 2.5)": ours / get("flash_jvp", "bwd", "ms"),
            "tvm step peak / our fwd+bwd peak (target <= 1.3)":
                get("flash_jvp", "tvm step", "peak_gib") / get("flash_jvp", "fwd+bwd", "peak_gib"),
            "tvm step / our fwd+bwd, time":
                get("flash_jvp", "tvm step", "ms") / get("flash_jvp", "fwd+bwd", "ms"),
            "math tangent bwd / ours, time": get("sdpa_math", "tangent bwd", "ms") / ours,
            "math tvm step / ours, time":
                get("sdpa_math", "tvm step", "ms") / get("flash_jvp", "tvm step", "ms"),
            "math tvm step / ours, peak":
                get("sdpa_math", "tvm step", "peak_gib") / get("flash_jvp", "tvm step", "peak_gib"),
            "tangent bwd / flash SDPA bwd": ours / get("sdpa_flash", "bwd", "ms"),
            "tangent bwd / cuDNN bwd": ours / get("sdpa_cudnn", "bwd", "ms"),
        })  # fmt: skip
    return out


def markdown(meta: dict, rows: list[Row], ratio_rows: list[dict], kernels: dict) -> str:
    lines = [f"# Backward through the JVP tangent, {meta['date']}", "", "```",
             json.dumps(meta, indent=1), "```", "",
             "| method | mode | B | H | L | E | causal | ms | TFLOP/s | peak GiB | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [
        f"| {r.method} | {r.mode} | {r.B} | {r.H} | {r.L} | {r.E} | {r.causal} | {r.ms:.3f} | "
        f"{r.tflops:.1f} | {r.peak_gib:.2f} | {r.note} |"
        for r in rows
    ]
    if ratio_rows:
        keys = list(ratio_rows[0])
        lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += [
            "| " + " | ".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in rr.values())
            + " |"
            for rr in ratio_rows
        ]  # fmt: skip
    for shape, times in kernels.items():
        lines += ["", f"Kernels of one tangent backward, {shape} (ms):", ""]
        lines += [f"- {name}: {ms:.3f}" for name, ms in sorted(times.items(), key=lambda x: -x[1])]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for the files")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 72, 128])
    parser.add_argument("--no-causal", action="store_true", help="skip the causal rows")
    parser.add_argument("--kernels", action="store_true", help="time each kernel too")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tangent_bwd.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows, kernels = [], {}
    for L in args.lengths:
        for E in args.dims:
            for causal in (False,) if args.no_causal else (False, True):
                s = _shape(L, E, causal)
                for method, mode, factory in ROWS[:4] if causal else ROWS:
                    row = measure(method, mode, factory, s)
                    rows.append(row)
                    print(f"{method:>10} {mode:>12} B{s.B} H{s.H} L{L} E{E} causal {causal}: "
                          f"{row.ms:9.3f} ms {row.tflops:6.1f} TFLOP/s {row.peak_gib:7.2f} GiB "
                          f"{row.note}", flush=True)  # fmt: skip
                if args.kernels and not causal:
                    kernels[f"B{s.B} H{s.H} L{L} E{E}"] = times = kernel_ms(s)
                    print(times, flush=True)
    ratio_rows = ratios(rows)
    for rr in ratio_rows:
        print(" | ".join(f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}"
                         for k, v in rr.items()))  # fmt: skip
    date = dt.datetime.now(dt.timezone.utc)
    meta = {"date": date.isoformat(timespec="seconds"), **environment()}
    os.makedirs(args.out, exist_ok=True)
    gpu = meta.get("gpu", "gpu").replace("NVIDIA ", "").replace(" ", "-").lower()
    stem = os.path.join(args.out, f"{date:%Y-%m-%d}-{gpu}-tangent-bwd")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows], "ratios": ratio_rows,
                   "kernels": kernels}, f, indent=1)  # fmt: skip
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta, rows, ratio_rows, kernels))
    print(f"wrote {stem}.json, .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
