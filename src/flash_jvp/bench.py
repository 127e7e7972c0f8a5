"""``python -m flash_jvp bench``: flash_jvp against PyTorch's SDPA backends, side by side.

FLOP convention (per forward, halved when causal): fwd = 4 B H Lq Lk E; fwd+JVP = 3 x fwd
(QK^T, PV, Q_tK^T, QK_t^T, (P o S_t)V, PV_t) = 12 B H Lq Lk E; bwd = 2.5 x fwd;
fwd+JVP+bwd = 5.5 x fwd; fwd+bwd = 3.5 x fwd. Times are medians of CUDA-event timings
(``triton.testing.do_bench``); memory is the peak allocated during one call, inputs excluded.
Each method's inputs are fresh random tensors; nothing is timed on zeros. On the long
non-causal E=64 shapes it also times a 10 % key-padding mask against no mask, and a packed
(varlen) batch of lengths L, 3L/4, L/2, L/4 against the same batch padded to L with a
key-padding mask (their TFLOP/s use the dense shape's nominal FLOPs: compare times). Short
shapes (L <= 1024) are also timed replayed from a CUDA graph, without host time.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import attention, varlen_attention
from ._env import environment

GIB = 2**30
FLOP_FACTOR = {"fwd": 1.0, "fwd+jvp": 3.0, "bwd": 2.5, "fwd+jvp+bwd": 5.5, "fwd+bwd": 3.5}


@dataclass(frozen=True)
class Shape:
    B: int
    H: int
    L: int
    E: int
    is_causal: bool
    dtype: str = "bfloat16"

    def flops(self, mode: str) -> float:
        fwd = 4.0 * self.B * self.H * self.L * self.L * self.E
        return fwd * FLOP_FACTOR[mode] * (0.5 if self.is_causal else 1.0)


def shapes(quick: bool) -> list[Shape]:
    """Long sequences (B=4) at E=64/128; short ones with many heads as in DiT at 256 px
    (B*H = 1024); head dims that are not powers of two (DiT-XL/2: 72, ViT-H: 80)."""
    lengths = (1024, 4096, 8192) if quick else (1024, 2048, 4096, 8192, 16384)
    out = [Shape(4, 16, n, 64, False) for n in lengths]
    out += [Shape(4, 16, n, 64, True) for n in lengths]
    out += [Shape(4, 8, n, 128, causal) for causal in (False, True) for n in lengths]
    # with B1 H32 E64: the L = 1024 shapes issue #16 compares against jvp-flash-attention on
    out += [Shape(1, 32, 1024, 64, causal) for causal in (False, True)]
    out += [Shape(64, 16, n, 64, False) for n in ((256, 1024) if quick else (256, 512, 1024))]
    out += [Shape(64, 16, 256, 72, False)]  # DiT-XL/2 at 256 px
    out += [Shape(4, 16, 4096, e, False) for e in ((72,) if quick else (72, 80, 96))]
    return out


def _tensors(s: Shape, requires_grad: bool):
    dtype = getattr(torch, s.dtype)

    def randn():
        return torch.randn(s.B, s.H, s.L, s.E, device="cuda", dtype=dtype)

    q, k, v = (randn().requires_grad_(requires_grad) for _ in range(3))
    return q, k, v, tuple(randn() for _ in range(3)), randn()


def _jvp(fn, s: Shape) -> Callable[[], object]:
    q, k, v, tangents, _ = _tensors(s, False)
    return lambda: torch.func.jvp(lambda q, k, v: fn(q, k, v, is_causal=s.is_causal), (q, k, v),
                                  tangents)  # fmt: skip


def _jvp_bwd(fn, s: Shape) -> Callable[[], object]:
    """The sCM/MeanFlow step: a JVP, then backward of a loss on o (o_t enters detached)."""
    q, k, v, tangents, do = _tensors(s, True)

    def step():
        o, o_t = torch.func.jvp(lambda q, k, v: fn(q, k, v, is_causal=s.is_causal), (q, k, v),
                                tangents)  # fmt: skip
        torch.autograd.grad(o, (q, k, v), do + o_t.detach())

    return step


def _fwd(fn, s: Shape) -> Callable[[], object]:
    q, k, v, _, _ = _tensors(s, False)
    return lambda: fn(q, k, v, is_causal=s.is_causal)


def _fwd_bwd(fn, s: Shape) -> Callable[[], object]:
    q, k, v, _, do = _tensors(s, True)
    return lambda: torch.autograd.grad(fn(q, k, v, is_causal=s.is_causal), (q, k, v), do)


def _bwd(fn, s: Shape) -> Callable[[], object]:
    q, k, v, _, do = _tensors(s, True)
    o = fn(q, k, v, is_causal=s.is_causal)
    return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)


def _backend(backend: SDPBackend):
    def fn(q, k, v, is_causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return fn


def _key_padding(s: Shape, frac: float = 0.1) -> torch.Tensor:
    """(B, 1, 1, L) boolean: the last ``frac`` of every sample's keys are padding."""
    keep = torch.arange(s.L, device="cuda") < round(s.L * (1 - frac))
    return keep.expand(s.B, 1, 1, s.L)


