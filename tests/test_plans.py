"""Launch plans (flash_jvp._plans): a launcher call with the metadata of an earlier one replays
its recorded allocations and launches. Replayed calls must give what the launcher gives:
fresh inputs each time, against float64, every buffer poisoned (conftest)."""

from __future__ import annotations

import pytest
import torch
from helpers import CUDA, DEVICE, assert_close_rel, assert_matches_reference, qkv, randn
from torch.nn.attention.bias import causal_lower_right

import flash_jvp
from flash_jvp import _ops, _plans, reference


def on_cuda(test):
    """A test of the GPU tier: plans are made only where Triton compiles (CUDA)."""
    reason = "plans are made only where Triton compiles kernels (CUDA), not under the interpreter"
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason=reason)(test))


@pytest.fixture
def replays(monkeypatch) -> list[int]:
    """Counts replayed launcher calls; plans made before the test are dropped."""
    monkeypatch.setattr(_ops, "_CHOSEN", {})
    count = [0]
    replay = _plans._replay

    def counting(plan, inputs):
        count[0] += 1
        return replay(plan, inputs)

    monkeypatch.setattr(_plans, "_replay", counting)
    return count


def _case(case: str):
    dtype = torch.float16 if case == "fp16_causal" else torch.bfloat16
    E, L = (128, 512) if case == "descriptors" else (64, 77)
    Hkv = 1 if case == "gqa" else 2
    q, k, v, tangents, do = qkv(2, 2, Hkv, L, L, E, dtype=dtype)
    kwargs = {"gqa": dict(enable_gqa=True), "fp16_causal": dict(is_causal=True)}.get(case, {})
    if case == "key_padding":
        kwargs = dict(attn_mask=(torch.arange(L, device=DEVICE) < L - 20).expand(2, 1, L, L))
    if case == "bottom_right":
        q, tangents, do = q[:, :, :40], (tangents[0][:, :, :40], *tangents[1:]), do[:, :, :40]
        kwargs = dict(attn_mask=causal_lower_right(40, L))
    if case == "additive":
        kwargs = dict(attn_mask=randn(1, 2, L, L, dtype=dtype))
    return q, k, v, tangents, do, kwargs


CASES = ["plain", "fp16_causal", "gqa", "key_padding", "bottom_right", "additive", "descriptors"]


@on_cuda
@pytest.mark.parametrize("case", CASES)
def test_replayed_calls_match_float64(replays, case):
    """fwd, fwd+JVP and the backward: the second round with fresh inputs is replayed and
    passes the same float64 rule as the first."""
    assert_matches_reference(flash_jvp.attention, *_case(case)[:5], **_case(case)[5])
    assert replays[0] == 0
    q, k, v, tangents, do, kwargs = _case(case)
    assert_matches_reference(flash_jvp.attention, q, k, v, tangents, do, **kwargs)
    assert replays[0] >= 3, "fwd, fwd+JVP and the backward should have been replayed"


@on_cuda
def test_tangent_backward_replayed(replays):
    """The backward through o and o_t (a TVM step) twice: the second is replayed."""

    def grads(fn, q, k, v, tangents, do):
        prim = [x.detach().requires_grad_() for x in (q, k, v)]
        tans = [t.detach().requires_grad_() for t in tangents]
        o, o_t = torch.func.jvp(fn, tuple(prim), tuple(tans))
        loss = (o.float() * do.float()).sum() + (o_t.float() * do.float()).sum()
        return torch.autograd.grad(loss, prim + tans)

    for round_ in range(2):
        q, k, v, tangents, do = qkv(1, 2, 2, 70, 70, 64, dtype=torch.float32)
        ours = grads(flash_jvp.attention, q, k, v, tangents, do)
        ref = grads(reference.attention_ref, *(x.double() for x in (q, k, v)),
                    tuple(t.double() for t in tangents), do.double())  # fmt: skip
        for name, a, b in zip(("dq", "dk", "dv", "dq_t", "dk_t", "dv_t"), ours, ref):
            assert_close_rel(f"{name} (round {round_})", a, b, 1e-4)
    assert replays[0] >= 2


@on_cuda
def test_shared_storage_is_part_of_the_key(replays):
    """attention(x, x, x) and attention(q, k, v) have the same metadata; a plan made for one
    must not hand the other's pointers around."""
    x = randn(1, 2, 64, 32, dtype=torch.bfloat16)
    q, k, v = (randn(1, 2, 64, 32, dtype=torch.bfloat16) for _ in range(3))
    for args in ((x, x, x), (q, k, v), (x, x, x), (q, k, v)):
        ref = reference.math_sdpa(*(a.double() for a in args))
        assert_close_rel("o", flash_jvp.attention(*args), ref, 2e-2)
    assert replays[0] == 2


