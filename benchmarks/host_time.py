"""Host time per call of flash_jvp's entry points, side by side with flash SDPA and the floor of
torch.func.jvp, for one or more source trees of flash_jvp (before/after a change) in one run.
(GPU time at L = 1024 against jvp-flash-attention is in ``python -m flash_jvp bench``.)

Host time: each call on a problem too small to keep the GPU busy (B=H=1, L=128, E=64, bf16),
so a loop of calls runs at the speed the host enqueues work (Python, torch's autograd and
torch.func machinery, launches); the mean over ``--calls`` calls after a warm-up, median of
``--repeats`` such loops. Every tree runs in its own subprocess (``PYTHONPATH=<tree>/src``) so
the trees cannot share imported modules; the baselines run in each and are reported from the
first (the spread between trees' baselines shows the machine's noise).

    python benchmarks/host_time.py --tree after=. --tree before=/path/to/old/checkout \\
        --out benchmarks/results

Writes ``<date>-<gpu>-host-time.{json,md}`` with date, GPU, versions and the git commit, and
per row the garbage collections per timed call by generation (a full collection takes
milliseconds where CUDA and Triton are loaded; cProfile would charge it to one function).

``--stub`` (no GPU needed): a proxy for A/B runs of flash_jvp's own Python on a CPU. Calls
run on CPU tensors with ``TRITON_INTERPRET=1`` (so the kernel path is taken) and the
launchers ``_ops.attn_fwd`` / ``_ops.attn_bwd`` replaced by stand-ins that only allocate
their results: what is timed is the API, validation, the autograd.Functions and torch.func's
share, not Triton's launch (~10-25 us per launcher call on the H200, replayed from a plan).
No flash SDPA rows there; figures are this host's, for comparing trees, not the H200's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time


def _host_rows(calls: int, repeats: int, stub: bool, profile=()) -> dict:
    if stub:
        os.environ["TRITON_INTERPRET"] = "1"  # read when flash_jvp is imported
    import torch
    import torch.nn.functional as F
    from torch.autograd import forward_ad as fwAD
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flash_jvp

    device = "cpu" if stub else "cuda"
    sync = (lambda: None) if stub else torch.cuda.synchronize
    if stub:
        _stub_launchers()

    collections = [0, 0, 0]  # garbage collections by generation, while timed
    gc_per_call: dict[str, list[float]] = {}  # per row: collections a call, by generation

    def count(phase, info):
        if phase == "start":
            collections[info["generation"]] += 1

    def per_call(name, fn) -> float:
        for _ in range(20):
            fn()
        sync()
        loops = []
        collections[:] = [0, 0, 0]
        gc.callbacks.append(count)
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            loops.append((time.perf_counter() - start) / calls * 1e6)
        gc.callbacks.remove(count)
        gc_per_call[name] = [n / (calls * repeats) for n in collections]
        return statistics.median(loops)

    def randn(grad=False):
        dtype = torch.float32 if stub else torch.bfloat16  # the interpreter's bf16 is garbage
        x = torch.randn(1, 1, 128, 64, device=device, dtype=dtype)
        return x.requires_grad_(grad)

    q, k, v = randn(), randn(), randn()
    tangents = (randn(), randn(), randn())
    qg, kg, vg = randn(True), randn(True), randn(True)
    do = randn()

    def flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    def forward_ad():
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x, t) for x, t in zip((q, k, v), tangents)]
            return fwAD.unpack_dual(flash_jvp.attention(*duals)).tangent

    def scm_step():
        o, o_t = torch.func.jvp(flash_jvp.attention, (qg, kg, vg), tangents)
        torch.autograd.grad(o, (qg, kg, vg), do + o_t.detach())

    rows = {
        "flash SDPA fwd": lambda: flash(q, k, v),
        "flash SDPA fwd+bwd": lambda: torch.autograd.grad(flash(qg, kg, vg), (qg, kg, vg), do),
        "torch.func.jvp of q * k (floor)": lambda: torch.func.jvp(torch.mul, (q, k), tangents[:2]),
        # what torch.func.jvp costs any function of three inputs (attention's q, k, v)
        "torch.func.jvp of addcmul(q, k, v) (3-input floor)": lambda: torch.func.jvp(
            torch.addcmul, (q, k, v), tangents
        ),
        "forward_ad dual q * k (floor)": lambda: _forward_ad_floor(q, k, tangents),
        "flash_jvp fwd": lambda: flash_jvp.attention(q, k, v),
        "flash_jvp fwd+bwd": lambda: torch.autograd.grad(
            flash_jvp.attention(qg, kg, vg), (qg, kg, vg), do
        ),
        "flash_jvp fwd+JVP (torch.func.jvp)": lambda: torch.func.jvp(
            flash_jvp.attention, (q, k, v), tangents
        ),
        "flash_jvp fwd+JVP (forward_ad)": forward_ad,
        "flash_jvp sCM step (jvp + backward)": scm_step,
    }
    if stub:
        rows = {name: fn for name, fn in rows.items() if not name.startswith("flash SDPA")}
    out = {"host_us": {name: per_call(name, fn) for name, fn in rows.items()}}
    out["gc_per_call"] = gc_per_call
    if profile:
        out["profiles"] = {name: _profile(rows[name], calls, sync) for name in profile}
    return out


def _profile(fn, calls: int, sync, top: int = 30) -> str:
    """cProfile of ``calls`` warm calls of fn: the functions with the most own time (where the
    host time goes: e.g. a launcher run where a replayed plan was expected). The garbage
    collector is off meanwhile: cProfile charges a collection to whichever function happened
    to allocate (a full one takes milliseconds in a process with CUDA and Triton loaded);
    the timed rows count collections instead (``gc_per_call``)."""
    import cProfile
    import io
    import pstats

    import torch

    prof = cProfile.Profile()
    # CUDA backward passes run on autograd's device threads, which cProfile does not see
    with torch.autograd.set_multithreading_enabled(False):
        gc.collect()
        gc.disable()
        try:
            prof.enable()
            for _ in range(calls):
                fn()
            sync()
            prof.disable()
        finally:
            gc.enable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return f"{calls} calls, garbage collector off\n" + text.getvalue()


def _stub_launchers() -> None:
    """Replace the launchers by stand-ins that allocate their results and launch nothing."""
    from flash_jvp import _ops

    def attn_fwd(q, k, v, q_t, k_t, v_t, mask, mask_t, spec):
        tangent = any(t is not None for t in (q_t, k_t, v_t, mask_t))
        o = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        return o, torch.empty_like(o) if tangent else None, lse, torch.empty_like(lse)

    def attn_bwd(do, q, k, v, o, lse, mask, spec, mask_grad=False, dlse=None):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None

    import torch

    _ops.attn_fwd, _ops.attn_bwd = attn_fwd, attn_bwd


def _forward_ad_floor(q, k, tangents):
    from torch.autograd import forward_ad as fwAD

    with fwAD.dual_level():
        return fwAD.unpack_dual(fwAD.make_dual(q, tangents[0]) * k).tangent


def _child(args) -> None:
    print("RESULT " + json.dumps(_host_rows(args.calls, args.repeats, args.stub, args.profile)))


def _run_tree(path: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(path), "src"))
    cmd = [sys.executable, __file__, "--child", "--calls", str(args.calls), "--repeats",
           str(args.repeats), *(["--stub"] if args.stub else []),
           *(f"--profile={name}" for name in args.profile)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}


def _markdown(meta: dict, results: dict[str, dict]) -> str:
    trees = list(results)
    lines = [f"# flash_jvp host time, {meta['date']}", "", "```", json.dumps(meta, indent=1),
             "```", "", f"Host time per call (us), {meta['problem']} "
             "(median of loops of calls):", "",
             "| call | " + " | ".join(trees) + " |", "|---|" + "---|" * len(trees)]  # fmt: skip
    names = next(iter(r["host_us"] for r in results.values() if "host_us" in r), {})
    for name in names:
        cells = [f"{results[t].get('host_us', {}).get(name, math.nan):.1f}" for t in trees]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    gcs = {t: r["gc_per_call"] for t, r in results.items() if "gc_per_call" in r}
    if gcs:
        lines += ["", "Garbage collections per 1000 timed calls, generations 0/1/2:", "",
                  "| call | " + " | ".join(gcs) + " |", "|---|" + "---|" * len(gcs)]  # fmt: skip
        for name in names:
            cells = ["/".join(f"{1000 * n:.0f}" for n in g.get(name, ())) for g in gcs.values()]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for tree, res in results.items():
        if "error" in res:
            lines += ["", f"{tree}: failed: {res['error']}"]
        gpu = res.get("gpu_rows")
        if gpu:
            keys = list(gpu[0])
            lines += ["", f"Eager fwd+JVP at L = 1024 ({tree}; ms include host time):", "",
                      "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]  # fmt: skip
            for row in gpu:
                lines.append(
                    "| "
                    + " | ".join(
                        f"{x:.3f}" if isinstance(x, float) else str(x) for x in row.values()
                    )
                    + " |"
                )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a flash_jvp source tree to time (repeatable; default: this one)",
    )
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--stub",
        action="store_true",
        help="CPU proxy: flash_jvp's Python with allocation-only launchers (no GPU needed)",
    )
    parser.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="ROW",
        help="also cProfile this row (its name as in the table; repeatable) in every tree, "
        "written to <date>-<gpu>-host-profile.txt",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return 0
    import torch

    if not args.stub and not torch.cuda.is_available():
        print("host_time.py needs a CUDA GPU (or --stub for the CPU proxy)")
        return 2
    trees = [t.split("=", 1) for t in args.tree] or [["this tree", "."]]
    results = {name: _run_tree(path, args) for name, path in trees}
    profiles = {tree: res.pop("profiles", {}) for tree, res in results.items()}
    sys.path.insert(0, os.path.join(os.path.abspath(trees[0][1]), "src"))
    from flash_jvp._env import environment

    date = dt.datetime.now(dt.timezone.utc)
    meta = {"date": date.isoformat(timespec="seconds"), **environment(),
            "trees": dict(trees), "problem": "B=H=1, L=128, E=64, "
            + ("float32 on the CPU, stub launchers" if args.stub else "bf16")}  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    gpu = meta.get("gpu", "gpu").replace("NVIDIA ", "").replace(" ", "-").lower()
    kind = "cpu-host-time-stub" if args.stub else f"{gpu}-host-time"
    stem = os.path.join(args.out, f"{date:%Y-%m-%d}-{kind}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(_markdown(meta, results))
    if args.profile:
        with open(stem.replace("host-time", "host-profile") + ".txt", "w") as f:
            for tree, texts in profiles.items():
                for name, text in texts.items():
                    f.write(f"##### {tree} ({meta.get('git')}): {name}\n{text}\n")
    print(_markdown(meta, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
