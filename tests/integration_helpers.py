"""Shared code of the tests on real model classes (tests/test_integrations_*.py).

Each model test runs one sCM-style step (``pred, dpred = torch.func.jvp(model, ...)``, a loss
on ``pred`` and ``dpred.detach()``, parameter gradients) through flash_jvp and through math
SDPA, and compares pred, dpred and every parameter's gradient with relative errors:

* ``fp64``: the CPU fallback (no TRITON_INTERPRET), against math SDPA in float64;
* ``fp32``: the Triton kernels (TRITON_INTERPRET=1 on CPU, or CUDA), against a float64 copy
  run through math SDPA, within 2x math SDPA's own float32 error plus a floor;
* ``bf16``: CUDA only (GPU tier), fp32 weights under bf16 autocast, within 2x PyTorch's own
  error under the same autocast, plus a floor. PyTorch's error is that of the same step with
  attention in plain torch ops (reference.attention_ref, float32 inside, on the bf16 inputs):
  math SDPA and plain softmax cannot run there (under forward AD and bf16 autocast on CUDA
  their backward raises "expected input and grad types to match", torch 2.11).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from helpers import CUDA, DEVICE
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_jvp
from flash_jvp import _check, _utils, api, reference

MODES = [
    pytest.param(
        "fp64",
        marks=pytest.mark.skipif(
            CUDA or _utils.INTERPRET,
            reason="float64 runs the CPU fallback; the kernels (CUDA, TRITON_INTERPRET=1) hand "
            "float64 back to torch",
        ),
    ),
    pytest.param(
        "fp32",
        marks=pytest.mark.skipif(
            not (CUDA or _utils.INTERPRET),
            reason="fp32 tests the Triton kernels: CUDA or TRITON_INTERPRET=1",
        ),
    ),
    pytest.param("bf16", marks=pytest.mark.gpu),
]
# pred, dpred and gradients through the float64 CPU fallback equal math SDPA's to rounding
FP64_TOL = 1e-10
TORCH_SDPA = F.scaled_dot_product_attention


def count_served(monkeypatch) -> list[str]:
    """A log that gets "flash_jvp" for each call of flash_jvp.api.attention and "torch" for
    each call of the SDPA function in place now (which a later patch_sdpa hands calls to)."""
    log: list[str] = []
    flash, sdpa = api.attention, F.scaled_dot_product_attention

    def counted_flash(*args, **kwargs):
        log.append("flash_jvp")
        return flash(*args, **kwargs)

    def counted_sdpa(*args, **kwargs):
        log.append("torch")
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(api, "attention", counted_flash)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counted_sdpa)
    return log


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random parameters everywhere, so that no zero-initialised gate (adaLN-Zero, LayerScale,
    output projections) hides the attention from the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if p.dim() >= 2:
                value = noise / math.sqrt(p[0].numel())
            elif name.endswith("weight"):
                value = 1.0 + 0.2 * noise
            else:
                value = 0.2 * noise
            p.copy_(value.to(p.dtype))
    return model


@dataclass
class Step:
    pred: torch.Tensor
    dpred: torch.Tensor
    grads: dict[str, torch.Tensor]


def scm_step(model: torch.nn.Module, fn: Callable, primals, tangents) -> Step:
    """``pred, dpred = torch.func.jvp(fn, primals, tangents)``, ``loss = mse(pred, target) +
    mse(pred, dpred.detach())`` (the shape of the sCM / MeanFlow losses) and the gradients of
    the loss with respect to every parameter of ``model``."""
    pred, dpred = torch.func.jvp(fn, primals, tangents)
    target = torch.linspace(-1, 1, pred.numel(), device=pred.device).reshape(pred.shape)
    loss = F.mse_loss(pred.float(), target) + F.mse_loss(pred.float(), dpred.detach().float())
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return Step(
        pred.detach(),
        dpred.detach(),
        {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads)},
    )


def _errors(step: Step, ref: Step) -> dict[str, float]:
    grad_rms = max(g.double().norm().item() / math.sqrt(g.numel()) for g in ref.grads.values())
    errs = {
        "pred": _check.rel_err(step.pred, ref.pred.double()),
        "dpred": _check.rel_err(step.dpred, ref.dpred.double()),
    }
    for name, g in step.grads.items():
        errs[f"grad {name}"] = _check.rel_err(g, ref.grads[name].double(), grad_rms)
    return errs


def on_device(xs, dtype):
    """Tensors moved to DEVICE; floating ones cast to ``dtype``."""
    return tuple(x.to(DEVICE, dtype) if x.is_floating_point() else x.to(DEVICE) for x in xs)


def assert_step_matches(mode: str, build, run_flash, run_math) -> dict[str, float]:
    """Compare an sCM step through flash_jvp with the same step through math SDPA.

    build(dtype) -> (model, fn, primals, tangents) on DEVICE (fn(*primals) calls the model),
    the same random model and inputs for every dtype; run_flash / run_math(model, fn,
    primals, tangents) -> Step, each with its own routing. Returns flash_jvp's errors.
    """
    if mode == "fp64":
        ref = run_math(*build(torch.float64))
        ours = run_flash(*build(torch.float64))
        errs = _errors(ours, ref)
        bad = {k: e for k, e in errs.items() if not e <= FP64_TOL}
        assert not bad, f"relative errors above {FP64_TOL:.0e} against math SDPA: {bad}"
        return errs
    ref64 = run_math(*build(torch.float64))
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if mode == "bf16" else contextlib.nullcontext()
    )
    with autocast:
        same = (run_math if mode == "fp32" else _via_plain_ops(run_math))(*build(torch.float32))
        ours = run_flash(*build(torch.float32))
    torch_errs, errs = _errors(same, ref64), _errors(ours, ref64)
    floor = _check.FLOOR[torch.bfloat16 if mode == "bf16" else torch.float32]
    bad = {
        k: f"{e:.2e} > 2 x {torch_errs[k]:.2e} + {floor:.0e}"
        for k, e in errs.items()
        if not e <= _check.RTOL * torch_errs[k] + floor
    }
    assert not bad, f"{mode}: flash_jvp vs float64 math SDPA: {bad}"
    return errs


def _plain_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):  # fmt: skip
    """SDPA in plain torch ops on the inputs autocast gives it (bf16), computed in float32
    with autocast off, the result cast back (as flash_jvp's CPU fallback does): under autocast
    torch's softmax backward meets a bf16 input and a float32 gradient and raises."""
    assert dropout_p == 0.0, "the tests' models run without dropout"
    with _utils.no_autocast(query.device):
        return reference.attention_ref(query, key, value, attn_mask, is_causal, scale,
                                       enable_gqa)  # fmt: skip


def _via_plain_ops(run: Callable) -> Callable:
    """``run`` with torch.nn.functional.scaled_dot_product_attention (which math SDPA's
    routes reach, looked up at call time) as plain torch ops."""

    def plain(*args):
        with mock.patch.object(F, "scaled_dot_product_attention", _plain_sdpa):
            return run(*args)

    return plain


def via_patch_sdpa(model, fn, primals, tangents) -> Step:
    """The step with torch.nn.functional.scaled_dot_product_attention routed to flash_jvp."""
    with flash_jvp.patch_sdpa():
        return scm_step(model, fn, primals, tangents)


def via_math_sdpa(model, fn, primals, tangents) -> Step:
    """The step through torch's math SDPA, the one backend with forward-mode AD."""
    with sdpa_kernel(SDPBackend.MATH):
        return scm_step(model, fn, primals, tangents)


def converted(mode: str, monkeypatch) -> Callable:
    """A run (as via_patch_sdpa) with the model's torch.nn layers swapped for flash_jvp.nn's
    in place (``flash_jvp.nn.convert``) for the step and reverted after, asserting that
    revert restored every class and, in float32 and bfloat16 (float64 takes the plain ops),
    that the fused Linear's Function served the JVP."""
    import flash_jvp.nn as fnn
    from flash_jvp.nn._linear import LinearFn

    served = []
    forward = LinearFn.forward
    monkeypatch.setattr(
        LinearFn, "forward", staticmethod(lambda *a: served.append(1) or forward(*a))
    )

    def run(model, *args):
        classes = {n: type(m) for n, m in model.named_modules()}
        served.clear()
        fnn.convert(model)
        try:
            assert any(isinstance(m, fnn.Linear) for m in model.modules())
            step = via_patch_sdpa(model, *args)
        finally:
            fnn.revert(model)
        assert {n: type(m) for n, m in model.named_modules()} == classes
        assert served or mode == "fp64", "no Linear ran through flash_jvp.nn's LinearFn"
        return step

    return run


def served_by_flash(log: list[str], calls: int, run: Callable) -> Callable:
    """``run``, asserting that flash_jvp served each of its ``calls`` SDPA calls."""

    def checked(*args):
        log.clear()
        step = run(*args)
        assert log == ["flash_jvp"] * calls, f"SDPA calls served by: {log}"
        return step

    return checked


def randn(*shape, gen: torch.Generator) -> torch.Tensor:
    """float32 normal samples from ``gen`` (exactly representable in every test dtype)."""
    return torch.randn(*shape, generator=gen)
