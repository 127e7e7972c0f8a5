"""Two tiers: CPU (kernels under TRITON_INTERPRET=1, tiny shapes; CI) and GPU (marker `gpu`)."""

from __future__ import annotations

import gc
import os
import random
import zlib

import pytest
import torch
from helpers import CUDA, DEVICE

import flash_jvp
from flash_jvp import _plans, _utils

# Fresh inputs every session; FLASH_JVP_SEED=<n> replays one.
SEED = int(os.environ.get("FLASH_JVP_SEED", random.randrange(2**31)))


def pytest_report_header(config):
    path = "CUDA" if CUDA else ("Triton interpreter" if _utils.INTERPRET else "CPU fallback")
    return f"flash_jvp: seed {SEED} (FLASH_JVP_SEED), device {DEVICE}, kernel path: {path}"


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(SEED ^ zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every floating-point buffer flash_jvp allocates starts as NaN (replayed launch plans
    included), so an unwritten element cannot pass."""
    real = _plans.allocate

    def nan_empty(shape, device, dtype):
        t = real(shape, device, dtype)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(_plans, "allocate", nan_empty)


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 means IEEE fp32 unless a test turns TF32 on itself (matmuls, and cuDNN's
    convolutions, e.g. a DiT's patch embedding, which torch runs in TF32 by default)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(params=["kernels", "fallback"])
def path(request, monkeypatch):
    """Which implementation serves the calls: the Triton kernels (interpreter on CPU) or the
    plain-PyTorch fallback (forced by pretending the device has no kernels)."""
    if request.param == "kernels" and not _utils.uses_kernels(torch.device(DEVICE)):
        pytest.skip("the kernels run on CUDA or under TRITON_INTERPRET=1")
    if request.param == "fallback":
        monkeypatch.setattr(flash_jvp.api, "uses_kernels", lambda device: False)
    return request.param


def _transform_state():
    """What a test may change only inside a context: transforms, grad modes, dispatch keys."""
    return (
        torch._C._functorch.peek_interpreter_stack() is None,
        torch._C._is_fwd_grad_enabled(), torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(), torch.autograd.forward_ad._current_level,
        repr(torch._C._dispatch_tls_local_exclude_set()),
        repr(torch._C._dispatch_tls_local_include_set()),
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _no_leaked_state():
    """A test that leaves autograd or functorch state behind fails itself, not some later
    test in the same worker. Its garbage is collected first: a reference cycle that holds one
    of torch's dispatch-key guards resets the state of whatever thread collects it, at a time
    the collector picks (see helpers.dispatch_keys_kept)."""
    before = _transform_state()
    yield
    gc.collect()
    assert _transform_state() == before, "the test left autograd/functorch state changed"
