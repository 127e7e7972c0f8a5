"""The pure-PyTorch path CPU tensors take without TRITON_INTERPRET (forced here in-process)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_matches_reference, qkv
from torch.autograd import forward_ad as fwAD
from torch.nn.attention import SDPBackend, sdpa_kernel

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


@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str
)
@pytest.mark.parametrize(
    "mask_dtype",
    [None, torch.bool, torch.float32, torch.float16, torch.bfloat16, torch.float64],
    ids=str,
)
def test_fallback_autocast_casts_like_sdpa(fallback, autocast_dtype, dtype, mask_dtype):
    """Under autocast every fp16/bf16/fp32 argument, attn_mask included, is cast to the
    autocast dtype (float64 is not): the result dtype, values and refusals of math SDPA."""
    q, k, v, _, _ = qkv(1, 2, 2, 8, 8, 16, dtype=dtype, device="cpu")
    mask = None if mask_dtype is None else torch.randn(8, 8).to(mask_dtype)
    if mask_dtype is torch.bool:
        mask = (torch.rand(8, 8) > 0.3) | torch.eye(8, dtype=torch.bool)
    with torch.autocast("cpu", dtype=autocast_dtype):
        try:
            with sdpa_kernel(SDPBackend.MATH):
                expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        except RuntimeError:  # torch's refusal (a float64 mask beside a cast query)
            assert flash_jvp.supports(q, k, v, attn_mask=mask)
            with pytest.raises(TypeError, match="attn_mask dtype"):
                flash_jvp.attention(q, k, v, attn_mask=mask)
            return
        assert flash_jvp.supports(q, k, v, attn_mask=mask) == []
        o = flash_jvp.attention(q, k, v, attn_mask=mask)
    assert o.dtype == expected.dtype
    torch.testing.assert_close(o, expected, atol=3e-2, rtol=3e-2)


def test_meta_tensors_take_the_fallback():
    q = torch.empty(1, 2, 8, 16, device="meta")
    assert flash_jvp.attention(q, q, q).shape == (1, 2, 8, 16)


@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fallback_computes_in_float32_under_autocast(fallback, autocast_dtype):
    """Under autocast the fallback casts its inputs as autocast casts SDPA's, then computes in
    float32 like math SDPA, not in the autocast dtype (a fresh-user trial found bf16 internals:
    3x math SDPA's error). Equal bit for bit to the call on the cast inputs without autocast,
    and no worse than math SDPA against float64."""
    q, k, v, _, _ = qkv(2, 4, 4, 64, 64, 32, device="cpu")
    with torch.autocast("cpu", dtype=autocast_dtype):
        ours = flash_jvp.attention(q, k, v)
        with sdpa_kernel(SDPBackend.MATH):
            theirs = F.scaled_dot_product_attention(q, k, v)
    cast = flash_jvp.attention(*(x.to(autocast_dtype) for x in (q, k, v)))
    assert torch.equal(ours, cast)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())

    def err(x):
        return ((x.double() - exact).norm() / exact.norm()).item()

    assert err(ours) <= 1.5 * err(theirs) + 1e-6, (err(ours), err(theirs))


@pytest.mark.parametrize("fill", ["-inf", "finfo.min"])
def test_gradient_through_tangent_with_a_hidden_row(fallback, fill):
    """Reverse mode through o_t with an additive mask that hides a whole query row: finite
    gradients equal to those of the problem without that row (its o_t is 0, a constant).
    The fallback used to add the -inf entries to the scores, so gradients and tangents flowed
    into them: NaN (found by an adversarial run; the compiled composite path shares it)."""
    q, k, v, tangents, _ = qkv(1, 2, 2, 5, 6, 8, dtype=torch.float64, device="cpu")
    mask = torch.randn(1, 2, 5, 6, dtype=torch.float64)
    mask[:, :, 1] = -math.inf if fill == "-inf" else torch.finfo(torch.float64).min
    rows = [0, 2, 3, 4]

    def grads(q, k, mask, t_q):
        q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
        _, o_t = torch.func.jvp(
            lambda q, k, v: flash_jvp.attention(q, k, v, attn_mask=mask),
            (q, k, v), (t_q, *tangents[1:]),
        )  # fmt: skip
        return torch.autograd.grad(o_t.square().sum(), (q, k))

    dq, dk = grads(q, k, mask, tangents[0])
    dq_vis, dk_vis = grads(q[:, :, rows], k, mask[:, :, rows], tangents[0][:, :, rows])
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all()
    assert (dq[:, :, 1] == 0).all()
    torch.testing.assert_close(dq[:, :, rows], dq_vis, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dk, dk_vis, rtol=1e-10, atol=1e-12)
