"""benchmarks/tune.py: a timed config never outlives its timing, whatever the kind (a kind
that left a tuple in configs broke every later kind), and a failing config is reported with
its reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import DEVICE, needs_kernels, randn

from flash_jvp._utils import Spec
from flash_jvp.kernels import configs
from flash_jvp.kernels.configs import Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import tune  # noqa: E402

pytestmark = needs_kernels
KINDS = ["dkdv+t", "dq+t", "dkdv", "dq", "jvp", "fwd"]


def _problem(shape, case):
    B, H, L, E = shape
    q, k, v, qt, kt, vt, do = (randn(B, H, L, E, device=DEVICE) for _ in range(7))
    return q, k, v, (qt, kt, vt), do, None, Spec(E**-0.5, None)


@pytest.fixture
def small_problem(monkeypatch):
    monkeypatch.setattr(tune, "problem", _problem)


def test_configs_restored_after_every_kind(small_problem):
    before = {name: getattr(configs, name) for name in set(tune.KERNEL_CONFIGS.values())}
    for kind in KINDS:
        t = tune.time_config(kind, Config(16, 16, 4, 1), (1, 1, 32, 16), "none", True)
        assert t == 0.0, f"{kind}: {t}"
        assert {name: getattr(configs, name) for name in before} == before, kind


def test_failing_config_reported_with_reason(small_problem, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("out of shared memory")

    monkeypatch.setattr(tune._ops, "attn_fwd", fail)
    t = tune.time_config("fwd", Config(16, 16, 4, 1), (1, 1, 32, 16), "none", True)
    assert t == "RuntimeError: out of shared memory"


def test_tangent_kind_times_only_the_tangent_kernels(small_problem, monkeypatch):
    """dkdv+t's config reaches the TANGENT kernel; the primal one (run for the tangents'
    gradients) keeps its own candidates."""
    seen = []
    configured = configs.bwd_dkdv

    def spy(width, dtype, tangent=False):
        seen.append(tangent)
        return configured(width, dtype, tangent)

    monkeypatch.setattr(configs, "bwd_dkdv", spy)
    cfg = Config(16, 32, 4, 1)
    launched = []
    original = tune._ops._launch

    def record(kernel, grid, candidates, key, *args, **kwargs):
        launched.append((kernel.fn.__name__, key[0], candidates))
        return original(kernel, grid, candidates, key, *args, **kwargs)

    monkeypatch.setattr(tune._ops, "_launch", record)
    assert tune.time_config("dkdv+t", cfg, (1, 1, 32, 16), "none", True) == 0.0
    dkdv = [c for name, _, c in launched if name == "attn_bwd_dkdv_kernel"]
    assert len(dkdv) == 2 and dkdv[0] == [cfg] and dkdv[1] != [cfg]
    assert seen == [False]  # only the primal variant went to the configured candidates
