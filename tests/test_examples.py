"""examples/ (MeanFlow and sCM on the 8x8 digits): a few training steps of each through the
CPU fallback with math SDPA and flash_jvp, and their objectives against independent
finite-difference versions, so the examples cannot rot."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flash_jvp import api

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/

from examples import common, dit, meanflow, scm  # noqa: E402

needs_extra = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("sklearn", "matplotlib")),
    reason="the examples' data, judge and plots need scikit-learn and matplotlib "
    '(pip install -e ".[examples]")',
)


@pytest.fixture
def fallback(monkeypatch):
    """The plain-PyTorch path CPU tensors take without TRITON_INTERPRET (float64 works)."""
    monkeypatch.setattr(api, "uses_kernels", lambda device: False)


@needs_extra
@pytest.mark.parametrize("example", [meanflow, scm], ids=["meanflow", "scm"])
def test_example_trains_and_attentions_agree(fallback, example, tmp_path):
    """The command line end to end for 4 steps in float64: finite losses, flash_jvp's and
    math SDPA's per-step losses equal to rounding, every output written. (In the first steps
    adaLN-Zero's gates keep the attention's part tiny; the next test compares it live.)"""
    argv = ["--steps", "4", "--batch-size", "16", "--dtype", "float64", "--log-every", "0",
            "--samples-per-class", "10", "--evals", "1", "--out", str(tmp_path)]  # fmt: skip
    metrics = example.run(argv)
    runs = metrics["runs"]
    assert set(runs) == {"flash_jvp", "math"}
    for run in runs.values():
        assert len(run["losses"]) == 4 and all(math.isfinite(x) for x in run["losses"])
    np.testing.assert_allclose(runs["flash_jvp"]["losses"], runs["math"]["losses"], rtol=1e-10)
    assert metrics["agreement"]["max_rel_diff"] <= 1e-10
    # training moved the weights: the losses are not all equal
    assert len(set(runs["flash_jvp"]["losses"])) > 1
    for name in ("samples.png", "loss.png", "quality.png", "metrics.json"):
        assert (tmp_path / name).stat().st_size > 0
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert 0.0 <= saved["quality"]["flash_jvp 1-step"]["accuracy"] <= 1.0
    assert saved["quality"]["real test"]["accuracy"] > 0.9  # the judge knows the digits


def _model(num_times):
    torch.manual_seed(0)
    model = dit.DiT(8, 2, 1, 32, 2, 2, 16, num_classes=10, num_times=num_times,
                    time_scale=1.0, attention="flash_jvp").double()  # fmt: skip
    with torch.no_grad():  # adaLN-Zero starts at zero output: give every weight a value
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def _objective_and_grads(example, model, attention):
    """One batch of ``example``'s objective through ``attention``, and its gradients."""
    dit.set_attention(model, attention)
    gen = torch.Generator().manual_seed(1)
    x0 = torch.rand(6, 1, 8, 8, generator=gen, dtype=torch.float64) * 2 - 1
    y = torch.arange(6)
    extra = example.METHOD.make_extra("cpu", torch.float64)
    loss, _ = example.loss(model, x0, y, 50, 100, gen, extra=extra)
    loss = loss.mean()
    return loss, torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("example", [meanflow, scm], ids=["meanflow", "scm"])
def test_objective_through_flash_jvp_equals_math_sdpa(fallback, example):
    """With every weight live (adaLN-Zero's zero gates would hide the attention, as in the
    first steps of training), the objective and all gradients through flash_jvp equal those
    through math SDPA (float64), and the attention's weights get gradient."""
    model = _model(example.METHOD.num_times)
    loss, grads = _objective_and_grads(example, model, "flash_jvp")
    ref_loss, ref_grads = _objective_and_grads(example, model, "math")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-13)
    names = [n for n, _ in model.named_parameters()]
    qkv = grads[names.index("blocks.0.attn.qkv.weight")]
    assert qkv.abs().max() > 1e-4  # the attention takes part


