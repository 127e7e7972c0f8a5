"""Prototype (issue 25's backward): the primal backward in one Triton kernel per key block,
dq added by TMA reductions, against our two kernels (dK/dV, then dQ; kernels/bwd.py).
Not used by the library.

    python benchmarks/fused_dq_bwd.py compile            # sm_90 compile report, any machine
    python benchmarks/fused_dq_bwd.py check              # dq, dk, dv against float64 (Hopper)
    python benchmarks/fused_dq_bwd.py time [--out DIR]   # against our backward (Hopper)

Why: our backward recomputes Q K^T and dO V^T in the dQ kernel, 7 GEMMs where 5 do. A
program of BLOCK_N keys already holds dS^T for each query block; dq += dS K is one more
GEMM, summed over key blocks in a float32 buffer by ``cp.reduce.async.bulk`` (Triton's
``tensor_descriptor.atomic_add``, a TMA reduction into L2), as FlashAttention-3's backward
(Shah et al., 2024, sec. 3.1). The benchmarks/gluon_bwd.py DQ variant added dq element by
element with fp32 atomics: 0.59-0.67x our two kernels' speed (results/2026-12-07-h100-
gluon-bwd-dkdv-80271b7.md). Scope: fp16/bf16, HEAD_DIM 64 or 128, no mask, no GQA, dense,
causal with Lq == Lk (top-left).

Measured on an H100 (results/2026-12-07-h100-fused-dq-bwd-6818dfa.md): as accurate as ours,
0.46-0.89x our two kernels' speed; the best variant per head dim 0.77-0.88x (benchmarks/
NOTES.md, twenty-fifth session).
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import triton
import triton.language as tl
from gluon_bwd import _grads, _inputs, _rel, _stats, _triton_bwd_ms, cli, write_results
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _fused_inner(dk, dv, k, v, q_desc, do_desc, dq_desc, LSE, DELTA, row_base, offs_n, off_b,
                 off_h, lo, hi, qk_scale, Lq, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                 MASK: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """Query blocks lo .. hi of one key block; MASK: the causal diagonal's blocks."""
    for start_m in tl.range(lo, hi, BLOCK_M, num_stages=STAGES):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = q_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        do = do_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        # rows past Lq: lse +inf makes their P^T column 0 (TMA fills q, do with zeros)
        # natural-log lse (flash_jvp.attention_with_lse) to exp2 units
        lse = tl.load(LSE + row_base + offs_m, mask=offs_m < Lq, other=float("inf")) * LOG2E
        delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < Lq, other=0.0)
        qkT = tl.dot(k, tl.trans(q)) * qk_scale
        if MASK:
            qkT = tl.where(offs_m[None, :] >= offs_n[:, None], qkT, float("-inf"))
        pT = tl.math.exp2(qkT - lse[None, :])
        dv = tl.dot(pT.to(do.dtype), do, dv)
        dpT = tl.dot(v, tl.trans(do))
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk = tl.dot(dsT, q, dk)
        # unscaled; keys past Lk are TMA's zeros, so they add nothing; rows past Lq clipped
        dq = tl.dot(tl.trans(dsT), k)
        dq_desc.atomic_add([off_b, off_h, start_m, 0], dq.reshape(1, 1, BLOCK_M, HEAD_DIM))
    return dk, dv


