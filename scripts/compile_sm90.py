"""Compile, for sm_90 (Hopper) and without a GPU, exactly the kernels the launchers would launch
for a set of problems; report registers, spill stack (LOOP-SPILLS: local loads or stores
inside a loop), shared memory, and two signs of values ptxas takes as divergent (R2UR moves
to uniform registers, WARPSYNC). Catches compile errors, spills and register steps before a
device run.

    python scripts/compile_sm90.py [--quick] [--hopper]

The launchers in flash_jvp._ops run on empty CPU tensors with every launch recorded instead of
run; each recorded launch is compiled with the specialisation Triton's launcher would give it
(pointers 16-byte aligned, integers equal to 1 as constants, integers divisible by 16 marked so).
"(+N vs no mask)": registers a variant needs beyond the same kernel without mask or causal.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from flash_jvp import _ops
from flash_jvp._utils import Spec
from flash_jvp.kernels import configs, ws_barriers
from flash_jvp.kernels.bwd_hopper import attn_bwd_hopper_kernel
from flash_jvp.kernels.fwd_hopper import HALF_M, attn_fwd_hopper_kernel

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes per block on H100/H200
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
           torch.int32: "*i32", torch.uint8: "*u8", torch.bool: "*u8"}  # fmt: skip


class _Recorder:
    """Stands in for a kernel (kernel[grid](**args)) or for _ops._launch; keeps the calls."""

    def __init__(self, calls, kernel=None):
        self.calls, self.kernel = calls, kernel

    def __getitem__(self, grid):
        return lambda **args: self.calls.append((self.kernel, None, args))

    def __call__(self, kernel, grid, candidates, key, cfg_args=lambda cfg: {}, **args):
        self.calls.append((kernel, candidates[0], {**args, **cfg_args(candidates[0])}))


def record(problem) -> list:
    """The launches (kernel, config, arguments) of one fwd+JVP and one backward: the Triton
    kernels, with the Gluon routes (configs.HOPPER, HOPPER_BWD) emptied (--hopper reports
    them)."""
    calls = []
    saved = (_ops._launch, _ops.attn_bwd_preprocess_kernel, _ops.mask_ranges_kernel,
             _ops._tma_capable, configs.HOPPER, configs.HOPPER_BWD)  # fmt: skip
    _ops._launch = _Recorder(calls)
    _ops._tma_capable = lambda device: True  # as on sm_90
    _ops.attn_bwd_preprocess_kernel = _Recorder([])
    _ops.mask_ranges_kernel = _Recorder(calls, saved[2])
    configs.HOPPER, configs.HOPPER_BWD = {}, {}
    _ops.forget_configs()
    try:
        problem()
    finally:
        (_ops._launch, _ops.attn_bwd_preprocess_kernel, _ops.mask_ranges_kernel,
         _ops._tma_capable, configs.HOPPER, configs.HOPPER_BWD) = saved  # fmt: skip
        _ops.forget_configs()
    return calls


def compile_launch(kernel, cfg, args) -> str:
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        val = cfg.kwargs()[p.name] if cfg is not None and p.name in cfg.kwargs() else args[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", val
        elif isinstance(val, torch.Tensor):
            sig[p.name], attrs[(i,)] = POINTER[val.dtype], [["tt.divisibility", 16]]
        elif isinstance(val, float):
            sig[p.name] = "fp32"
        elif int(val) == 1:
            sig[p.name], consts[p.name] = "constexpr", 1
        else:
            sig[p.name] = "i32"
            if int(val) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": 4, "num_stages": 1}
    if cfg is not None:
        options = {k: v for k, v in cfg.kwargs().items() if k not in ("BLOCK_M", "BLOCK_N")}
    key = (kernel.fn.__name__, repr(sig), repr(consts), repr(attrs), repr(options))
    if key not in _REPORTS:  # the same table kernel is recorded once per mask table
        _REPORTS[key] = _compile_report(kernel, sig, consts, attrs, options)
    return _REPORTS[key]


_REPORTS: dict[tuple, str] = {}


def _compile_report(kernel, sig, consts, attrs, options, source=ASTSource) -> str:
    try:
        # as _plans.launch compiles it: without Triton < 3.8's unused barriers
        with ws_barriers.compile_hook((kernel.fn.__name__,)):
            compiled = triton.compile(source(kernel, sig, consts, attrs), target=TARGET,
                                      options=options)  # fmt: skip
    except Exception as err:  # noqa: BLE001 - report and go on
        return f"ERROR {type(err).__name__}: {str(err).splitlines()[-1][:200]}"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout  # fmt: skip
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    smem = compiled.metadata.shared
    flags = (" SMEM>LIMIT" if smem > SMEM_LIMIT else "") + (" SPILLS" if stack else "")
    if loop_spills := _loop_spills(sass):
        flags += f" LOOP-SPILLS {loop_spills}"
    if "ttg.warp_specialize" in compiled.asm["ttgir"]:  # the loop was warp-specialised
        flags += " WARP-SPECIALISED"
    if ws_barriers.reinitialised(compiled.asm["ptx"]):  # undefined per PTX (kernels/ws_barriers.py)
        flags += " MBARRIER-REINIT"
    return (f"regs {regs:3d} stack {stack:5d} smem {smem:6d} R2UR {sass.count('R2UR'):3d} "
            f"WARPSYNC {sass.count('WARPSYNC')}{flags}")  # fmt: skip


def _loop_spills(sass: str) -> int:
    """Local-memory loads and stores inside loops (between a predicated backward branch and
    its target): the spills that cost on every iteration, not those of values kept across a
    loop (stored before it, loaded after)."""
    code = [(int(m.group(1), 16), m.group(2)) for m in
            re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]  # fmt: skip
    # predicated branches only, by a guard (@P0 BRA) or an operand (BRA.U !UP0, ...): the
    # unconditional ones include the partitions' dispatch, which spans the whole kernel
    branch = re.compile(r"(?:@!?U?P\w+\s+BRA(?:\.\w+)*|BRA(?:\.\w+)*\s+!?U?P\w+,)\s+(0x[0-9a-f]+)")
    branches = [(at, branch.match(ins)) for at, ins in code]
    loops = [(int(m.group(1), 16), at) for at, m in branches if m and int(m.group(1), 16) < at]
    local = re.compile(r"(?:@!?U?P\w+\s+)?(?:LDL|STL)\b")
    return sum(
        1 for at, ins in code if local.match(ins) and any(lo <= at <= hi for lo, hi in loops)
    )


def _gluon_signature(kernel, descs: dict, pointers: dict) -> dict:
    """A Gluon kernel's signature: its descriptors specialised as the launcher would, its
    constexprs, pointers and floats by name (``pointers``), every other argument i32."""
    sig = {}
    for p in kernel.params:
        if p.name in descs:
            sig[p.name] = native_specialize_impl(BaseBackend, descs[p.name], False, True, True)[0]
        else:
            sig[p.name] = "constexpr" if p.is_constexpr else pointers.get(p.name, "i32")
    return sig


def hopper_reports() -> list[tuple[str, str]]:
    """(label, report) of every Gluon forward variant (configs.HOPPER_CANDIDATES, causal or
    not), compiled with the rank-4 host descriptors _ops._attn_fwd_hopper passes."""
    x = torch.empty(2, 4, 1024, 128, dtype=torch.bfloat16)
    names = ("q_desc", "k_desc", "v_desc", "qt_desc", "kt_desc", "vt_desc", "o_desc", "ot_desc")
    pointers = {"O": "*bf16", "O_T": "*bf16", "LSE": "*fp32", "MU": "*fp32", "scale": "fp32"}
    out = []
    variants = [(key, cfg) for key, cfgs in configs.HOPPER_CANDIDATES.items() for cfg in cfgs]
    for (tangent, e), cfg in variants:
        for causal in (False, True):
            descs = [_ops._descriptor(x[..., :e], HALF_M.value if i % 3 == 0 else cfg.block_n)
                     for i in range(6)]  # fmt: skip
            descs += [descs[0]] * 2  # o, o_t: blocks of 64 rows, as q's
            consts = dict(HEAD_DIM=e, BLOCK_N=cfg.block_n, STAGES=cfg.stages, IS_CAUSAL=causal,
                          TANGENT=tangent, O_TMA=cfg.o_tma, OVERLAP=cfg.overlap,
                          CONSUMER_REGS=cfg.regs, CONSUMERS=cfg.consumers)  # fmt: skip
            sig = _gluon_signature(attn_fwd_hopper_kernel, dict(zip(names, descs)), pointers)
            res = _compile_report(attn_fwd_hopper_kernel, sig, consts, {}, {"num_warps": 4},
                                  GluonASTSource)  # fmt: skip
            label = f"E{e:3d} fwd_hopper{'+jvp' if tangent else ''}{' causal' if causal else ''}"
            flags = "".join(f" {f}" for f in ("o_tma", "overlap") if getattr(cfg, f))
            for f in ("regs", "consumers"):
                if getattr(cfg, f) != configs.HopperConfig._field_defaults[f]:
                    flags += f" {f} {getattr(cfg, f)}"
            out.append((f"{label:24} BLOCK_N {cfg.block_n} stages {cfg.stages}{flags}", res))
    return out + hopper_bwd_reports()


def hopper_bwd_reports() -> list[tuple[str, str]]:
    """(label, report) of the Gluon backward (configs.HOPPER_BWD, causal or not), compiled with
    the descriptors _ops._attn_bwd_hopper passes."""
    pointers = {"LSE": "*fp32", "DELTA": "*fp32", "DK": "*bf16", "DV": "*bf16", "scale": "fp32"}
    out = []
    for e, cfg in configs.HOPPER_BWD.items():
        x = torch.empty(2, 4, 1024, e, dtype=torch.bfloat16)
        lay = _ops._Layout.of(x, x, x, Spec(scale=e**-0.5))
        descs = dict(q_desc=_ops._descriptor(x, cfg.block_m), k_desc=_ops._descriptor(x, 64),
                     v_desc=_ops._descriptor(x, 64), do_desc=_ops._descriptor(x, cfg.block_m),
                     dq_desc=_ops._dq_accumulator(lay, cfg, x.device)[1])  # fmt: skip
        for causal in (False, True):
            consts = dict(HEAD_DIM=e, BLOCK_M=cfg.block_m, STAGES=cfg.stages, IS_CAUSAL=causal,
                          DQ_TRANSPOSED=cfg.dq_transposed, CONSUMER_REGS=cfg.regs,
                          DQ_REGS=cfg.dq_regs)  # fmt: skip
            sig = _gluon_signature(attn_bwd_hopper_kernel, descs, pointers)
            res = _compile_report(attn_bwd_hopper_kernel, sig, consts, {}, {"num_warps": 4},
                                  GluonASTSource)  # fmt: skip
            label = f"E{e:3d} bwd_hopper{' causal' if causal else ''}"
            flags = f"BLOCK_M {cfg.block_m} stages {cfg.stages} regs {cfg.regs} dq {cfg.dq_regs}"
            out.append((f"{label:24} {flags}", res))
    return out


def problems(E: int, dtype: torch.dtype, tangent: bool = False):
    """(name, callable running attn_fwd with tangents and attn_bwd) per mask/layout case;
    with ``tangent`` the backward through the tangent (attn_bwd_tangent) instead of the
    forwards and the primal backward."""
    B, H, L = 2, 4, 1024
    q, k, v, o, do, q_t, k_t, v_t = (torch.empty(B, H, L, E, dtype=dtype) for _ in range(8))
    lse = torch.zeros(B, H, L)
    mu = torch.zeros(B, H, L)
    scale = E**-0.5
    pad = (torch.arange(L) < L - 100).expand(B, 1, 1, L)
    bias = torch.zeros(1, H, L, L, dtype=dtype)
    cu = torch.tensor([0, L, 2 * L], dtype=torch.int32)

    def dense(mask, spec):
        def run():
            if tangent:  # o, o_t stand in for do, do_t
                mask_t = None if mask is not bias else bias
                _ops.attn_bwd_tangent(do, o, q, k, v, q_t, k_t, v_t, o, o, lse, mu, mask, mask_t,
                                      spec, mask_grad=mask is bias,
                                      mask_t_grad=mask is bias)  # fmt: skip
                return
            _ops.attn_fwd(q, k, v, q_t, k_t, v_t, mask, None, spec)
            _ops.attn_fwd(q, k, v, None, None, None, mask, None, spec)
            _ops.attn_bwd(do, q, k, v, o, lse, mask, spec, mask_grad=mask is bias)

        return run

    def packed():
        pk = [x.transpose(1, 2).reshape(B * L, H, E) for x in (q, k, v, o, do, q_t, k_t, v_t)]
        spec = Spec(scale, 0, cu, cu, L, L)
        if tangent:
            _ops.attn_bwd_tangent(
                pk[4],
                pk[3],
                *pk[:3],
                *pk[5:],
                pk[3],
                pk[3],
                torch.zeros(H, B * L),
                torch.zeros(H, B * L),
                None,
                None,
                spec,
            )
            return
        _ops.attn_fwd(*pk[:3], *pk[5:], None, None, spec)
        _ops.attn_bwd(pk[4], *pk[:4], torch.zeros(H, B * L), None, spec)

    return [("", dense(None, Spec(scale))), (" causal", dense(None, Spec(scale, 0))),
            (" pad", dense(pad, Spec(scale))), (" bias", dense(bias, Spec(scale))),
            (" varlen", packed)]  # fmt: skip


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="bf16, E = 64 and 128 only")
    parser.add_argument("--dims", type=int, nargs="+", help="head dims (default: a spread)")
    parser.add_argument(
        "--tangent",
        action="store_true",
        help="the backward through the tangent (reverse mode through o_t)",
    )
    parser.add_argument(
        "--hopper",
        action="store_true",
        help="the Gluon forward's and backward's variants (kernels/*_hopper.py)",
    )
    args = parser.parse_args()
    if args.hopper:
        for label, res in hopper_reports():
            print(f"bfloat16 {label}: {res}", flush=True)
        return
    dims = args.dims or ((64, 128) if args.quick else (16, 64, 72, 80, 96, 128, 160, 256))
    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float32)
    for dtype in dtypes:
        for e in dims:
            base_regs = {}
            for name, problem in problems(e, dtype, args.tangent):
                for kernel, cfg, kargs in record(problem):
                    res = compile_launch(kernel, cfg, kargs)
                    label = kernel.fn.__name__.replace("attn_", "").replace("_kernel", "")
                    if kargs.get("TANGENT"):
                        label += "+t"
                    elif kargs.get("HAS_Q_T"):
                        label += "+jvp"
                    regs = re.search(r"regs +(\d+)", res)
                    if regs and not name:
                        base_regs[label] = int(regs.group(1))
                    extra = ""
                    if regs and name and label in base_regs:
                        extra = f" ({int(regs.group(1)) - base_regs[label]:+d} vs no mask)"
                    label += f" split{kargs['MASK_SPLIT']}" if kargs.get("MASK_SPLIT") else ""
                    cfg_s = "" if cfg is None else f" {cfg.BLOCK_M}x{cfg.BLOCK_N} w{cfg.num_warps}"
                    print(f"{str(dtype)[6:]} E{e:3d}{name:8} {label:22}{cfg_s}: {res}{extra}",
                          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
