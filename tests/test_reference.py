"""The pure-PyTorch reference: equal to torch's SDPA, and its closed-form JVP formulas exact."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close_rel

from flash_jvp import reference
from flash_jvp._utils import Spec

CAUSAL = pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])


def _inputs(Hq=4, Hkv=2, Lq=7, Lk=9, E=5, Ev=6):
    g = dict(dtype=torch.float64)
    q, k = torch.randn(2, Hq, Lq, E, **g), torch.randn(2, Hkv, Lk, E, **g)
    v = torch.randn(2, Hkv, Lk, Ev, **g)
    tangents = tuple(torch.randn_like(x) for x in (q, k, v))
    return q, k, v, tangents


@CAUSAL
def test_attention_ref_equals_math_sdpa(is_causal):
    q, k, v, tangents = _inputs()
    do = torch.randn(2, 4, 7, 6, dtype=torch.float64)
    kw = dict(is_causal=is_causal, enable_gqa=True, scale=0.7)
    ours = reference.run_outputs(reference.attention_ref, q, k, v, tangents, do, **kw)
    ref = reference.run_outputs(reference.math_sdpa, q, k, v, tangents, do, **kw)
    for name, x in ours.as_dict().items():
        assert_close_rel(name, x, getattr(ref, name), 1e-12)


@CAUSAL
def test_attention_ref_gradcheck(is_causal):
    q, k, v, _ = _inputs(Hq=2, Hkv=1, Lq=3, Lk=4, E=3, Ev=2)
    args = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(
        lambda q, k, v: reference.attention_ref(q, k, v, is_causal=is_causal, enable_gqa=True),
        args, check_forward_ad=True, check_backward_ad=True,
    )  # fmt: skip


def _spec(scale, is_causal):
    return Spec(scale, 0 if is_causal else None)


@CAUSAL
def test_closed_form_jvp_equals_autodiff(is_causal):
    """attention_jvp (the formulas the kernel implements: o_t and lse's tangent mu) ==
    torch.func.jvp of attention_ref."""
    q, k, v, tangents = _inputs()
    scale = 0.4
    o_t, mu = reference.attention_jvp(q, k, v, *tangents, None, None, _spec(scale, is_causal))
    _, (o_t_ref, mu_ref) = torch.func.jvp(
        lambda q, k, v: reference.attention_ref(
            q, k, v, None, is_causal, scale, enable_gqa=True, return_lse=True
        ),
        (q, k, v), tangents,
    )  # fmt: skip
    assert_close_rel("o_t", o_t, o_t_ref, 1e-12)
    assert_close_rel("mu (lse's tangent)", mu, mu_ref, 1e-12)


@CAUSAL
def test_closed_form_forward_over_reverse_equals_autodiff(is_causal):
    q, k, v, tangents = _inputs()
    do, do_t = torch.randn(2, 2, 4, 7, 6, dtype=torch.float64).unbind(0)
    scale = 0.4

    def grads(q, k, v, do):
        _, vjp = torch.func.vjp(
            lambda q, k, v: reference.attention_ref(q, k, v, None, is_causal, scale, True),
            q, k, v,
        )  # fmt: skip
        return vjp(do)

    _, ref = torch.func.jvp(grads, (q, k, v, do), (*tangents, do_t))
    ours = reference.attention_bwd_jvp(
        q, k, v, do, *tangents, do_t, None, None, _spec(scale, is_causal)
    )
    for name, a, b in zip(("dq_t", "dk_t", "dv_t"), ours, ref):
        assert_close_rel(name, a, b, 1e-12)
