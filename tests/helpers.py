"""Shared test helpers (plain module; fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from flash_jvp import _check, _utils

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# bf16 only on the GPU: Triton's interpreter runs it but computes garbage.
DTYPES = [torch.float16, torch.bfloat16, torch.float32] if CUDA else [torch.float16, torch.float32]
DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Behaviour of the Triton kernels themselves (limits, refusals); the plain-PyTorch CPU
# fallback, used without TRITON_INTERPRET, has none of these limits.
needs_kernels = pytest.mark.skipif(
    not _utils.uses_kernels(torch.device(DEVICE)),
    reason="a property of the Triton kernels; the CPU fallback (no TRITON_INTERPRET) differs",
)


@contextlib.contextmanager
def dispatch_keys_kept():
    """The calling thread's dispatch keys as they were on entry, on exit; the garbage made
    inside is collected before. Some of torch's own failures leave a reference cycle that
    holds a dispatch-key guard (torch 2.13 CPU: a compiled torch.func.jvp through
    F.layer_norm, with no flash_jvp in the model); collected, in any thread and at any later
    time, it sets the creating thread's keys to those inside the failed transform, and later
    calls there hit torch's internal asserts (a later test failed at random in CI's worker)."""
    keys = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(*keys):
        yield
        gc.collect()


def slow_if(condition: bool) -> tuple:
    """Marks putting a case in the slow GPU tier (``scripts/gpu_check.sh slow``) when
    ``condition`` holds; CI's CPU run (``-m "not gpu"``) ignores the mark."""
    return (pytest.mark.slow,) if condition else ()


def randn(*shape, dtype=torch.float32, device=DEVICE, std=1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=device, dtype=torch.float32) * std).to(dtype)


def qkv(B, Hq, Hkv, Lq, Lk, E, Ev=None, dtype=torch.float32, std=1.0, device=DEVICE):
    """q, k, v, their tangents and an output cotangent, all fresh random normal."""
    Ev = E if Ev is None else Ev
    q = randn(B, Hq, Lq, E, dtype=dtype, std=std, device=device)
    k = randn(B, Hkv, Lk, E, dtype=dtype, std=std, device=device)
    v = randn(B, Hkv, Lk, Ev, dtype=dtype, std=std, device=device)
    tangents = tuple(randn(*x.shape, dtype=dtype, device=device) for x in (q, k, v))
    do = randn(B, Hq, Lq, Ev, dtype=dtype, device=device)
    return q, k, v, tangents, do


def assert_matches_reference(fn, q, k, v, tangents, do, names=_check.NAMES, **kwargs):
    """fn's o, o_t (torch.func.jvp) and dq, dk, dv pass the float64 rule of flash_jvp._check."""
    comps = _check.check_outputs(fn, q, k, v, tangents, do, names=names, **kwargs)
    _check.assert_ok(comps, f"q {tuple(q.shape)} {q.dtype} k {tuple(k.shape)} {kwargs}")
    return comps


def assert_close_rel(name, x, ref, tol):
    """Relative error of x against ref (in float64) at most tol; NaN never passes."""
    err = _check.rel_err(x, ref.detach().to(torch.float64))
    assert err <= tol, f"{name}: rel err {err:.3e} > {tol:.1e}"


def force_candidate(monkeypatch, index: int, kernels=("fwd", "bwd_dkdv", "bwd_dq")) -> None:
    """Make each named kernel's launch-config candidate list just its `index`-th entry (the
    last if shorter), with no remembered choice."""
    from flash_jvp import _ops
    from flash_jvp.kernels import configs

    for name in kernels:
        original = getattr(configs, name)

        def only(*args, original=original):
            cands = original(*args)
            return [cands[min(index, len(cands) - 1)]]

        monkeypatch.setattr(configs, name, only)
    monkeypatch.setattr(_ops, "_CHOSEN", {})
