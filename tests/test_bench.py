"""`python -m flash_jvp bench`'s ratio table (pure Python: rows in, the targets' ratios out)."""

from __future__ import annotations

import math
import random

import pytest

from flash_jvp.bench import Row, ratios


def _rows(times: dict[tuple[str, str, bool], float]) -> list[Row]:
    # TFLOP/s as the bench computes it: a shape's FLOPs (halved when causal) over the time
    return [
        Row(method, mode, 4, 8, 8192, 128, causal, "bf16", ms, (0.5 if causal else 1.0) / ms, 0.0)
        for (method, mode, causal), ms in times.items()
    ]


def test_ratios_of_issue_25_targets():
    """Each ratio is the quotient of the rows it names, per shape; causal against the same
    shape without is_causal; a ratio whose rows are missing is NaN, never a number."""
    rng = random.Random(0)
    times = {}
    pairs = [("flash_jvp", "fwd+jvp"), ("flash_jvp", "fwd"), ("flash_jvp", "bwd"),
             ("sdpa_cudnn", "fwd"), ("sdpa_cudnn", "bwd"), ("sdpa_flash", "fwd")]  # fmt: skip
    for causal in (False, True):
        for method, mode in pairs:
            times[(method, mode, causal)] = rng.uniform(0.5, 5.0)
    out = {r["is_causal"]: r for r in ratios(_rows(times))}
    assert set(out) == {False, True}
    for causal, r in out.items():
        t = {(m, mode): ms for (m, mode, c), ms in times.items() if c == causal}
        assert r["fwd+jvp / cuDNN fwd"] == pytest.approx(
            t[("flash_jvp", "fwd+jvp")] / t[("sdpa_cudnn", "fwd")]
        )
        assert r["fwd / cuDNN fwd"] == pytest.approx(
            t[("flash_jvp", "fwd")] / t[("sdpa_cudnn", "fwd")]
        )
        assert r["fwd+bwd / cuDNN fwd+bwd"] == pytest.approx(
            (t[("flash_jvp", "fwd")] + t[("flash_jvp", "bwd")])
            / (t[("sdpa_cudnn", "fwd")] + t[("sdpa_cudnn", "bwd")])
        )
        assert math.isnan(r["jvp-flash-attention / ours, fwd+jvp"])  # no such row
    # half the FLOPs: causal TFLOP/s / dense TFLOP/s = 0.5 * dense time / causal time
    expected = 0.5 * times[("flash_jvp", "fwd+jvp", False)] / times[("flash_jvp", "fwd+jvp", True)]
    assert out[True]["causal / non-causal TFLOP/s, fwd+jvp"] == pytest.approx(expected)
    assert math.isnan(out[False]["causal / non-causal TFLOP/s, fwd+jvp"])
