"""Context parallelism (flash_jvp.distributed) on 2 and 4 processes.

CPU tier: gloo, the PyTorch fallback (float32, float64) and Triton's interpreter (float32,
float16), whatever TRITON_INTERPRET this pytest runs with: every job sets it for its own
processes. Each job runs many checks in one set of processes (tests/distributed_workers.py);
rank 0 compares o, o_t, lse, mu, dq, dk, dv over the gathered sequence with single-process
flash_jvp by the accuracy rule of flash_jvp._check. GPU tier: NCCL, one process per GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_workers import Case, spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is absent")

F16, F32, F64 = torch.float16, torch.float32, torch.float64
METHODS = ("ulysses", "ring")


def fallback_cases(p: int) -> list[Case]:
    cases = [Case(m, c, d) for m in METHODS for c in (False, True) for d in (F32, F64)]
    cases += [Case(m, c, F64, lse=False) for m in METHODS for c in (False, True)]
    cases += [Case(m, True, F32, hkv=2) for m in METHODS]  # GQA (Ulysses: Hkv < P at P = 4)
    cases += [Case(m, True, F64, seq_layout="head_tail") for m in METHODS]
    if p == 2:
        cases += [Case(m, True, F64, hkv=1) for m in METHODS]  # GQA, Hkv < P: replicated
        cases += [Case(m, False, F64, lq=8, lk=6) for m in METHODS]  # Lq != Lk
        cases += [Case(m, c, F32, scale=0.3) for m, c in (("ring", True), ("ulysses", False))]
        cases += [Case("ulysses", True, F64, seq_layout="head_tail", lse=False)]
    return cases


def interpreter_cases() -> list[Case]:
    small = dict(hq=2, hkv=2, lq=16, lk=16, b=1, e=16)
    # Ulysses without lse runs flash_jvp.attention's kernels; the ring (and return_lse) runs
    # flash_jvp.attention_with_lse
    cases = [Case("ulysses", c, d, lse=False, **small) for c in (False, True) for d in (F32, F16)]
    cases += [Case("ring", c, d, **small) for c in (False, True) for d in (F32, F16)]
    cases += [Case("ulysses", True, F16, lse=False, **dict(small, hkv=1))]
    return cases


def test_two_ranks_fallback():
    spawn(2, "job_equality", fallback_cases(2), False)


def test_four_ranks_fallback():
    spawn(4, "job_equality", fallback_cases(4), False)


def test_two_ranks_interpreter():
    pytest.importorskip("triton", reason="Triton's interpreter needs triton (the test extra)")
    import numpy

    if tuple(int(n) for n in numpy.__version__.split(".")[:2]) >= (2, 4):
        # e.g. the H200 image's numpy 2.5 ("only 0-dimensional arrays can be converted")
        pytest.skip(f"Triton 3.6's interpreter fails with numpy {numpy.__version__} (needs < 2.4, "
                    "the test extra's pin; CI runs this test)")  # fmt: skip
    spawn(2, "job_equality", interpreter_cases(), True, interpret=True)


def test_api_two_ranks():
    """forward_ad, a group of one rank, a DeviceMesh, and bad input (every rank raises)."""
    spawn(2, "job_api")


# torch.func.jvp through FSDP2's fully_shard fails in torch 2.11 ("Cannot access storage of
# TensorWrapper" on the CPU, no setup_context on CUDA: pytorch issue #182641), not in 2.13
FSDP2_JVP = pytest.mark.xfail(
    torch.__version__ < (2, 12),
    reason="torch.func.jvp through FSDP2 fails in torch 2.11 (pytorch issue #182641); passes "
    "on torch 2.13",
    strict=True,
)


def test_models_two_ranks():
    """The sCM step (jvp, then backward) through context_parallel_sdpa, torch's
    context_parallel and DDP, against the single-process model."""
    spawn(2, "job_models", "cpu", ("cp", "torch_cp", "ddp"))


@FSDP2_JVP
def test_fsdp2_two_ranks():
    """The same step with FSDP2's fully_shard on the same ranks."""
    spawn(2, "job_models", "cpu", ("fsdp2",))


def test_merge_rows_without_keys():
    """The ring's merge of blocks whose rows saw no key (lse -inf, o 0): no NaN in the value,
    the tangent or the gradient; merged rows equal the softmax-weighted sum."""
    import math

    from flash_jvp.distributed import _merge

    g = torch.Generator().manual_seed(0)
    o = [torch.randn(2, 3, 5, 4, generator=g, dtype=F64) for _ in range(3)]
    lse = [torch.randn(2, 3, 5, generator=g, dtype=F64) for _ in range(3)]
    for i, rows in enumerate((slice(0, 2), slice(0, 1), slice(0, 3))):  # row 0: no block
        lse[i][..., rows], o[i][..., rows, :] = -math.inf, 0.0
    tangents = [torch.randn_like(x) for x in (*o, *lse)]

    def merged(*args):
        return _merge(list(zip(args[:3], args[3:])), F64)

    (o_m, lse_m), (o_t, mu) = torch.func.jvp(merged, (*o, *lse), tuple(tangents))
    leaves = [x.clone().requires_grad_() for x in (*o, *lse)]
    grads = torch.autograd.grad(sum(x.sum() for x in merged(*leaves)), leaves)
    for t in (o_m, o_t, mu, *grads):
        assert torch.isfinite(t).all()
    assert (lse_m[..., 0] == -math.inf).all() and (lse_m[..., 1:] > -math.inf).all()
    assert (o_m[..., 0, :] == 0).all() and (o_t[..., 0, :] == 0).all() and (mu[..., 0] == 0).all()
    stacked = torch.stack(lse)
    w = torch.softmax(stacked[..., 1:], dim=0)
    expected = sum(w[i].unsqueeze(-1) * o[i][..., 1:, :] for i in range(3))
    torch.testing.assert_close(o_m[..., 1:, :], expected)
    torch.testing.assert_close(lse_m[..., 1:], torch.logsumexp(stacked[..., 1:], dim=0))


def test_example_runs():
    """examples/context_parallel.py (the README's) on 2 CPU processes: its printed differences
    from the single-process step are small."""
    script = Path(__file__).parents[1] / "examples" / "context_parallel.py"
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    for method in METHODS:
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(script), "--device", "cpu", "--method", method, "--length", "256"],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        diffs = [float(line.split()[-1]) for line in run.stdout.splitlines() if "differ" in line]
        assert len(diffs) == 3 and max(diffs) < 1e-5, run.stdout


@pytest.mark.gpu
def test_two_gpus_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    big = dict(hq=8, hkv=8, lq=512, lk=512, b=2, e=64, device="cuda")
    cases = [
        Case(m, c, d, lse=lse, **big)
        for m in METHODS
        for c in (False, True)
        for d in (torch.bfloat16, F16, F32)
        for lse in ((False, True) if m == "ulysses" else (True,))
    ]
    cases += [Case(m, True, torch.bfloat16, **dict(big, hkv=2)) for m in METHODS]
    cases += [Case(m, True, torch.bfloat16, seq_layout="head_tail", **big) for m in METHODS]
    spawn(2, "job_equality", cases, True, backend="nccl")


@pytest.mark.gpu
def test_models_two_gpus_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(2, "job_models", "cuda", ("cp", "torch_cp", "ddp"), backend="nccl")


@pytest.mark.gpu
@FSDP2_JVP
def test_fsdp2_two_gpus_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    spawn(2, "job_models", "cuda", ("fsdp2",), backend="nccl")
