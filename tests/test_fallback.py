"""The pure-PyTorch path CPU tensors take without TRITON_INTERPRET (forced here in-process)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_matches_reference, qkv
from torch.autograd import forward_ad as fwAD

import flash_jvp
from flash_jvp import api


@pytest.fixture
def fallback(monkeypatch):
    monkeypatch.setattr(api, "uses_kernels", lambda device: False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_fallback_matches_reference(fallback, dtype, is_causal):
    q, k, v, tangents, do = qkv(2, 4, 2, 33, 40, 16, dtype=dtype, device="cpu")
    assert_matches_reference(
        flash_jvp.attention, q, k, v, tangents, do, is_causal=is_causal, enable_gqa=True
    )


def test_fallback_forward_ad_and_validation(fallback):
    q, k, v, (q_t, _, _), _ = qkv(1, 2, 2, 8, 8, 16, device="cpu")
    with fwAD.dual_level():
        o = flash_jvp.attention(fwAD.make_dual(q, q_t), k, v)
        assert fwAD.unpack_dual(o).tangent is not None
    with pytest.raises(ValueError, match="enable_gqa"):
        flash_jvp.attention(q, k[:, :1], v[:, :1])


def test_fallback_autocast_casts_float32_only(fallback):
    q, k, v, _, _ = qkv(1, 2, 2, 8, 8, 16, device="cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert flash_jvp.attention(q, k, v).dtype == torch.bfloat16
        assert flash_jvp.attention(q.double(), k.double(), v.double()).dtype == torch.float64


def test_meta_tensors_take_the_fallback():
    q = torch.empty(1, 2, 8, 16, device="meta")
    assert flash_jvp.attention(q, q, q).shape == (1, 2, 8, 16)