def _padded(fn, s: Shape):
    """fn with a 10 % key-padding mask (attn_mask and is_causal exclude each other)."""
    mask = _key_padding(s)
    return lambda q, k, v, is_causal: fn(q, k, v, attn_mask=mask)


def _lengths(s: Shape) -> list[int]:
    """Mixed lengths for the packed-vs-padded comparison: L, 3L/4, L/2, L/4, ... (B of them)."""
    return [max(1, s.L * (4 - i % 4) // 4) for i in range(s.B)]


def _varlen_jvp(s: Shape) -> Callable[[], object]:
    """fwd+JVP of a packed batch of the lengths :func:`_lengths` (no padding)."""
    lengths = torch.tensor(_lengths(s), device="cuda")
    cu = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    shape = (int(cu[-1]), s.H, s.E)
    q, k, v, *tangents = (torch.randn(shape, device="cuda", dtype=getattr(torch, s.dtype))
                          for _ in range(6))  # fmt: skip

    def fn(q, k, v):
        return varlen_attention(q, k, v, cu, cu, s.L, s.L)

    return lambda: torch.func.jvp(fn, (q, k, v), tuple(tangents))


def _graphed(factory) -> Callable[[Shape], Callable[[], object]]:
    """factory's call captured in a CUDA graph; times its replay (no host work per call, as in
    a training loop under CUDA graphs or torch.compile's reduce-overhead mode)."""

    def build(s: Shape) -> Callable[[], object]:
        fn = factory(s)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (compiles) off the capture
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    return build


def _padded_dense_jvp(s: Shape) -> Callable[[], object]:
    """The same batch as :func:`_varlen_jvp`, padded to L with a key-padding mask."""
    keep = torch.arange(s.L, device="cuda") < torch.tensor(_lengths(s), device="cuda")[:, None]
    mask = keep[:, None, None, :]
    return _jvp(lambda q, k, v, is_causal: attention(q, k, v, attn_mask=mask), s)


# (method, mode, factory): each factory builds inputs and returns the callable to time.
METHODS = (
    ("flash_jvp", "fwd", lambda s: _fwd(attention, s)),
    ("flash_jvp", "fwd+jvp", lambda s: _jvp(attention, s)),
    ("flash_jvp", "bwd", lambda s: _bwd(attention, s)),
    ("flash_jvp", "fwd+jvp+bwd", lambda s: _jvp_bwd(attention, s)),
    ("sdpa_flash", "fwd", lambda s: _fwd(_backend(SDPBackend.FLASH_ATTENTION), s)),
    ("sdpa_flash", "bwd", lambda s: _bwd(_backend(SDPBackend.FLASH_ATTENTION), s)),
    ("sdpa_flash", "fwd+bwd", lambda s: _fwd_bwd(_backend(SDPBackend.FLASH_ATTENTION), s)),
    ("sdpa_cudnn", "fwd", lambda s: _fwd(_backend(SDPBackend.CUDNN_ATTENTION), s)),
    ("sdpa_cudnn", "bwd", lambda s: _bwd(_backend(SDPBackend.CUDNN_ATTENTION), s)),
    ("sdpa_math", "fwd+jvp", lambda s: _jvp(_backend(SDPBackend.MATH), s)),
)
# Masks and packed batches, on the long non-causal E=64 shapes: 10 % key padding against no
# mask, and a packed batch of mixed lengths against the same batch padded (nominal FLOPs
# of the dense shape for all of them, so compare times).
MASK_METHODS = (
    ("flash_jvp pad10%", "fwd+jvp", lambda s: _jvp(_padded(attention, s), s)),
    ("flash_jvp pad10%", "fwd+jvp+bwd", lambda s: _jvp_bwd(_padded(attention, s), s)),
    ("flash_jvp varlen", "fwd+jvp", _varlen_jvp),
    ("flash_jvp padded", "fwd+jvp", _padded_dense_jvp),
)


def _jvp_flash_attention(q, k, v, is_causal):
    """The pip package jvp-flash-attention (its fwd_dual is what it documents for
    torch.func.jvp); imported on use, so bench runs without it."""
    from jvp_flash_attention.jvp_attention import JVPAttn

    return JVPAttn.fwd_dual(q, k, v, causal=is_causal)


# L = 1024, where host time matters: eager fwd+JVP against the pip package jvp-flash-attention
# (0.14 measured faster than us here before; a missing package is recorded as the row's note).
L1024_METHODS = (("jvp_flash_attention", "fwd+jvp", lambda s: _jvp(_jvp_flash_attention, s)),)
# Short sequences (L <= 1024), where host time per call exceeds the kernels' time: the same
# calls replayed from a CUDA graph.
GRAPH_METHODS = (
    ("flash_jvp graph", "fwd+jvp", _graphed(lambda s: _jvp(attention, s))),
    ("sdpa_flash graph", "fwd", _graphed(lambda s: _fwd(_backend(SDPBackend.FLASH_ATTENTION), s))),
)


@dataclass
class Row:
    method: str
    mode: str
    B: int
    H: int
    L: int
    E: int
    is_causal: bool
    dtype: str
    ms: float
    tflops: float
    peak_gib: float
    note: str = ""


def _measure(factory, s: Shape) -> tuple[float, float, str]:
    """(median ms, peak GiB above the inputs, "") or (nan, nan, why) when out of memory or
    refused (cuDNN has no kernel for some shapes)."""
    from triton.testing import do_bench

    torch.cuda.empty_cache()
    fn = None
    try:
        fn = factory(s)
        fn()  # compile / warm up
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / GIB
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    except torch.OutOfMemoryError:
        return math.nan, math.nan, "out of memory"
    except (RuntimeError, ImportError) as err:  # a backend without a kernel here, or absent
        return math.nan, math.nan, str(err).splitlines()[0][:120]
    finally:
        fn = None
        torch.cuda.empty_cache()
    return ms, peak, ""


def host_overhead(calls: int = 50, loops: int = 5) -> dict[str, float]:
    """Host time per call (microseconds) of each method on a problem too small to keep the
    GPU busy (B=H=1, L=128, E=64), so the loop runs at the speed the host enqueues work:
    Python, torch's autograd/torch.func machinery and the kernel launches. The median of
    ``loops`` loops of ``calls`` calls, so one garbage collection does not set the figure.
    This runs after the sweep, in a process holding every compiled kernel, where every row
    (flash SDPA's too) reads slower than in the fresh processes of benchmarks/host_time.py,
    the measure the host-time targets are stated in: compare rows within one table."""
    import statistics
    import time

    def per_call(fn) -> float:
        try:
            for _ in range(20):
                fn()
        except (RuntimeError, ImportError):  # a backend without a kernel here, or absent
            return math.nan
        times = []
        for _ in range(loops):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / calls * 1e6)
        return statistics.median(times)

    s = Shape(1, 1, 128, 64, False)
    methods = METHODS + L1024_METHODS
    out = {f"{method} {mode}": per_call(factory(s)) for method, mode, factory in methods}
    # The floor of any kernel behind torch.func.jvp: the transform's own work per call.
    q, k, _, tangents, _ = _tensors(s, False)
    out["torch.func.jvp of q * k (floor)"] = per_call(
        lambda: torch.func.jvp(torch.mul, (q, k), tangents[:2])
    )
    return out


def ratios(rows: list[Row]) -> list[dict]:
    """Time ratios the performance targets are stated in, per shape."""
    by = {(r.method, r.mode, r.B, r.H, r.L, r.E, r.is_causal): r for r in rows}
    out = []
    for r in rows:
        if (r.method, r.mode) != ("flash_jvp", "fwd+jvp"):
            continue
        key = (r.B, r.H, r.L, r.E, r.is_causal)

        def ms(method, mode, key=key):
            row = by.get((method, mode, *key))
            return row.ms if row else math.nan

        def fastest(mode):
            return min((ms(m, mode) for m in ("sdpa_flash", "sdpa_cudnn")),
                       key=lambda t: t if math.isfinite(t) else math.inf)  # fmt: skip

        dense = by.get(("flash_jvp", "fwd+jvp", r.B, r.H, r.L, r.E, False))
        out.append(
            {
                "B": r.B, "H": r.H, "L": r.L, "E": r.E, "is_causal": r.is_causal,
                "fwd+jvp / flash fwd": ms("flash_jvp", "fwd+jvp") / ms("sdpa_flash", "fwd"),
                "fwd+jvp / cuDNN fwd": ms("flash_jvp", "fwd+jvp") / ms("sdpa_cudnn", "fwd"),
                "fwd / cuDNN fwd": ms("flash_jvp", "fwd") / ms("sdpa_cudnn", "fwd"),
                # fwd and bwd are timed apart: the step is their sum, for both
                "fwd+bwd / cuDNN fwd+bwd": (ms("flash_jvp", "fwd") + ms("flash_jvp", "bwd"))
                    / (ms("sdpa_cudnn", "fwd") + ms("sdpa_cudnn", "bwd")),
                "causal / non-causal TFLOP/s, fwd+jvp":
                    r.tflops / dense.tflops if r.is_causal and dense else math.nan,
                "fwd+jvp+bwd / flash fwd+bwd":
                    ms("flash_jvp", "fwd+jvp+bwd") / ms("sdpa_flash", "fwd+bwd"),
                "bwd / fastest SDPA bwd": ms("flash_jvp", "bwd") / fastest("bwd"),
                "math jvp / fwd+jvp": ms("sdpa_math", "fwd+jvp") / ms("flash_jvp", "fwd+jvp"),
                "pad10% / no mask, fwd+jvp":
                    ms("flash_jvp pad10%", "fwd+jvp") / ms("flash_jvp", "fwd+jvp"),
                "pad10% / no mask, fwd+jvp+bwd":
                    ms("flash_jvp pad10%", "fwd+jvp+bwd") / ms("flash_jvp", "fwd+jvp+bwd"),
                "varlen / padded, fwd+jvp":
                    ms("flash_jvp varlen", "fwd+jvp") / ms("flash_jvp padded", "fwd+jvp"),
                "graphed: fwd+jvp / flash fwd":
                    ms("flash_jvp graph", "fwd+jvp") / ms("sdpa_flash graph", "fwd"),
                "jvp-flash-attention / ours, fwd+jvp":
                    ms("jvp_flash_attention", "fwd+jvp") / ms("flash_jvp", "fwd+jvp"),
            }
        )  # fmt: skip
    return out


def _markdown(meta: dict, rows: list[Row], ratio_rows: list[dict], host_us: dict) -> str:
    lines = [f"# flash_jvp bench, {meta['date']}", "", "```", json.dumps(meta, indent=1), "```", ""]
    lines += ["| method | mode | B | H | L | E | causal | ms | TFLOP/s | peak GiB | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r.method} | {r.mode} | {r.B} | {r.H} | {r.L} | {r.E} | {r.is_causal} | "
            f"{r.ms:.3f} | {r.tflops:.1f} | {r.peak_gib:.2f} | {r.note} |"
        )
    if ratio_rows:
        keys = list(ratio_rows[0])
        lines += ["", "Ratios (of times: lower is better for ours; of TFLOP/s: higher):", "",
                  "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]  # fmt: skip
        for rr in ratio_rows:
            lines.append(
                "| "
                + " | ".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in rr.values())
                + " |"  # fmt: skip
            )
    lines += ["", "Host time per call (us) at B=H=1, L=128, E=64, where the GPU waits on the host "
              "(median of 5 loops of 50 calls):",
              "", "| method | us |", "|---|---|"]  # fmt: skip
    lines += [f"| {name} | {us:.1f} |" for name, us in host_us.items()]
    return "\n".join(lines) + "\n"


def _plot(rows: list[Row], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = sorted({(r.E, r.is_causal) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (e, causal) in zip(axes[0], panels):
        for method, mode in sorted({(r.method, r.mode) for r in rows}):
            pts = [(r.L, r.tflops) for r in rows if (r.method, r.mode, r.E, r.is_causal) ==
                   (method, mode, e, causal) and math.isfinite(r.tflops)]  # fmt: skip
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{method} {mode}")
        ax.set(xscale="log", xlabel="L", ylabel="TFLOP/s", title=f"E={e} causal={causal}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_bench(out_dir: str, quick: bool, console: Console, lengths=None) -> int:
    """Every shape of :func:`shapes` (only those of sequence length in ``lengths`` if given)
    against the baselines, then the ratio table and host time per call."""
    if not torch.cuda.is_available():
        console.print("[red]bench needs a CUDA GPU")
        return 2
    rows = []
    for s in (s for s in shapes(quick) if not lengths or s.L in lengths):
        extra = MASK_METHODS if s.E == 64 and not s.is_causal and s.L >= 4096 else ()
        extra += GRAPH_METHODS if s.L <= 1024 else ()
        extra += L1024_METHODS if s.L == 1024 and s.B * s.H <= 64 else ()
        for method, mode, factory in METHODS + extra:
            ms, peak, note = _measure(factory, s)
            tflops = s.flops(mode) / (ms * 1e-3) / 1e12 if math.isfinite(ms) else math.nan
            rows.append(Row(method, mode, s.B, s.H, s.L, s.E, s.is_causal, s.dtype, ms, tflops,
                            peak, note))  # fmt: skip
            console.print(
                f"{method:>10} {mode:>12} B{s.B} H{s.H} L{s.L} E{s.E} causal={s.is_causal}: "
                f"{ms:8.3f} ms {tflops:7.1f} TFLOP/s {peak:6.2f} GiB {note}"
            )
    ratio_rows = ratios(rows)
    table = Table(title="flash_jvp time ratios")
    for key in ratio_rows[0]:
        table.add_column(key)
    for rr in ratio_rows:
        table.add_row(*(f"{x:.2f}" if isinstance(x, float) else str(x) for x in rr.values()))
    console.print(table)
    host_us = host_overhead()
    for name, us in host_us.items():
        console.print(f"host time per call, {name}: {us:7.1f} us")

    date = dt.datetime.now(dt.timezone.utc)
    meta = {"date": date.isoformat(timespec="seconds"), **environment()}
    os.makedirs(out_dir, exist_ok=True)
    gpu = meta.get("gpu", "gpu").replace("NVIDIA ", "").replace(" ", "-").lower()
    stem = os.path.join(out_dir, f"{date:%Y-%m-%d}-{gpu}-bench")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows], "ratios": ratio_rows,
                   "host_us_per_call": host_us}, f, indent=1)  # fmt: skip
    with open(stem + ".md", "w") as f:
        f.write(_markdown(meta, rows, ratio_rows, host_us))
    _plot(rows, stem + ".png")
    console.print(f"wrote {stem}.json, .md, .png")
    return 0
