"""Which backward calls the launcher sends to the Gluon backward (kernels/bwd_hopper.py;
_ops._hopper_bwd), decided from shapes, dtypes, strides and torch's determinism flag alone,
so checked here on any machine with metadata ("meta") tensors: in scope, the offered
variant; outside it (tests/test_hopper_bwd.py runs both sides on Hopper), None, so the
Triton kernels run."""

from __future__ import annotations

import pytest
import torch
from test_hopper_route import meta_qkv

from flash_jvp import _ops
from flash_jvp._utils import MAX_GRID_Y, Spec
from flash_jvp.kernels import configs

L = configs.HOPPER_BWD_MIN_L


@pytest.fixture(autouse=True)
def as_on_hopper(monkeypatch):
    monkeypatch.setattr(_ops, "_tma_capable", lambda device: True)
    monkeypatch.setattr(_ops, "INTERPRET", False)


def _route(B=2, H=2, H_KV=None, Lq=L + 1, Lk=L + 7, E=64, Ev=None, dtype=torch.bfloat16,
           mask=None, causal=False, expand_kv=False, do=True):  # fmt: skip
    q, k, v = meta_qkv(B, H, H_KV, Lq, Lk, E, Ev, dtype, expand_kv)
    spec = Spec(scale=E**-0.5, causal_offset=Lk - Lq if causal else None)
    lay = _ops._Layout.of(q, k, v, spec)
    return _ops._hopper_bwd(lay, spec, mask, (q, k, v, torch.empty_like(q) if do else None))


@pytest.mark.parametrize("E", sorted(configs.HOPPER_BWD))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_scope(causal, dtype, E):
    assert _route(causal=causal, dtype=dtype, E=E) == configs.HOPPER_BWD[E]


@pytest.mark.parametrize(
    "kw",
    [
        {"Lq": L - 1},
        {"Lk": L - 1},
        {"E": 96},
        {"E": 64, "Ev": 128},
        {"dtype": torch.float32},
        {"H": 4, "H_KV": 2},
        {"mask": torch.zeros(1, 1, 1, L + 7, device="meta")},
        {"do": False},  # lse's cotangent alone
        {"B": MAX_GRID_Y + 1, "H": 1},
        {"B": 64, "H": 128, "Lq": L, "Lk": L},  # 2**31 elements
        {"expand_kv": True},
    ],
    ids=[
        "short_q",
        "short_k",
        "e96",
        "ev_ne_e",
        "fp32",
        "gqa",
        "mask",
        "no_do",
        "grid_y",
        "2e31",
        "expanded_kv",
    ],  # fmt: skip
)
def test_out_of_scope(kw):
    assert _route(**kw) is None


def test_not_under_deterministic_algorithms(monkeypatch):
    """Its dq sums in varying order: torch.use_deterministic_algorithms keeps the Triton
    kernels (deterministic)."""
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert _route() is None


def test_not_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(_ops, "INTERPRET", True)
    assert _route() is None
