"""``python -m flash_jvp check | bench``: verify against float64 and time against baselines."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.nn.attention.bias import causal_lower_right

from . import _check, _utils, attention, reference, varlen_attention
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
    mask: str = ""  # "", or a key of MASKS; "varlen": B packed sequences of up to Lq tokens

    @property
    def shape(self) -> str:
        heads = f"{self.Hq}" if self.Hq == self.Hkv else f"{self.Hq}/{self.Hkv}"
        ev = "" if self.E == self.Ev else f"/{self.Ev}"
        return f"B{self.B} H{heads} Lq{self.Lq} Lk{self.Lk} E{self.E}{ev}"


def _key_padding(case: Case, gen, device) -> torch.Tensor:
    """(B, 1, 1, Lk) boolean: each sample keeps a random 50-100 % prefix of its keys."""
    keep = torch.randint(case.Lk // 2, case.Lk + 1, (case.B,), generator=gen, device=device)
    return (torch.arange(case.Lk, device=device) < keep[:, None])[:, None, None, :]


def _alibi(case: Case, gen, device) -> torch.Tensor:
    """(1, Hq, Lq, Lk) additive ALiBi bias: -slope_h * |i - j|, in the case's dtype."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, case.Hq + 1, device=device) / case.Hq)
    dist = torch.arange(case.Lq, device=device)[:, None] - torch.arange(case.Lk, device=device)
    return (-slopes[:, None, None] * dist.abs()).to(getattr(torch, case.dtype))[None]


def _random_bool(case: Case, gen, device) -> torch.Tensor:
    """(B, Hq, Lq, Lk) boolean, each entry kept with probability 1/2."""
    shape = (case.B, case.Hq, case.Lq, case.Lk)
    return torch.rand(shape, generator=gen, device=device) < 0.5


MASKS = {
    "key padding": _key_padding,
    "ALiBi bias": _alibi,
    "random bool": _random_bool,
    "lower right": lambda case, gen, device: causal_lower_right(case.Lq, case.Lk),
}


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
    Case("BERT-like, key padding", 8, 12, 12, 512, 512, 64, 64, "bfloat16", mask="key padding"),
    Case("ALiBi bias", 1, 16, 16, 2048, 2048, 128, 128, "float16", mask="ALiBi bias"),
    Case("random mask, E=80", 2, 8, 8, 1000, 1000, 80, 80, "float16", mask="random bool"),
    Case("KV-cache, lower right", 2, 16, 16, 256, 1280, 64, 64, "bfloat16", mask="lower right"),
    Case("packed varlen GQA", 8, 16, 4, 2048, 2048, 128, 128, "bfloat16", True, "varlen"),
)
# Small enough for Triton's interpreter (or the fallback) in about a minute.
CPU_CASES = (
    Case("small", 1, 2, 2, 77, 77, 64, 64, "float32"),
    Case("causal, E=72", 1, 2, 2, 100, 100, 72, 72, "float16", True),
    Case("GQA, Lq != Lk", 1, 4, 2, 33, 65, 32, 32, "float32"),
    Case("one token", 1, 2, 2, 1, 1, 64, 64, "float16"),
    Case("key padding", 2, 2, 2, 65, 65, 32, 32, "float32", mask="key padding"),
    Case("packed varlen", 3, 2, 2, 50, 50, 32, 32, "float16", True, "varlen"),
)


def _inputs(case: Case, device: str, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, case.dtype)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    if case.mask == "varlen":  # packed (total, H, E); lengths 1..Lq
        lengths = torch.randint(1, case.Lq + 1, (case.B,), generator=gen, device=device)
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        total = int(cu[-1])
        q, k = randn(total, case.Hq, case.E), randn(total, case.Hkv, case.E)
        v = randn(total, case.Hkv, case.Ev)
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, is_causal=case.is_causal)
    else:
        q = randn(case.B, case.Hq, case.Lq, case.E)
        k = randn(case.B, case.Hkv, case.Lk, case.E)
        v = randn(case.B, case.Hkv, case.Lk, case.Ev)
        kwargs = dict(is_causal=case.is_causal, enable_gqa=case.Hq != case.Hkv)
        if case.mask:
            kwargs["attn_mask"] = MASKS[case.mask](case, gen, device)
    tangents = tuple(randn(*x.shape) for x in (q, k, v))
    do = randn(*q.shape[:-1], case.Ev)
    return q, k, v, tangents, do, kwargs


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal):
    """flash_jvp.varlen_attention with the longest lengths taken from cu_seqlens."""
    max_q, max_k = (int((cu[1:] - cu[:-1]).max()) for cu in (cu_seqlens_q, cu_seqlens_k))
    return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, is_causal)


