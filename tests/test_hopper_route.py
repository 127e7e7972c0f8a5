"""Which calls the launcher sends to the Gluon forward (kernels/fwd_hopper.py; _ops._hopper),
decided from shapes, dtypes and strides alone, so checked here on any machine with metadata
("meta") tensors and every offered variant routed: in scope, the offered variant; outside it
(tests/test_hopper.py runs both sides on Hopper), None, so the Triton forward runs."""

from __future__ import annotations

import pytest
import torch

from flash_jvp import _ops
from flash_jvp._utils import MAX_GRID_Y, Spec
from flash_jvp.kernels import configs


@pytest.fixture(autouse=True)
def as_on_hopper(monkeypatch):
    monkeypatch.setattr(_ops, "_tma_capable", lambda device: True)
    monkeypatch.setattr(_ops, "INTERPRET", False)
    monkeypatch.setattr(configs, "HOPPER", configs.HOPPER_COMPILED)


def meta_qkv(B, H, H_KV, Lq, Lk, E, Ev, dtype, expand_kv):
    """q, k, v as metadata tensors; with ``expand_kv`` k and v expanded over the batch (a
    stride of 0)."""
    q = torch.empty(B, H, Lq, E, dtype=dtype, device="meta")
    k = torch.empty(1 if expand_kv else B, H_KV or H, Lk, E, dtype=dtype, device="meta")
    v = torch.empty(1 if expand_kv else B, H_KV or H, Lk, Ev or E, dtype=dtype, device="meta")
    if expand_kv:
        k, v = k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1)
    return q, k, v


def _route(B=2, H=2, H_KV=None, Lq=600, Lk=600, E=64, Ev=None, dtype=torch.bfloat16,
           tangents="all", mask=None, mask_t=None, causal=False, expand_kv=False):  # fmt: skip
    q, k, v = meta_qkv(B, H, H_KV, Lq, Lk, E, Ev, dtype, expand_kv)
    ts = {"all": (q, k, v), "none": (None,) * 3, "q": (q, None, None)}[tangents]
    spec = Spec(scale=E**-0.5, causal_offset=0 if causal else None)
    lay = _ops._Layout.of(q, k, v, spec)
    return _ops._hopper(lay, spec, mask, mask_t, (q, k, v, *ts))


@pytest.mark.parametrize("tangents", ["all", "none"])
@pytest.mark.parametrize("E", [64, 128])
def test_in_scope(E, tangents):
    cfg = _route(E=E, tangents=tangents, Lk=configs.HOPPER_MIN_LK + 1, causal=True, H=4, H_KV=2)
    assert cfg == configs.HOPPER_COMPILED[(tangents == "all", E)]


@pytest.mark.parametrize(
    "kw",
    [
        {"Lk": configs.HOPPER_MIN_LK},
        {"tangents": "q"},
        {"E": 96},
        {"E": 64, "Ev": 128},
        {"dtype": torch.float32},
        {"mask": torch.ones(1, 1, 1, 600, dtype=torch.bool, device="meta")},
        {"mask_t": torch.zeros(1, 1, 1, 600, device="meta")},
        {"B": MAX_GRID_Y + 1, "H": 1},
        {"B": 64, "H": 64, "Lq": 4096, "Lk": 4096, "E": 128},  # o has 2**31 elements
        {"expand_kv": True},
    ],
    ids=[
        "Lk512",
        "some_tangents",
        "e96",
        "ev_ne_e",
        "fp32",
        "mask",
        "mask_t_alone",
        "grid_y",
        "o_2e31",
        "expanded_kv",
    ],  # fmt: skip
)
def test_out_of_scope(kw):
    assert _route(**kw) is None
