"""Small shared helpers: where the Triton kernels run, and which dtypes they take."""

from __future__ import annotations

import importlib.util
import os

import torch

# Triton reads TRITON_INTERPRET when kernels are defined, so this is fixed at import too.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None

# dtypes the kernels take; the interpreter computes bfloat16 wrongly, so it only gets fp16/fp32.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRETER_DTYPES = (torch.float16, torch.float32)
MAX_HEAD_DIM = 256


def uses_kernels(device: torch.device) -> bool:
    """True when tensors on `device` go through the Triton kernels.

    CUDA tensors always do. CPU tensors do only under ``TRITON_INTERPRET=1``; otherwise
    :func:`flash_jvp.attention` takes the pure-PyTorch reference path.
    """
    if device.type == "cuda":
        return True
    return device.type == "cpu" and INTERPRET and HAS_TRITON


def kernel_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    return INTERPRETER_DTYPES if device.type == "cpu" else KERNEL_DTYPES