def test_meanflow_objective_matches_finite_differences(fallback):
    """u_tgt = v - (t - r) du/dt with du/dt along (v, 0, 1), built by central differences."""
    model = _model(2)
    x, e = torch.randn(4, 1, 8, 8).double(), torch.randn(4, 1, 8, 8).double()
    t = torch.tensor([0.9, 0.7, 0.5, 0.3], dtype=torch.float64)
    r = torch.tensor([0.2, 0.7, 0.1, 0.0], dtype=torch.float64)
    y = torch.tensor([0, 3, 6, 9])
    objective, mse = meanflow.meanflow_loss(model, x, e, r, t, y)

    def u(z, r, t):
        return model(z, t, y, t2=t - r)

    tb = t.view(-1, 1, 1, 1)
    z, v, eps = (1 - tb) * x + tb * e, e - x, 1e-6
    dudt = (u(z + eps * v, r, t + eps) - u(z - eps * v, r, t - eps)) / (2 * eps)
    u_tgt = v - (t - r).view(-1, 1, 1, 1) * dudt
    sq = (u(z, r, t) - u_tgt).square().flatten(1).sum(1)
    torch.testing.assert_close(mse, sq / 64, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(objective, sq / (sq + meanflow.ADAPTIVE_C), rtol=1e-6, atol=1e-9)


def test_scm_objective_matches_finite_differences(fallback):
    """g of Lu & Song (2024) with cos(t) sin(t) dF/dt by central differences along the
    TrigFlow trajectory (dx_t/dt = cos(t) z - sin(t) x0)."""
    model = _model(1)
    x0 = 0.5 * torch.randn(3, 1, 8, 8).double()
    z = scm.SIGMA_D * torch.randn(3, 1, 8, 8).double()
    t = torch.tensor([0.2, 0.8, 1.4], dtype=torch.float64)
    y = torch.tensor([1, 2, 3])
    warmup = 0.7
    loss, g_norm = scm.scm_loss(model, x0, z, t, y, warmup)

    def F(s):  # F along the trajectory, as a function of time
        sb = s.view(-1, 1, 1, 1)
        return model((torch.cos(sb) * x0 + torch.sin(sb) * z) / scm.SIGMA_D, s, y)

    tb, eps = t.view(-1, 1, 1, 1), 1e-6
    dF_dt = (F(t + eps) - F(t - eps)) / (2 * eps)
    x_t, dxt_dt = torch.cos(tb) * x0 + torch.sin(tb) * z, torch.cos(tb) * z - torch.sin(tb) * x0
    g = -(torch.cos(tb) ** 2) * (scm.SIGMA_D * F(t) - dxt_dt) - warmup * torch.cos(tb) * torch.sin(
        tb
    ) * (x_t + scm.SIGMA_D * dF_dt)
    norm = g.flatten(1).norm(dim=1)
    torch.testing.assert_close(g_norm, norm, rtol=1e-6, atol=1e-9)
    expected = (g / (norm.view(-1, 1, 1, 1) + scm.TANGENT_C)).square().flatten(1).mean(1)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-9)  # F - F- is 0 in value


def test_samplers_give_images_of_the_data_shape(fallback):
    gen = torch.Generator().manual_seed(0)
    y = common.balanced_labels(2, "cpu")
    for example, num_times in ((meanflow, 2), (scm, 1)):
        for steps in (1, 2):
            x = example.sample(_model(num_times), y, steps, gen)
            assert x.shape == (20, 1, 8, 8) and torch.isfinite(x).all()


def test_frechet_distance_matches_the_matrix_square_root():
    scipy_linalg = pytest.importorskip("scipy.linalg")
    rng = np.random.default_rng(0)
    a = rng.normal(size=(400, 6))
    b = rng.normal(size=(400, 6)) @ rng.normal(size=(6, 6)) + 0.5
    ca, cb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root = scipy_linalg.sqrtm(ca @ cb).real
    expected = ((a.mean(0) - b.mean(0)) ** 2).sum() + np.trace(ca + cb - 2 * root)
    assert common.frechet_distance(a, b) == pytest.approx(expected, rel=1e-9)
    assert common.frechet_distance(a, a) == pytest.approx(0.0, abs=1e-9)


@needs_extra
def test_digits_split():
    x_tr, y_tr, x_te, y_te = common.load_digits("cpu", torch.float32)
    assert x_tr.shape == (1197, 1, 8, 8) and x_te.shape == (600, 1, 8, 8)
    assert x_tr.min() == -1 and x_tr.max() == 1
    assert torch.bincount(y_te).min() >= 58  # stratified: about 60 of each digit


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without CUDA")
def test_cuda_device_without_a_gpu_is_a_clear_error(capsys):
    """--device cuda without a GPU: argparse's error naming the option (was: torch's
    AssertionError traceback from the first tensor moved to CUDA)."""
    with pytest.raises(SystemExit) as exc:
        common.parse_args(["--device", "cuda"], "scm", "")
    assert exc.value.code == 2
    assert "--device cuda: this torch sees no CUDA GPU" in capsys.readouterr().err
