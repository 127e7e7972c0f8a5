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

import torch

from .._utils import INTERPRET


@dataclass(frozen=True)
class Config:
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int

    def kwargs(self) -> dict[str, int]:
        return {
            "BLOCK_M": self.BLOCK_M,
            "BLOCK_N": self.BLOCK_N,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }


_INTERPRETER = [Config(32, 16, 4, 1)]


def _fallbacks(head_dim: int) -> list[Config]:
    """Ever smaller tiles, tried only if the ones before do not fit: the last fits any
    supported head dim and dtype."""
    return [Config(32, 32, 4, 1), Config(16, 16, 4, 1)]


def fwd(head_dim: int, dtype: torch.dtype, tangent: bool) -> list[Config]:
    """Forward candidates; `tangent` means the fused JVP variant (two more accumulators)."""
    if INTERPRET:
        return _INTERPRETER
    if dtype == torch.float32:  # IEEE fp32 dots are FMA loops: small tiles or heavy spills
        best = [Config(32, 16, 4, 1)] if tangent else [Config(32, 32, 4, 1)]
    elif head_dim <= 64:
        best = [Config(64, 64, 4, 3)]
    elif head_dim <= 128:
        best = [Config(128, 64, 8, 2)] if tangent else [Config(64, 64, 4, 3)]
    else:
        best = [Config(64, 32, 4, 1)] if tangent else [Config(64, 32, 4, 2)]
    return best + _fallbacks(head_dim)


def bwd_dkdv(head_dim: int, dtype: torch.dtype) -> list[Config]:
    if INTERPRET:
        return _INTERPRETER
    if dtype == torch.float32:
        best = [Config(16, 32, 4, 1)]
    elif head_dim <= 64:
        best = [Config(32, 128, 4, 3)]
    elif head_dim <= 128:
        best = [Config(32, 64, 4, 3)]
    else:
        best = [Config(32, 64, 4, 1)]
    return best + _fallbacks(head_dim)


def bwd_dq(head_dim: int, dtype: torch.dtype) -> list[Config]:
    if INTERPRET:
        return _INTERPRETER
    if dtype == torch.float32:
        best = [Config(32, 16, 4, 1)]
    elif head_dim <= 64:
        best = [Config(128, 64, 8, 3)]
    elif head_dim <= 128:
        best = [Config(64, 64, 4, 2)]
    else:
        best = [Config(64, 32, 4, 2)]
    return best + _fallbacks(head_dim)


PREPROCESS_BLOCK_M = 64