@triton.jit
def attn_bwd_fused_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE, DELTA, DK, DV,
                          stride_lb, stride_lh, stride_kb, stride_kh, stride_kn, scale, H, Lq,
                          Lk, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
                          STAGES: tl.constexpr):  # fmt: skip
    """One program: BLOCK_N keys of one (batch, head) and every query block that sees them;
    dk (scaled) and dv stored, dq's share added into the float32 buffer dq_desc describes."""
    tl.static_assert(BLOCK_N % BLOCK_M == 0, "the causal split needs BLOCK_M | BLOCK_N")
    start_n = tl.program_id(0) * BLOCK_N
    off_b = tl.program_id(1) // H
    off_h = tl.program_id(1) % H
    qk_scale = scale * LOG2E
    k = k_desc.load([off_b, off_h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = v_desc.load([off_b, off_h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    row_base = off_b * stride_lb + off_h * stride_lh
    lo = 0
    if IS_CAUSAL:  # top-left: query m sees key n when m >= n; masked on the diagonal only
        lo = (start_n // BLOCK_M) * BLOCK_M
        hi = tl.minimum(start_n + BLOCK_N, Lq)
        dk, dv = _fused_inner(dk, dv, k, v, q_desc, do_desc, dq_desc, LSE, DELTA, row_base,
                              offs_n, off_b, off_h, lo, hi, qk_scale, Lq, HEAD_DIM, BLOCK_M,
                              True, STAGES)  # fmt: skip
        lo = start_n + BLOCK_N  # a multiple of BLOCK_M: BLOCK_N is one
    dk, dv = _fused_inner(dk, dv, k, v, q_desc, do_desc, dq_desc, LSE, DELTA, row_base, offs_n,
                          off_b, off_h, lo, Lq, qk_scale, Lq, HEAD_DIM, BLOCK_M, False,
                          STAGES)  # fmt: skip
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = off_b * stride_kb + off_h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :]
    tl.store(DK + ptrs, (dk * scale).to(k.dtype), mask=offs_n[:, None] < Lk)
    tl.store(DV + ptrs, dv.to(v.dtype), mask=offs_n[:, None] < Lk)


# (HEAD_DIM, BLOCK_M, BLOCK_N, num_warps, STAGES); sm_90 spills (bytes, causal / not):
# none but E=128 (64, 128, 8) 160 / 32 and (32, 64, 4) 16 / 0 (the compile mode).
VARIANTS = [(64, 64, 128, 8, 2), (64, 64, 128, 8, 3), (64, 64, 64, 4, 2),
            (128, 64, 128, 8, 2), (128, 32, 64, 4, 3), (128, 64, 64, 8, 2),
            (128, 32, 128, 8, 2)]  # fmt: skip


def _desc(x, rows):
    return TensorDescriptor.from_tensor(x, [1, 1, rows, x.shape[3]])


def fused_bwd(q, k, v, do, lse, delta, scale, causal, variant, poison=False):
    """dq, dk, dv by the fused kernel; (B, H, L, E) contiguous fp16/bf16, lse and delta
    (B, H, L) float32; the time includes dq's zero fill and final scale and cast (the design's
    cost). ``poison``: dk and dv start as NaN, so an unwritten row shows."""
    E, block_m, block_n, warps, stages = variant
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    dk, dv = (torch.full(x.shape, float("nan") if poison else 0.0, device=x.device,
                         dtype=x.dtype) for x in (k, v))  # fmt: skip
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(Lk, block_n), B * H)
    attn_bwd_fused_kernel[grid](
        _desc(q, block_m), _desc(k, block_n), _desc(v, block_n), _desc(do, block_m),
        _desc(dq_acc, block_m), lse, delta, dk, dv, lse.stride(0), lse.stride(1),
        *dk.stride()[:3], scale, H, Lq, Lk, HEAD_DIM=E, BLOCK_M=block_m, BLOCK_N=block_n,
        IS_CAUSAL=causal, STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return (dq_acc * scale).to(q.dtype), dk, dv


def compile_report() -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
    import compile_sm90

    for E, block_m, block_n, warps, stages in VARIANTS:
        sig = {p.name: "constexpr" if p.is_constexpr else "i32"
               for p in attn_bwd_fused_kernel.params}  # fmt: skip
        for name, rows, dtype in (("q_desc", block_m, "bf16"), ("k_desc", block_n, "bf16"),
                                  ("v_desc", block_n, "bf16"), ("do_desc", block_m, "bf16"),
                                  ("dq_desc", block_m, "fp32")):  # fmt: skip
            sig[name] = f"tensordesc<{dtype}[1,1,{rows},{E}]>"
        sig.update(LSE="*fp32", DELTA="*fp32", DK="*bf16", DV="*bf16", scale="fp32")
        for causal in (False, True):
            consts = dict(HEAD_DIM=E, BLOCK_M=block_m, BLOCK_N=block_n, IS_CAUSAL=causal,
                          STAGES=stages)  # fmt: skip
            res = compile_sm90._compile_report(attn_bwd_fused_kernel, sig, consts, {},
                                               {"num_warps": warps})  # fmt: skip
            print(f"E{E:3d} BLOCK_M {block_m:3d} BLOCK_N {block_n:3d} warps {warps} stages "
                  f"{stages} causal {causal!s:5}: {res}", flush=True)  # fmt: skip
    return 0


def run_check() -> int:
    """dq, dk, dv of every variant against float64, beside our backward's error in the same
    dtype (the bar: 2x that + 4e-3, tests/helpers.py's bf16 tolerance)."""
    ok = True
    for variant in VARIANTS:
        for L, causal in ((1000, False), (1024, True), (777, True), (2048, False)):
            q, k, v, do = _inputs(2, 4, L, variant[0])
            lse, delta = _stats(q, k, v, do, causal)
            got = fused_bwd(q, k, v, do, lse, delta, variant[0] ** -0.5, causal, variant, True)
            ref = _grads(q, k, v, do, causal, torch.float64)
            ours = _grads(q, k, v, do, causal)
            errs = [_rel(x, r) for x, r in zip(got, ref)]
            bars = [2 * _rel(x, r) + 4e-3 for x, r in zip(ours, ref)]
            good = all(e <= b for e, b in zip(errs, bars))
            ok &= good
            cells = " ".join(f"{n} {e:.1e} (bar {b:.1e})"
                             for n, e, b in zip(("dq", "dk", "dv"), errs, bars))  # fmt: skip
            print(f"{variant} L{L} causal {causal}: {cells} {'pass' if good else 'FAIL'}",
                  flush=True)  # fmt: skip
    return 0 if ok else 1


def run_time(out: str | None) -> int:
    from triton.testing import do_bench

    # do_bench clears L2 between runs, the profiled Triton runs go back to back: a small
    # bias in our two kernels' favour
    rows, lines = [], ["| E | L | causal | variant | fused ms | ours dK/dV + dQ ms | "
                       "ours / fused |", "|---" * 7 + "|"]  # fmt: skip
    for variant in VARIANTS:
        E = variant[0]
        H = 16 if E == 64 else 8
        for L in (4096, 8192):
            for causal in (False, True):
                q, k, v, do = _inputs(4, H, L, E)
                lse, delta = _stats(q, k, v, do, causal)
                ms = do_bench(functools.partial(fused_bwd, q, k, v, do, lse, delta, E**-0.5,
                                                causal, variant))  # fmt: skip
                ref = sum(_triton_bwd_ms(q, k, v, do, causal))
                rows.append(dict(E=E, L=L, causal=causal, variant=variant, fused_ms=ms,
                                 ours_ms=ref))  # fmt: skip
                cells = (E, L, causal, variant[1:], f"{ms:.3f}", f"{ref:.3f}", f"{ref / ms:.3f}")
                lines.append("| " + " | ".join(map(str, cells)) + " |")
                print(lines[-1], flush=True)
    if out:
        write_results(out, "fused-dq-bwd", "Fused backward (dq by TMA reductions) vs ours", rows,
                      lines)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(cli(__doc__, compile_report, run_check, run_time))