def path_name(device: str) -> str:
    if device == "cuda":
        return f"Triton kernels on {torch.cuda.get_device_name()}"
    if _utils.uses_kernels(torch.device(device)):
        return "Triton kernels under TRITON_INTERPRET=1 (CPU)"
    return "pure-PyTorch fallback (CPU, no TRITON_INTERPRET)"


def run_check(device: str, seed: int, console: Console) -> list[dict]:
    cases = CUDA_CASES if device == "cuda" else CPU_CASES
    table = Table(title=f"flash_jvp check: {path_name(device)}")
    for col in ("case", "shape", "dtype", "causal", "mask", *_check.NAMES, "pass"):
        table.add_column(col, justify="right" if col in _check.NAMES else "left")
    rows = []
    for i, case in enumerate(cases):
        q, k, v, tangents, do, kwargs = _inputs(case, device, seed + i)
        if case.mask == "varlen":
            fn, ref_fn = _varlen, reference.varlen_math_sdpa
        else:
            fn, ref_fn = attention, reference.math_sdpa
        comps = _check.check_outputs(fn, q, k, v, tangents, do, ref_fn=ref_fn, **kwargs)
        ok = all(c.ok for c in comps)
        cells = [f"{c.err:.1e}" + ("" if c.ok else f" > {c.tol:.1e}") for c in comps]
        table.add_row(
            case.name, case.shape, case.dtype, str(case.is_causal), case.mask, *cells,
            "[green]pass" if ok else "[red]FAIL",
        )  # fmt: skip
        rows.append({**asdict(case), "pass": ok, "errors": [asdict(c) for c in comps]})
        del q, k, v, tangents, do, kwargs
        if device == "cuda":
            torch.cuda.empty_cache()
    console.print(table)
    console.print(
        f"rel. error vs float64 math SDPA; pass: err <= {_check.RTOL:g} x (math SDPA in the same "
        "dtype) + floor (fp32 2e-5, fp16 1e-3, bf16 4e-3)"
    )
    return rows


def _run_e2e(out: str, quick: bool, console: Console) -> int:
    """benchmarks/e2e.py, which lives beside src/ in a source checkout (it imports the
    examples' DiT), not in the installed package."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "e2e.py").is_file():
        console.print(f"[red]bench --e2e needs a source checkout: no benchmarks/e2e.py in {root}")
        return 2
    sys.path.insert(0, str(root))
    from benchmarks import e2e

    return e2e.main(["--out", out] + (["--quick"] if quick else []))


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
    bench.add_argument(
        "--e2e", action="store_true", help="whole-model training steps (benchmarks/e2e.py)"
    )
    bench.add_argument(
        "--lengths", type=int, nargs="+", metavar="L",
        help="only the shapes of these sequence lengths (1024: where host time matters)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    console = Console(width=None if sys.stdout.isatty() else 160)
    if args.command == "bench" and args.e2e:
        return _run_e2e(args.out, args.quick, console)
    if args.command == "bench":
        from .bench import run_bench

        return run_bench(args.out, args.quick, console, args.lengths)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        console.print(
            "flash_jvp check --device cuda needs a CUDA GPU and a CUDA build of torch "
            f"(this is torch {torch.__version__}, torch.cuda.is_available() is False); "
            "without --device it checks on the CPU."
        )
        return 2
    console.print(f"flash_jvp check on {path_name(device)}; {environment()}")
    rows = run_check(device, args.seed, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
