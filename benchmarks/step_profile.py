"""Where a training step's GPU time goes, by kernel kind and by kernel (H200; ~1 min).

Builds an ``benchmarks.e2e`` model at a reduced depth, runs one step per method under
torch.profiler and prints, per method: GPU-busy ms split into GEMMs, attention, elementwise,
reductions and the rest (by kernel name), and the top kernels by total time.

    python -m benchmarks.step_profile [--rows dit256,lm4k] [--depth 4] [--methods ...]
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from dataclasses import replace

import torch

import flash_jvp.nn
from benchmarks import e2e

KINDS = (
    ("attention", e2e.KERNEL_RE),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|xmma|sm90_|sm80_|cublas", re.I)),
    ("reduce", re.compile(r"reduce|norm|softmax", re.I)),
    ("elementwise", re.compile(r"elementwise|triton_|cat|copy|fill", re.I)),
)


def kind(name: str) -> str:
    return next((k for k, rx in KINDS if rx.search(name)), "other")


def profile(step) -> dict[str, tuple[float, int]]:
    """kernel name -> (total us, launches) over one call of step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            out[e.name][0] += e.device_time_total
            out[e.name][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def host_profile(step, calls: int = 3, top: int = 30) -> str:
    """cProfile of ``calls`` steps (after the timed ones: warm), the functions with the most
    own time and the most cumulative time."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def report(title: str, kernels: dict[str, tuple[float, int]], top: int) -> str:
    total = sum(us for us, _ in kernels.values())
    by_kind: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for name, (us, n) in kernels.items():
        by_kind[kind(name)][0] += us
        by_kind[kind(name)][1] += n
    lines = [
        f"## {title}: GPU-busy {total / 1e3:.1f} ms, {sum(n for _, n in kernels.values())} launches"
    ]
    for k, (us, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {k:12s} {us / 1e3:8.2f} ms {us / total:6.1%} {n:6d} launches")
    lines.append("  top kernels:")
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {us / 1e3:8.2f} ms {n:5d}x  {name[:140]}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="dit256,lm4k")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--methods", default="flash_jvp,flash_jvp nn,sdpa no-JVP")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--host", action="store_true", help="also cProfile the host side")
    args = p.parse_args(argv)
    device, dtype = torch.device("cuda"), torch.float32
    for name in args.rows.split(","):
        spec = replace(e2e.SPECS[name], depth=args.depth)
        model = e2e.build(spec, "flash_jvp", device, dtype)
        inp = e2e.make_inputs(spec, device, dtype)
        for method_name in args.methods.split(","):
            method = e2e.METHODS[method_name]
            e2e.set_attention(model, method.attention)
            flash_jvp.nn.revert(model)
            if method.fused:
                flash_jvp.nn.convert(model, types=e2e.FUSABLE)
            step = e2e.step_fn(model, inp, jvp=method.jvp)
            ms = e2e._time(step, 2, 5)
            title = f"{spec.label}, {spec.depth} blocks, batch {spec.batch}: {method_name}"
            print(
                report(
                    f"{title} ({sorted(ms)[len(ms) // 2]:.1f} ms/step)", profile(step), args.top
                ),
                flush=True,
            )
            if args.host:
                print(host_profile(step), flush=True)
        del model, inp
        e2e._free()


if __name__ == "__main__":
    main()
