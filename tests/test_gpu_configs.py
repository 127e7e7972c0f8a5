"""Every launch configuration the launchers can pick is correct (tuned configs can race)."""

from __future__ import annotations

import pytest
import torch
from helpers import DTYPE_IDS, assert_matches_reference, force_candidate, qkv

import flash_jvp

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_IDS.get)
# 72: split tiles, 64 + 16 columns of which 8 are padding
@pytest.mark.parametrize("E", [64, 72, 128, 256])
@pytest.mark.parametrize("Lk", [333, 600])  # the short-key configs, and the others
@pytest.mark.parametrize("index", range(3))
def test_candidate_config(monkeypatch, dtype, E, Lk, index):
    force_candidate(monkeypatch, index)
    q, k, v, tangents, do = qkv(2, 3, 3, 300, Lk, E, dtype=dtype)
    for is_causal in (False, True):
        try:
            assert_matches_reference(
                flash_jvp.attention, q, k, v, tangents, do, is_causal=is_causal
            )
        except NotImplementedError as err:  # does not fit this GPU: the launcher says so
            assert "no launch configuration" in str(err)
