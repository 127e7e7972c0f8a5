"""Accuracy against the float64 oracle: the rule the tests and ``python -m flash_jvp check`` share.

For each of o, o_t, dq, dk, dv:

    rel_err(x) = ||x - ref64|| / max(||ref64||, ABS_FLOOR * sqrt(numel) * group_rms)
    pass  <=>  rel_err(flash_jvp) <= RTOL * rel_err(PyTorch in the same dtype) + FLOOR[dtype]

"PyTorch in the same dtype" is math SDPA; for dq, dk, dv in fp16/bf16 on CUDA (no mask) it is
the less exact of math SDPA and PyTorch's flash backend. FlashAttention-2's backward, like
ours, takes delta = rowsum(dO o O) from the rounded output, which on near-one-hot rows (large
scores) loses digits that math SDPA's rowsum(P o dP) keeps; our gradients then match flash's
error (measured on the H200: equal within 1 % over 40 seeds), not math SDPA's.

ref64 is ``torch.func.jvp`` / autograd through math SDPA on float64 copies and
group_rms the largest RMS among the references of the same kind ({o, o_t} or {dq, dk, dv}).
NaN or Inf in a result never passes. The ABS_FLOOR term only matters for references that
are (nearly) zero while their siblings are not, e.g. dq and dk when Lk = 1: there the error
is measured against a fifth of the gradients' scale instead of dividing by zero.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import reference

RTOL = 2.0
ABS_FLOOR = 0.2
GROUPS = (("o", "o_t"), ("dq", "dk", "dv"))
# About one unit of rounding of the dtype's output, relative. fp32: the ~1e-5 of case C9 (2e-5:
# analytically-zero gradients, e.g. dq with one visible key, are pure rounding noise and
# reached 1.25e-5 on the H200); TF32 products are looser.
FLOOR = {torch.float16: 1e-3, torch.bfloat16: 4e-3, torch.float32: 2e-5, torch.float64: 1e-12}
TF32_FLOOR = 5e-4
NAMES = ("o", "o_t", "dq", "dk", "dv")


def _rms(t: torch.Tensor) -> float:
    return t.norm().item() / math.sqrt(max(t.numel(), 1))


def rel_err(x: torch.Tensor, ref: torch.Tensor, scale_rms: float = 0.0) -> float:
    """Relative error of x against the float64 ref (inf if x has NaN/Inf).

    ``scale_rms``: an RMS magnitude below which the reference counts as (near) zero.
    """
    x64 = x.detach().to(torch.float64)
    if not torch.isfinite(x64).all():
        return math.inf
    denom = max(ref.norm().item(), ABS_FLOOR * scale_rms * math.sqrt(max(ref.numel(), 1)))
    if denom == 0.0:
        return 0.0 if (x64 == ref).all() else math.inf
    return (x64 - ref).norm().item() / denom


def floor(dtype: torch.dtype) -> float:
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return TF32_FLOOR
    return FLOOR[dtype]


@dataclass
class Comparison:
    name: str
    err: float  # flash_jvp vs float64
    torch_err: float  # PyTorch in the same dtype vs float64 (see the module docstring)
    tol: float

    @property
    def ok(self) -> bool:
        return self.err <= self.tol


def compare(
    ours: reference.Outputs,
    ref64: reference.Outputs,
    same_dtype: reference.Outputs,
    dtype: torch.dtype,
    names=NAMES,
    flash_grads: tuple[torch.Tensor, ...] | None = None,
) -> list[Comparison]:
    """Comparisons of ``names``; ``same_dtype`` is math SDPA in the inputs' dtype and
    ``flash_grads`` (optional) dq, dk, dv of PyTorch's flash backend, the other yardstick."""
    group_rms = {
        name: max(_rms(getattr(ref64, n)) for n in group) for group in GROUPS for name in group
    }
    out = []
    for name in names:
        ref, scale = getattr(ref64, name), group_rms[name]
        t_err = rel_err(getattr(same_dtype, name), ref, scale)
        if not math.isfinite(t_err):
            t_err = 0.0  # torch itself broke (e.g. NaN rows): hold us to the floor alone
        if flash_grads is not None and name in GROUPS[1]:
            t_err = max(t_err, rel_err(flash_grads[GROUPS[1].index(name)], ref, scale))
        tol = RTOL * t_err + floor(dtype)
        out.append(Comparison(name, rel_err(getattr(ours, name), ref, scale), t_err, tol))
    return out


def check_outputs(
    fn, q, k, v, tangents, do, names=NAMES, ref_fn=reference.math_sdpa, **kwargs
) -> list[Comparison]:
    """Run ``fn`` (SDPA signature) and the oracle ``ref_fn`` on the same inputs and compare."""
    ours = reference.run_outputs(fn, q, k, v, tangents, do, **kwargs)
    ref64 = reference.sdpa_outputs(q, k, v, tangents, do, fn=ref_fn, **kwargs)
    same = reference.sdpa_outputs(q, k, v, tangents, do, dtype=None, fn=ref_fn, **kwargs)
    flash = flash_sdpa_grads(q, k, v, do, **kwargs) if ref_fn is reference.math_sdpa else None
    return compare(ours, ref64, same, q.dtype, names, flash)


def flash_sdpa_grads(q, k, v, do, **kwargs) -> tuple[torch.Tensor, ...] | None:
    """dq, dk, dv of PyTorch's flash SDPA backend (FlashAttention-2) in the inputs' dtype, or
    None where that backend does not run (CPU, fp32, a mask, an unsupported head dim)."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    if kwargs.get("attn_mask") is not None:
        return None
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    try:
        with warnings.catch_warnings():  # torch explains each refusal in a UserWarning
            warnings.simplefilter("ignore", UserWarning)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.enable_grad():
                out = F.scaled_dot_product_attention(*leaves, **kwargs)
                return torch.autograd.grad(out, leaves, do)
    except RuntimeError:  # "No available kernel" for this shape/dtype
        return None


def assert_ok(comparisons: list[Comparison], context: str = "") -> None:
    bad = [c for c in comparisons if not c.ok]
    if bad:
        lines = [
            f"{c.name}: rel err {c.err:.3e} > tol {c.tol:.3e} "
            f"(PyTorch in the same dtype: {c.torch_err:.3e})"
            for c in bad
        ]
        raise AssertionError(f"{context}\n" + "\n".join(lines))
