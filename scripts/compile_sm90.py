"""Compile every kernel variant for sm_90 (Hopper) without a GPU; report registers, spills
and shared memory. Catches compile errors and resource overruns before a device run.

    python scripts/compile_sm90.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flash_jvp._ops import _head_dim
from flash_jvp.kernels import configs
from flash_jvp.kernels.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel
from flash_jvp.kernels.fwd import attn_fwd_kernel
from flash_jvp.kernels.mask_ranges import mask_ranges_kernel

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes per block on H100/H200
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
POINTER_DTYPE = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
TENSORS = {"Q", "K", "V", "O", "Q_T", "K_T", "V_T", "O_T", "DO", "DK", "DV_OUT", "DQ"}


def signature(kernel, dtype: str, constexprs: dict) -> tuple[dict, dict]:
    sig = {}
    for p in kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in ("LSE", "DELTA", "DMASK"):
            sig[p.name] = "*fp32"
        elif p.name in ("KV_RANGES", "Q_RANGES", "RANGES", "CU_SEQLENS_Q", "CU_SEQLENS_K"):
            sig[p.name] = "*i32"
        elif p.name in ("MASK", "MASK_T"):
            sig[p.name] = "*u8" if constexprs.get("MASK_KIND") == 1 else POINTER_DTYPE[dtype]
        elif p.name in TENSORS:
            sig[p.name] = POINTER_DTYPE[dtype]
        elif p.name in ("scale", "mask_min"):
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i32"
    return sig, constexprs


def resources(compiled) -> tuple[int, int]:
    """(registers, spill stores) from the cubin's resource usage."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout  # fmt: skip
    regs = int(re.search(r"REG:(\d+)", out).group(1))
    spills = int(re.search(r"STACK:(\d+)", out).group(1))
    return regs, spills


def compile_one(kernel, dtype, cfg, constexprs, blocks=True):
    tiles = {"BLOCK_M": cfg.BLOCK_M, "BLOCK_N": cfg.BLOCK_N} if blocks else {}
    sig, consts = signature(kernel, dtype, {**constexprs, **tiles})
    try:
        c = triton.compile(
            ASTSource(kernel, sig, consts),
            target=TARGET,
            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
        )
    except Exception as err:  # noqa: BLE001 - report and go on
        return f"ERROR {type(err).__name__}: {str(err).splitlines()[-1][:200]}"
    regs, stack = resources(c)
    smem = c.metadata.shared
    flag = " SMEM>LIMIT" if smem > SMEM_LIMIT else ""
    flag += " SPILLS" if stack else ""
    return f"regs {regs:3d} stack {stack:5d} smem {smem:6d}{flag}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    dims = (64, 128) if args.quick else (16, 64, 72, 128, 160, 256)
    # (name, mask/varlen switches): no mask; key padding (bool, same for all rows); an additive
    # mask with its gradient and tangent; packed variable-length batches.
    variants = (
        ("", dict(MASK_KIND=0, MASK_SAME_ROWS=False, MASK_SAME_COLS=False, VARLEN=False)),
        (" causal", dict(MASK_KIND=0, MASK_SAME_ROWS=False, MASK_SAME_COLS=False, VARLEN=False)),
        (" pad", dict(MASK_KIND=1, MASK_SAME_ROWS=True, MASK_SAME_COLS=False, VARLEN=False)),
        (
            " pad-dense",
            dict(
                MASK_KIND=1, MASK_SAME_ROWS=True, MASK_SAME_COLS=False, VARLEN=False, MASK_SPLIT=1
            ),
        ),
        (" bias", dict(MASK_KIND=2, MASK_SAME_ROWS=False, MASK_SAME_COLS=False, VARLEN=False)),
        (" varlen", dict(MASK_KIND=0, MASK_SAME_ROWS=False, MASK_SAME_COLS=False, VARLEN=True)),
    )
    dtypes = ("bf16",) if args.quick else ("bf16", "fp32")
    torch_dtype = {"bf16": "bfloat16", "fp32": "float32"}
    import torch

    for dtype in dtypes:
        prec = "ieee" if dtype == "fp32" else "tf32"
        for e in dims:
            hd = _head_dim(e)
            tdt = getattr(torch, torch_dtype[dtype])
            for vname, variant in variants:
                causal = vname in (" causal", " varlen")
                base = dict(D=e, DV=e, HEAD_DIM=hd, HEAD_DIM_V=hd, IS_CAUSAL=causal,
                            DOT_PRECISION=prec, **{"MASK_SPLIT": 2 if vname == " pad" else 0,
                                                   **variant})  # fmt: skip
                for tangent in (False, True):
                    flags = dict(HAS_Q_T=tangent, HAS_K_T=tangent, HAS_V_T=tangent,
                                 HAS_MASK_T=tangent and variant["MASK_KIND"] == 2)  # fmt: skip
                    cfg = configs.fwd(hd, tdt, tangent)[0]
                    res = compile_one(attn_fwd_kernel, dtype, cfg, {**base, **flags})
                    print(f"{dtype} E{e:3d} fwd{'+jvp' if tangent else '    '}{vname} {cfg}: {res}")
                dq_flags = dict(MASK_GRAD=variant["MASK_KIND"] == 2)
                for name, kernel, extra in (
                    ("dkdv", attn_bwd_dkdv_kernel, {}),
                    ("dq", attn_bwd_dq_kernel, dq_flags),
                ):
                    cfg = getattr(configs, f"bwd_{name}")(hd, tdt)[0]
                    res = compile_one(kernel, dtype, cfg, {**base, **extra})
                    print(f"{dtype} E{e:3d} {name:8}{vname} {cfg}: {res}")
        for kind in (1, 2):  # the mask's tile-range table: boolean, additive
            cfg = configs.Config(16, 128, 4, 1)  # BLOCK_C = 128, as _ops.MASK_RANGES_BLOCK
            consts = {"MASK_KIND": kind, "BLOCK_C": cfg.BLOCK_N}
            res = compile_one(mask_ranges_kernel, dtype, cfg, consts, blocks=False)
            print(f"{dtype} mask_ranges MASK_KIND={kind}: {res}")


if __name__ == "__main__":
    main()
