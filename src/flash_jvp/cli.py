"""``python -m flash_jvp check | bench``: verify against float64 and time against baselines."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table

from . import _check, _utils, attention
from ._env import environment


@dataclass(frozen=True)
class Case:
    name: str
    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lk: int
    E: int
    Ev: int
    dtype: str
    is_causal: bool = False

    @property
    def shape(self) -> str:
        heads = f"{self.Hq}" if self.Hq == self.Hkv else f"{self.Hq}/{self.Hkv}"
        ev = "" if self.E == self.Ev else f"/{self.Ev}"
        return f"B{self.B} H{heads} Lq{self.Lq} Lk{self.Lk} E{self.E}{ev}"


# Shapes of real models: DiT-XL/2 (16 heads of 72), SD3 (24 of 64), Flux/Wan (24 of 128),
# a GQA decoder, text cross-attention, and odd lengths/head dims.
CUDA_CASES = (
    Case("DiT-XL/2 256px", 2, 16, 16, 256, 256, 72, 72, "bfloat16"),
    Case("DiT-XL/2 512px", 1, 16, 16, 1024, 1024, 72, 72, "bfloat16"),
    Case("DiT-XL/2 512px fp16", 1, 16, 16, 1024, 1024, 72, 72, "float16"),
    Case("SD3-like", 1, 24, 24, 4096, 4096, 64, 64, "bfloat16"),
    Case("Flux/Wan-like", 1, 24, 24, 4096, 4096, 128, 128, "bfloat16"),
    Case("GQA decoder causal", 1, 32, 8, 2048, 2048, 128, 128, "bfloat16", True),
    Case("cross-attn to 77 tokens", 2, 16, 16, 1024, 77, 64, 64, "bfloat16"),
    Case("causal odd length, E=80", 1, 16, 16, 1000, 1000, 80, 80, "float16", True),
    Case("fp32 (IEEE)", 1, 8, 8, 512, 512, 64, 64, "float32"),
)
# Small enough for Triton's interpreter (or the fallback) in about a minute.
CPU_CASES = (
    Case("small", 1, 2, 2, 77, 77, 64, 64, "float32"),
    Case("causal, E=72", 1, 2, 2, 100, 100, 72, 72, "float16", True),
    Case("GQA, Lq != Lk", 1, 4, 2, 33, 65, 32, 32, "float32"),
    Case("one token", 1, 2, 2, 1, 1, 64, 64, "float16"),
)


def _inputs(case: Case, device: str, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, case.dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q = randn(case.B, case.Hq, case.Lq, case.E)
    k = randn(case.B, case.Hkv, case.Lk, case.E)
    v = randn(case.B, case.Hkv, case.Lk, case.Ev)
    tangents = tuple(randn(*x.shape) for x in (q, k, v))
    do = randn(case.B, case.Hq, case.Lq, case.Ev)
    return q, k, v, tangents, do


def path_name(device: str) -> str:
    if device == "cuda":
        return f"Triton kernels on {torch.cuda.get_device_name()}"
    if _utils.uses_kernels(torch.device(device)):
        return "Triton kernels under TRITON_INTERPRET=1 (CPU)"
    return "pure-PyTorch fallback (CPU, no TRITON_INTERPRET)"


def run_check(device: str, seed: int, console: Console) -> list[dict]:
    cases = CUDA_CASES if device == "cuda" else CPU_CASES
    table = Table(title=f"flash_jvp check: {path_name(device)}")
    for col in ("case", "shape", "dtype", "causal", *_check.NAMES, "pass"):
        table.add_column(col, justify="right" if col in _check.NAMES else "left")
    rows = []
    for i, case in enumerate(cases):
        q, k, v, tangents, do = _inputs(case, device, seed + i)
        comps = _check.check_outputs(
            attention, q, k, v, tangents, do, is_causal=case.is_causal,
            enable_gqa=case.Hq != case.Hkv,
        )  # fmt: skip
        ok = all(c.ok for c in comps)
        cells = [f"{c.err:.1e}" + ("" if c.ok else f" > {c.tol:.1e}") for c in comps]
        table.add_row(
            case.name, case.shape, case.dtype, str(case.is_causal), *cells,
            "[green]pass" if ok else "[red]FAIL",
        )  # fmt: skip
        rows.append({**asdict(case), "pass": ok, "errors": [asdict(c) for c in comps]})
        del q, k, v, tangents, do
        if device == "cuda":
            torch.cuda.empty_cache()
    console.print(table)
    console.print(
        f"rel. error vs float64 math SDPA; pass: err <= {_check.RTOL:g} x (math SDPA in the same "
        "dtype) + floor (fp32 2e-5, fp16 1e-3, bf16 4e-3)"
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flash_jvp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="verify o, o_t, dq, dk, dv against float64 math SDPA")
    check.add_argument("--device", choices=("cuda", "cpu"), default=None)
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--json", help="also write the rows to this JSON file")
    bench = sub.add_parser("bench", help="time against math-SDPA JVP and flash SDPA (CUDA)")
    bench.add_argument("--out", default="benchmarks/results", help="folder for JSON + markdown")
    bench.add_argument("--quick", action="store_true", help="a few points only")
    args = parser.parse_args(argv)

    console = Console(width=None if sys.stdout.isatty() else 160)
    if args.command == "bench":
        from .bench import run_bench

        return run_bench(args.out, args.quick, console)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    console.print(f"flash_jvp check on {path_name(device)}; {environment()}")
    rows = run_check(device, args.seed, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
