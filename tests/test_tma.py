"""The kernels' tensor-descriptor (TMA) paths (the forward's tiles, the backward dQ kernel's
key-side tiles): taken where the launcher takes them, right in every case they serve, and not
taken (pointer path) where a tensor cannot be described.

On the GPU this runs on Hopper only (the path's hardware), with every config switched to
descriptors (the shipped configs use them only where measured faster, see configs.py). On
the CPU the interpreter runs the same kernel code through its own tensor descriptors, with the
launcher told the device is Hopper and short key ranges not counted as short.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import (
    CUDA,
    DEVICE,
    assert_close_rel,
    assert_matches_reference,
    needs_kernels,
    qkv,
    randn,
)
from test_tangent_backward import CASES, _case_kwargs, assert_tangent_grads
from test_varlen import check_varlen
from torch.nn.attention.bias import causal_lower_right

import flash_jvp
from flash_jvp import _ops, reference
from flash_jvp.kernels import configs
from flash_jvp.kernels.bwd import attn_bwd_dq_kernel
from flash_jvp.kernels.fwd import attn_fwd_kernel

HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9
pytestmark = [
    needs_kernels,
    pytest.mark.skipif(CUDA and not HOPPER, reason="tensor descriptors serve Hopper only"),
]
L = 600 if CUDA else 76  # more keys than configs.SHORT_LK on the GPU; a multiple of 4 (WS)
DTYPE = torch.bfloat16 if CUDA else torch.float16


@pytest.fixture
def tma_seen(monkeypatch) -> list[tuple[bool, bool, bool]]:
    """(tangent, TMA, WS) of every forward launch, every forward config asking for descriptors
    (and on the CPU for warp specialisation, where the launch allows it)."""
    if not CUDA:
        monkeypatch.setattr(_ops, "_tma_capable", lambda device: True)
        monkeypatch.setattr(configs, "SHORT_LK", 0)
    candidates = configs._candidates

    # the interpreter has no warp specialisation but runs the one-loop schedule it takes
    def forced(*args, **kwargs):
        return [dataclasses.replace(c, tma=True, ws=c.ws or not CUDA)
                for c in candidates(*args, **kwargs)]  # fmt: skip

    monkeypatch.setattr(configs, "_candidates", forced)
    monkeypatch.setattr(_ops, "_CHOSEN", {})  # no config chosen outside this test
    monkeypatch.setattr(configs, "HOPPER", {})  # the Gluon forward: tests/test_hopper.py
    seen: list[tuple[bool, bool, bool]] = []
    launch = _ops._launch

    def spy(kernel, grid, candidates, key, cfg_args=lambda cfg: {}, **args):
        if kernel is attn_fwd_kernel:
            tangent = any(args[f"HAS_{x}_T"] for x in ("Q", "K", "V", "MASK"))
            switches = cfg_args(candidates[0])
            seen.append((tangent, switches["TMA"], switches["WS"]))
        return launch(kernel, grid, candidates, key, cfg_args, **args)

    monkeypatch.setattr(_ops, "_launch", spy)
    return seen


@pytest.fixture
def bwd_seen(tma_seen, monkeypatch) -> list[tuple[bool, bool]]:
    """(TANGENT, TMA) of every launch of the backward's dQ kernel, on tma_seen's Hopper with
    every config asking for descriptors."""
    seen: list[tuple[bool, bool]] = []
    launch = _ops._launch

    def spy(kernel, grid, candidates, key, cfg_args=lambda cfg: {}, **args):
        if kernel is attn_bwd_dq_kernel:
            seen.append((args["TANGENT"], cfg_args(candidates[0])["TMA"]))
        return launch(kernel, grid, candidates, key, cfg_args, **args)

    monkeypatch.setattr(_ops, "_launch", spy)
    return seen


def _bhle(x: torch.Tensor) -> torch.Tensor:
    """The same values as a (B, L, H, E) tensor seen as (B, H, L, E) (projection layout)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize(
    "case",
    [
        "plain",
        "gqa_causal_bool",
        "additive",
        "bhle",
        "e16",
        "e64",
        "e112",
        "bottom_right",
        "varlen",
    ],
)
def test_descriptor_path(tma_seen, bwd_seen, case):
    """fwd+JVP, the primal forward and its backward's dQ kernel through descriptors; 112: one
    128-column tile, 16 padding columns; varlen: one descriptor per packed sequence, whose
    end bounds its key tiles."""
    E = int(case[1:]) if case[0] == "e" else 128
    Hkv = 1 if case == "gqa_causal_bool" else 2
    Lq = L // 2 if case == "bottom_right" else L
    q, k, v, tangents, do = qkv(2, 2, Hkv, Lq, L, E, dtype=DTYPE)
    kwargs = {}
    if case == "gqa_causal_bool":
        mask = torch.rand(2, 1, L, L, device=DEVICE) > 0.3
        mask[:, :, 5] = False  # a fully masked row: zeros
        kwargs = dict(attn_mask=mask, is_causal=False, enable_gqa=True)
    elif case == "additive":
        kwargs = dict(attn_mask=torch.randn(1, 2, L, L, device=DEVICE, dtype=DTYPE))
    elif case == "bhle":
        q, k, v, do = (_bhle(x) for x in (q, k, v, do))
        tangents = tuple(_bhle(x) for x in tangents)
        kwargs = dict(is_causal=True)
    elif case == "bottom_right":
        kwargs = dict(attn_mask=causal_lower_right(Lq, L))
    if case == "varlen":  # three packed sequences (ends inside tiles), against math SDPA on each
        lens = torch.tensor([0, L // 3, L // 3 + 5, L], dtype=torch.int32, device=DEVICE)
        q, k, v, *tangents, do = (x[0].transpose(0, 1) for x in (q, k, v, *tangents, do))
        check_varlen(q, k, v, tuple(tangents), do, lens, lens)
    else:
        assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, **kwargs)
    assert {tangent for tangent, _, _ in tma_seen} == {False, True}, tma_seen
    assert all(tma for _, tma, _ in tma_seen), tma_seen
    assert bwd_seen and all(tma for _, tma in bwd_seen), bwd_seen
    # the warp-specialised schedule: where no attn_mask is read and batches are dense (on the
    # GPU: where a shipped config has it, E = 128 with a tangent)
    # (causal_lower_right: no mask) and whose lse rows start 16-byte aligned (Lq % 4 == 0)
    ws_allowed = case not in ("gqa_causal_bool", "additive", "varlen") and Lq % 4 == 0
    if not CUDA:
        assert all(ws == ws_allowed for _, _, ws in tma_seen), tma_seen
    elif case in ("plain", "bhle", "bottom_right"):
        assert any(ws for _, _, ws in tma_seen), tma_seen
    else:
        assert ws_allowed or not any(ws for _, _, ws in tma_seen), tma_seen


@pytest.mark.parametrize("case", ["plain", "causal", "lower_right", "gqa", "odd_rows"])
def test_lse_and_mu_through_descriptors(tma_seen, case):
    """lse and its tangent mu (stored after the key loop: through 1-D descriptors under warp
    specialisation, where pointer stores wrote nothing on sm_90) and o, o_t against float64,
    under torch.func.jvp; odd_rows: Lq % 4 != 0, lse rows unaligned, so no warp
    specialisation (the launch says which)."""
    Lq = {"lower_right": 4 * (L // 8), "odd_rows": L - 1}.get(case, L)
    q, k, v, tangents, _ = qkv(2, 2, 1 if case == "gqa" else 2, Lq, L, 128, dtype=DTYPE)
    kw = {"causal": dict(is_causal=True), "gqa": dict(enable_gqa=True)}.get(case, {})
    if case == "lower_right":
        kw = dict(attn_mask=causal_lower_right(Lq, L))
    (o, lse), (o_t, mu) = torch.func.jvp(
        lambda q, k, v: flash_jvp.attention_with_lse(q, k, v, **kw), (q, k, v), tangents
    )
    d = [x.double() for x in (q, k, v, *tangents)]
    (o_r, lse_r), (o_t_r, mu_r) = torch.func.jvp(
        lambda q, k, v: reference.attention_ref(q, k, v, return_lse=True, **kw),
        tuple(d[:3]),
        tuple(d[3:]),
    )
    tol = 1.5e-2 if DTYPE == torch.bfloat16 else 2e-3
    for name, x, ref in (("o", o, o_r), ("o_t", o_t, o_t_r), ("mu", mu, mu_r)):
        assert_close_rel(name, x, ref, tol)
    assert_close_rel("lse", lse, lse_r, 1e-3)
    ws = [ws for tangent, _, ws in tma_seen if tangent]
    assert ws and all(ws) == (case != "odd_rows"), tma_seen


@pytest.mark.parametrize("case", ["unaligned_rows", "unaligned_data", "fp32", "split_tiles"])
def test_pointer_path_where_no_descriptor(tma_seen, bwd_seen, case):
    """Row strides that are not 16-byte multiples (k), data not 16-byte aligned (v), fp32 and
    split head-dim tiles (96 = 64 + 32) take the pointer loads, with the same results, in
    the forward and in the backward's dQ kernel."""
    E = 96 if case == "split_tiles" else 128
    dtype = torch.float32 if case == "fp32" else DTYPE
    q, k, v, tangents, do = qkv(1, 2, 2, L, L, E, dtype=dtype)
    if case == "unaligned_rows":  # rows 132 elements apart: 264 bytes
        k = torch.cat([k, k[..., :4]], dim=-1)[..., :E]
    if case == "unaligned_data":  # v starts 2 elements into its storage
        v = torch.empty(v.numel() + 2, device=DEVICE, dtype=dtype)[2:].view_as(v).copy_(v)
    assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do)
    assert tma_seen and not any(tma or ws for _, tma, ws in tma_seen), tma_seen
    assert bwd_seen and not any(tma for _, tma in bwd_seen), bwd_seen


@pytest.mark.parametrize("case", [*CASES, "e72"])
def test_backward_through_descriptors(bwd_seen, case):
    """The backward through the tangent (the gradients of <o, do> + <o_t, do_t> for q, k, v,
    their tangents and an additive mask and its tangent) and the primal backward against
    float64, with the dQ kernel's key tiles through descriptors: GQA, Lq = 45 (not a multiple
    of BLOCK_M) against Lk = 37, causal (top-left and bottom-right), boolean and additive
    masks, E = 16 and Ev = 24 (one 32-column tile each: zeros past the head dim). e72: split
    head-dim tiles (64 + 16), which descriptors do not take: pointer loads."""
    E = 72 if case == "e72" else 16
    q, k, v, tangents, do = qkv(2, 2, 1, 45, 37, E, E if case == "e72" else 24, dtype=DTYPE)
    do_t = randn(*do.shape, dtype=DTYPE)
    kw = dict(_case_kwargs("causal" if case == "e72" else case, q, k), enable_gqa=True)
    assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, **kw)
    mask = kw.pop("attn_mask") if case == "additive" else None
    mask_t = None if mask is None else randn(*mask.shape, dtype=DTYPE)
    assert_tangent_grads(flash_jvp.attention, q, k, v, tangents, do, do_t, mask, mask_t, **kw)
    assert {tangent for tangent, _ in bwd_seen} == {False, True}, bwd_seen
    assert all(tma == (case != "e72") for _, tma in bwd_seen), bwd_seen


def test_nan_past_key_padding(tma_seen, bwd_seen):
    """Keys past a key-padding mask's range are never read into a result, even when NaN:
    o, o_t and the gradients of q and q_t through both equal those of the same inputs with
    zeros there, bit for bit (the descriptor loads of the forward and the dQ kernel copy
    whole tiles, so the rows past the range are zeroed in the kernel)."""
    q, k, v, tangents, do = qkv(2, 2, 2, L, L, 128, dtype=DTYPE)
    n = L - 21  # the range ends inside a key block
    mask = (torch.arange(L, device=DEVICE) < n).expand(1, 1, L, L)
    clean = [x.clone() for x in (q, k, v, *tangents)]
    for x in clean[1:3] + clean[4:]:
        x[:, :, n:] = 0
    poisoned = [x.clone() for x in clean]
    for x in poisoned[1:3] + poisoned[4:]:
        x[:, :, n:] = float("nan")

    def run(xs):
        q, q_t = (x.detach().requires_grad_() for x in (xs[0], xs[3]))
        o, o_t = torch.func.jvp(
            lambda q, k, v: flash_jvp.attention(q, k, v, attn_mask=mask),
            (q, *xs[1:3]),
            (q_t, *xs[4:]),
        )  # fmt: skip
        return (o, o_t, *torch.autograd.grad((o, o_t), (q, q_t), (do, do)))

    for name, a, b in zip(("o", "o_t", "dq", "dq_t"), run(clean), run(poisoned)):
        assert torch.equal(a, b), f"{name} differs when the keys past the padding are NaN"
    assert_matches_reference(flash_jvp.attention, *clean[:3], tuple(clean[3:]), do, attn_mask=mask)
    assert all(tma and not ws for _, tma, ws in tma_seen), tma_seen
    assert bwd_seen and all(tma for _, tma in bwd_seen), bwd_seen


def test_varlen_backward_through_descriptors(bwd_seen):
    """Packed sequences (one empty; ends inside query and key blocks), causal: the backward
    through the tangent with one descriptor per sequence, whose end bounds its rows, against
    per-sequence math SDPA in float64."""
    cu = torch.tensor([0, 7, 7, 45], device=DEVICE, dtype=torch.int32)
    q, k, v, q_t, k_t, v_t, do, do_t = (randn(45, 2, 16, dtype=DTYPE) for _ in range(8))

    def grads(varlen, dtype):
        prim = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        tans = [x.detach().to(dtype).requires_grad_() for x in (q_t, k_t, v_t)]
        o, o_t = torch.func.jvp(lambda q, k, v: varlen(q, k, v, cu, cu, 38, 38, is_causal=True),
                                tuple(prim), tuple(tans))  # fmt: skip
        return torch.autograd.grad((o, o_t), prim + tans, (do.to(dtype), do_t.to(dtype)))

    def math_varlen(q, k, v, cu_q, cu_k, mq, mk, is_causal):
        return reference.varlen_math_sdpa(q, k, v, cu_q, cu_k, is_causal)

    ours = grads(flash_jvp.varlen_attention, DTYPE)
    ref = grads(math_varlen, torch.float64)
    tol = 1.5e-2 if DTYPE == torch.bfloat16 else 2e-3
    for name, a, b in zip(("dq", "dk", "dv", "dq_t", "dk_t", "dv_t"), ours, ref):
        assert_close_rel(name, a, b, tol)
    assert bwd_seen and all(tma for _, tma in bwd_seen), bwd_seen