@on_cuda
def test_lse_cotangent_runs_the_launcher(replays):
    """A loss on lse updates delta in place: such calls are not planned (and stay right)."""
    q, k, v = (randn(1, 2, 50, 32).requires_grad_() for _ in range(3))
    for _ in range(2):
        o, lse = flash_jvp.attention_with_lse(q, k, v)
        grads = torch.autograd.grad(lse.sum() + o.sum(), (q, k, v))
        _, ref_lse = reference.attention_ref(*(x.detach().double() for x in (q, k, v)),
                                             return_lse=True)  # fmt: skip
        assert all(torch.isfinite(g).all() for g in grads)
        assert_close_rel("lse", lse, ref_lse, 1e-5)
    assert _plans._UNPLANNED in _ops.attn_bwd_tangent.plans.values()


@on_cuda
def test_new_configs_make_new_plans(replays, monkeypatch):
    """After forget_configs (tune.py), the next call chooses and launches through _launch
    again instead of replaying a plan made with the old choices."""
    q, k, v = (randn(1, 1, 40, 16) for _ in range(3))
    flash_jvp.attention(q, k, v)
    flash_jvp.attention(q, k, v)
    assert replays[0] == 1
    launched = []
    launch = _ops._launch

    def spy(*args, **kwargs):
        launched.append(args[0])
        return launch(*args, **kwargs)

    monkeypatch.setattr(_ops, "_launch", spy)
    _ops.forget_configs()
    flash_jvp.attention(q, k, v)
    assert launched and replays[0] == 1


def _fresh_forward_matches_float64() -> None:
    """A bf16 forward on fresh inputs (the same metadata each time), checked against float64."""
    q, k, v = (randn(1, 2, 64, 32, dtype=torch.bfloat16) for _ in range(3))
    ref = reference.math_sdpa(q.double(), k.double(), v.double())
    assert_close_rel("o", flash_jvp.attention(q, k, v), ref, 2e-2)


def _plan_launchers() -> set:
    """The Triton launcher objects of every plan made so far."""
    return {
        type(step.compiled.run)
        for launcher in (_ops.attn_fwd, _ops.attn_bwd_tangent)
        for plan in launcher.plans.values()
        if plan is not _plans._UNPLANNED
        for step in plan.launches
    }


@on_cuda
@pytest.mark.skipif(not _plans._DIRECT_LAUNCH, reason="the direct launch follows Triton 3.6")
def test_replay_launches_directly_without_hooks(replays, monkeypatch):
    """Without launch hooks (Triton 3.6: empty HookChains, never None) a replay calls the
    compiled launcher itself, not Triton's launcher object, and stays right."""
    from triton import knobs

    assert not knobs.runtime.launch_enter_hook.calls, "a launch hook is set in this process"
    _fresh_forward_matches_float64()  # plans the forward

    def refuse(*args, **kwargs):
        raise AssertionError("replayed through Triton's launcher object, not directly")

    launcher_types = _plan_launchers()
    assert launcher_types, "the first call made no plan"
    for launcher_type in launcher_types:
        monkeypatch.setattr(launcher_type, "__call__", refuse)
    _fresh_forward_matches_float64()
    assert replays[0] == 1


@on_cuda
def test_replay_calls_launch_hooks(replays):
    """A launch hook (as profilers add) sees every replayed launch, with its kernel's name."""
    from triton import knobs

    _fresh_forward_matches_float64()  # plans the forward
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton's launch hook is a plain knob, not a HookChain")
    chain.add(hook)
    try:
        _fresh_forward_matches_float64()
    finally:
        chain.remove(hook)
    assert replays[0] == 1
    assert seen == ["attn_fwd_kernel"]


@pytest.mark.parametrize("with_call", [False, True])
def test_hooks_that_call_nothing_count_as_none(with_call):
    """Triton 3.6's launch-hook knobs hold a HookChain, never None: an empty one must still
    let replays skip launch metadata; a chain with a call, or a plain function, is a hook."""
    from triton import knobs

    if not hasattr(knobs, "HookChain"):
        pytest.skip("this Triton's launch hooks are plain knobs (None when unset)")
    chain = knobs.HookChain()
    if with_call:
        chain.add(print)
    assert (_plans._hook(chain) is chain) == with_call
    assert _plans._hook(None) is None
    assert _plans._hook(print) is print
