"""Launch configurations (block sizes, warps, pipeline stages) for each kernel.

Each function returns candidates best-first; the launcher uses the first that compiles within
the GPU's resources and remembers it per key (see ``_ops._launch``), so a large head dim or
fp32 falls back to smaller tiles instead of failing with an out-of-resources error.
Under ``TRITON_INTERPRET=1`` there is a single small config: the interpreter would otherwise run
every candidate, and small blocks make the CPU tests cross block boundaries.

The GPU candidates were picked on an H200 with benchmarks/tune.py (output under
benchmarks/results/), checked for spills with scripts/compile_sm90.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .._utils import INTERPRET


@dataclass(frozen=True)
class Config:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    # Register cap per thread (ptxas .maxnreg); None lets ptxas choose. Used where a kernel
    # sits just above an occupancy step (e.g. 8 warps at > 128 registers: 1 block per SM).
    maxnreg: int | None = None
    # Move tiles through tensor descriptors (TMA) where the launcher can describe the tensors
    # (Hopper, one head-dim tile; see _ops._tma): the forward's tiles, the dQ kernel's
    # key-side ones (k, v, k_t, v_t).
    tma: bool = False
    # With tma: Triton's warp specialisation of the key loop (a producer warp for the loads);
    # forward kernel only.
    ws: bool = False

    def kwargs(self) -> dict[str, int]:
        extra = {} if self.maxnreg is None else {"maxnreg": self.maxnreg}
        return {
            "BLOCK_M": self.BLOCK_M,
            "BLOCK_N": self.BLOCK_N,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            **extra,
        }


# tma: CPU tests fake a Hopper device to run the descriptor path through the interpreter.
_INTERPRETER = [Config(32, 16, 4, 1, tma=True)]
# Ever smaller tiles, tried only if the chosen one does not fit; the last fits any supported
# head dim and dtype.
_FALLBACKS = [Config(32, 32, 4, 1), Config(16, 16, 4, 1)]

# kernel -> {bucket: config}; bucket: "fp32", or the widest tile row it covers (a head dim
# split as 64 + 16 or 64 + 32 columns is 80 or 96 wide, see _ops._head_tiles).
# IEEE fp32 dots are FMA loops, hence the small fp32 tiles (larger ones spill heavily).
_BEST = {
    "fwd": {
        "fp32": Config(32, 32, 4, 1), 64: Config(64, 64, 4, 3), 96: Config(128, 64, 4, 3),
        128: Config(64, 64, 4, 3), 256: Config(64, 32, 4, 2),
    },
    "fwd+jvp": {
        "fp32": Config(32, 16, 4, 1), 64: Config(128, 64, 8, 3), 96: Config(128, 64, 8, 3),
        128: Config(128, 64, 8, 2, tma=True), 256: Config(64, 32, 4, 1),
    },
    # bwd_dq(+t) tma at E=64 (issue 23): descriptors free the address registers of the key
    # tiles; on an H100 the primal backward took 2-4 % less time with them, the backward
    # through the tangent 0-3 % (results/2026-12-06-h100-tangent-bwd-b2ffccd.md). Not at
    # E=128 (the TANGENT dQ kernel spills more with them) nor in the dK/dV kernels (-1 to
    # -3 %: their registers hold accumulators and key-side tiles, not addresses).
    "bwd_dkdv": {
        "fp32": Config(16, 32, 4, 1), 64: Config(32, 128, 4, 3), 96: Config(32, 64, 4, 3),
        128: Config(32, 64, 4, 3), 256: Config(32, 64, 4, 1),
    },
    "bwd_dq": {
        "fp32": Config(32, 16, 4, 1), 64: Config(128, 64, 8, 3, maxnreg=128, tma=True),
        96: Config(64, 64, 4, 3), 128: Config(64, 64, 4, 2), 256: Config(64, 32, 4, 2),
    },
    # The TANGENT kernels (the backward through the tangent: dk, dv / dq and dq_t of it; dk_t
    # and dv_t come from the primal dK/dV kernel above): two accumulators each, twice the
    # primal kernels' input tiles (k, v, k_t, v_t; q, q_t, do, do_t). bf16 E <= 128 timed on
    # the H200 with benchmarks/tune.py (whole tangent backward, L=8192, results
    # 2026-12-04-h200-tune-tangent-*); E=256 and fp32 picked for fewest spills, untimed.
    "bwd_dkdv+t": {
        "fp32": Config(16, 16, 8, 1), 64: Config(64, 128, 8, 2), 96: Config(32, 64, 4, 2),
        128: Config(32, 128, 8, 2), 256: Config(16, 64, 8, 1),
    },
    "bwd_dq+t": {
        "fp32": Config(16, 16, 8, 1), 64: Config(64, 64, 4, 2, tma=True), 96: Config(128, 64, 8, 2),
        128: Config(128, 32, 8, 2), 256: Config(32, 32, 8, 1),
    },
}  # fmt: skip
# Short key ranges (Lk <= SHORT_LK, e.g. DiT at 256 px): few key blocks per program, so
# smaller query blocks (more programs) win; measured with benchmarks/tune.py.
SHORT_LK = 512
_SHORT = {"fwd+jvp": {64: Config(64, 64, 4, 3), 128: Config(128, 64, 8, 2)}}
# Where the forward can warp-specialise its key loop (tensor descriptors, no attn_mask, dense,
# more than SHORT_LK keys; see _ops.attn_fwd): 4 warps, one producer + one consumer group;
# by is_causal (the one loop masks every block, which the 128-key blocks pay for when causal).
# Measured on an H100, results/2026-12-05-h100-ws-variants-f3a36c7.txt.
_WARP_SPECIALISED = {
    False: {
        "fwd": {128: Config(128, 128, 4, 2, tma=True, ws=True)},
        "fwd+jvp": {
            64: Config(128, 128, 4, 2, tma=True, ws=True),
            128: Config(128, 64, 4, 2, tma=True, ws=True),
        },
    },
    True: {"fwd+jvp": {128: Config(128, 64, 4, 2, tma=True, ws=True)}},
}


class HopperConfig(NamedTuple):
    """A variant of the Gluon warp-specialised forward (kernels/fwd_hopper.py): BLOCK_N keys
    per block, STAGES ring slots for K and V (and their tangents); O_TMA: o (and o_t) stored
    through shared memory and TMA instead of per-element pointers; OVERLAP (primal only):
    each block's softmax runs during the previous block's P V product (FA3's order);
    consumers: 4-warp consumer groups of 64 query rows each (BLOCK_M = 64 x that); regs:
    registers per thread (setmaxnreg) of consumers 1.., the producer warp 24. Consumer 0 is
    the default partition: Triton 3.6 gives it the rest of the 512 a thread's warpgroups
    share (two consumers: 504 - regs - 24, 248 at 232, 240 at 240; three: 512 - 2 regs - 24,
    168 at 160), which kernels/fwd_hopper.py requires to be at least regs."""

    block_n: int
    stages: int
    o_tma: bool = False
    overlap: bool = False
    regs: int = 232
    consumers: int = 2


_H = HopperConfig
# (tangent, HEAD_DIM) -> the variants that may be routed: each compiles for sm_90 without
# spills (tests/test_hopper_compile.py), is checked against float64 on Hopper
# (tests/test_hopper.py) and timed against the Triton forward (benchmarks/hopper_fwd.py
# --sweep). fwd+JVP at E=128 needs O_TMA: with pointer stores it spills 240 bytes (the
# 64 x 128 addresses of o and o_t beside both accumulators); at BLOCK_N 64 it spills 8 bytes
# causal with 232 registers a consumer, none with 240 (as fwd+JVP at E=64 with O_TMA: 24).
# With 232 consumer 0 gets 248; 240 gives both the same. Three consumers (BLOCK_M 192;
# FA3's tile at head dim 64, with its 160 registers, consumer 0 168): the fwd+JVP variants
# spill, the primal's listed none.
HOPPER_CANDIDATES = {
    (False, 64): [_H(128, 2, False, False, 160, 3), _H(128, 2, True, True), _H(128, 2),
                  _H(64, 3), _H(128, 2, o_tma=True), _H(128, 3, True, True),
                  _H(128, 2, True, False, 160, 3), _H(64, 2, True, True, 160, 3),
                  _H(128, 2, True, True, 160, 3)],
    (False, 128): [_H(128, 2, True, True), _H(128, 2), _H(128, 3), _H(128, 2, o_tma=True),
                   _H(128, 2, overlap=True), _H(128, 3, True, True), _H(128, 2, True, True, 240),
                   _H(64, 2, True, True, 160, 3)],
    (True, 64): [_H(128, 2), _H(64, 3), _H(128, 2, True, regs=240), _H(128, 2, regs=240)],
    (True, 128): [_H(64, 2, True, regs=240), _H(32, 3, True), _H(32, 4, True), _H(32, 2, True)],
}  # fmt: skip
# One per (tangent, HEAD_DIM): the variant offered to the route, the fastest measured at L
# 4096 and 8192 (results/2026-12-07-h100-hopper-fwd-sweep-80271b7.md; the primal at E=128 by
# the 846c737 sweep, where the 80271b7 one put OVERLAP alone level with it).
HOPPER_COMPILED = {key: variants[0] for key, variants in HOPPER_CANDIDATES.items()}
# Those routed to it, by the sweeps (H100), triton time / gluon time at L 4096 / 8192,
# non-causal then causal: the primal at E=64 with three consumers (BLOCK_M 192) 1.00 /
# 1.14, 0.91 / 1.07 (two consumers 0.81-1.04 in the same sweep); the primal at E=128 with
# O_TMA and OVERLAP 1.13-1.27x in the 846c737 sweep (causal L=4096 0.71 in the 80271b7 one, where
# the 240-register twin gave 0.53: a spread at 0.3 ms); fwd+JVP at E=64 (BLOCK_N 128)
# 1.19 / 1.17, 1.18 / 1.26; fwd+JVP at E=128 (BLOCK_N 64, O_TMA, 240 registers) 1.10 /
# 1.10, 0.77 / 1.18 (BLOCK_N 32: 0.77-0.99).
# Inputs TMA cannot describe are copied first (_ops._descriptor), so aligned and unaligned
# twins give the same bits (test_cases C7, C10). Changed at run time, it needs
# _ops.forget_configs(): launch plans do not see it.
HOPPER: dict[tuple[bool, int], HopperConfig] = dict(HOPPER_COMPILED)
# Only past this many keys: a program's fixed cost (barriers, partitions) weighs on short rows.
HOPPER_MIN_LK = SHORT_LK


class HopperBwdConfig(NamedTuple):
    """The Gluon warp-specialised backward (kernels/bwd_hopper.py): BLOCK_M (32 or 64) query
    rows per block, STAGES ring slots for q and dO; regs, dq_regs: registers per thread (setmaxnreg)
    of consumer 1 and the dq partition (the producer warp 24; consumer 0 gets the rest)."""

    block_m: int
    stages: int
    regs: int
    dq_regs: int

    @property
    def dq_transposed(self) -> bool:
        """dq's product as dq^T = K^T dS^T: a warpgroup's product needs 64 rows."""
        return self.block_m < 64


# HEAD_DIM -> the variant routed to (None: none). At E=64 against our dK/dV + dQ kernels, on
# an H100 (results/2026-12-07-h100-gluon-bwd-dqwg-59318c6.md: the DQ_WG mode of the
# prototype benchmarks/gluon_bwd.py, removed after 18b89b8),
# L 4096 / 8192 non-causal then causal: 1.18 / 1.27, 1.14 / 1.22 (2 stages 1.14-1.22; 200
# and 88 registers 1.13-1.24). E=128 (dq transposed at BLOCK_M 32; benchmarks/hopper_bwd.py,
# results/2026-12-08-h100-hopper-bwd-5b689c1.md): 1.03-1.20x the Triton kernels at L 4096-8192;
# 216/64 registers (no local load in its loops) 1.04-1.18x, 2 stages 0.94-1.08x. Changed at
# run time, it needs _ops.forget_configs().
HOPPER_BWD: dict[int, HopperBwdConfig] = {
    64: HopperBwdConfig(64, 3, 216, 72),
    128: HopperBwdConfig(32, 3, 208, 72),
}
# Only where both lengths reach this: below it a fixed cost of the Gluon backward's calls
# (0.6-1.1 ms on the H100 at L 1024 and 2048 alike; most likely host time, not yet profiled)
# outlasts the kernels: at L 2048 it ran 0.35-0.53x the Triton kernels' speed, at 4096
# 1.03-1.18x (results/2026-12-08-h100-hopper-bwd-5b689c1.md)
HOPPER_BWD_MIN_L = 4096


def bucket(width: int, dtype: torch.dtype) -> int | str:
    """The _BEST key of a kernel whose widest tile row has ``width`` columns."""
    return "fp32" if dtype == torch.float32 else next(b for b in (64, 96, 128, 256) if width <= b)


def _candidates(
    kernel: str, width: int, dtype: torch.dtype, short: bool = False, ws: bool | None = None
) -> list[Config]:
    """``ws``: None where the launch cannot warp-specialise, else whether it is causal."""
    if INTERPRET:
        return _INTERPRETER
    key = bucket(width, dtype)
    best = _SHORT.get(kernel, {}).get(key) if short else None
    if ws is not None and not short:
        best = _WARP_SPECIALISED[ws].get(kernel, {}).get(key)
    return [best or _BEST[kernel][key]] + _FALLBACKS


def fwd(
    width: int, dtype: torch.dtype, tangent: bool, short: bool, ws: bool, causal: bool
) -> list[Config]:
    """Forward candidates for tile rows of ``width`` columns; ``tangent``: the fused JVP
    variant (more accumulators); ``short``: at most SHORT_LK keys; ``ws``: the launch can
    warp-specialise (see _WARP_SPECIALISED), which is measured per ``causal``."""
    return _candidates("fwd+jvp" if tangent else "fwd", width, dtype, short,
                       causal if ws else None)  # fmt: skip


def bwd_dkdv(width: int, dtype: torch.dtype, tangent: bool = False) -> list[Config]:
    """dK/dV kernel candidates; ``tangent``: its variant through the tangent (TANGENT)."""
    return _candidates("bwd_dkdv+t" if tangent else "bwd_dkdv", width, dtype)


def bwd_dq(width: int, dtype: torch.dtype, tangent: bool = False) -> list[Config]:
    return _candidates("bwd_dq+t" if tangent else "bwd_dq", width, dtype)


PREPROCESS_BLOCK_M = 64
