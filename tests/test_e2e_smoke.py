"""benchmarks/e2e.py on tiny models on the CPU, so the benchmark cannot rot: its JVP steps
through flash_jvp give the plain-op path's loss and gradients, the DiT's tangent along t is
right, and its bookkeeping (row order, fall-back rows, targets, attention rule) holds; and
benchmarks/host_time.py's CPU proxy runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import DEVICE, needs_kernels

from flash_jvp import api

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, examples/

from benchmarks import e2e  # noqa: E402
from examples import dit  # noqa: E402


@pytest.fixture
def fallback(monkeypatch):
    """The plain-PyTorch path CPU tensors take without TRITON_INTERPRET, in float64."""
    monkeypatch.setattr(api, "uses_kernels", lambda device: False)


@pytest.mark.parametrize("name", ["dit256", "lm4k"])
def test_jvp_step_flash_jvp_equals_plain_fallback(fallback, name):
    out = e2e.smoke_compare(e2e.SMOKE_SPECS[name], torch.float64)
    assert out["flash_jvp"]["max_rel_diff"] <= 1e-12, out
    assert out["math"]["max_rel_diff"] <= 1e-12, out
    assert torch.isfinite(torch.tensor([out["plain_loss"], out["floor_loss"]])).all()


@needs_kernels
@pytest.mark.parametrize("name", ["dit256", "lm4k"])
def test_jvp_step_flash_jvp_kernels_equal_plain(name):
    """The Triton kernels (the interpreter on CPU) inside the whole step, float32."""
    out = e2e.smoke_compare(e2e.SMOKE_SPECS[name], torch.float32, device=DEVICE)
    assert out["flash_jvp"]["max_rel_diff"] <= 2e-5, out


def _scm_without_tangent(model, inp):
    """The sCM loss with the tangent warm-up factor at 0: dF/dt drops out of the target."""
    from examples import scm

    return scm.scm_loss(model, inp["x0"], inp["z"], inp["t"], inp["y"], warmup=0.0)[0].mean()


@pytest.mark.parametrize("name", ["dit256", "lm4k"])
def test_jvp_step_depends_on_tangent(fallback, name):
    """The step's gradients change when the tangent's part is dropped: the JVP takes part
    (a silently zero tangent would leave them equal)."""
    spec = e2e.SMOKE_SPECS[name]
    torch.manual_seed(0)
    model = e2e.build(spec, "flash_jvp", "cpu", torch.float64)
    e2e._perturb(model)
    inp = e2e.make_inputs(spec, "cpu", torch.float64)
    _, grads = e2e.step_fn(model, inp, jvp=True)()
    if spec.kind == "lm":
        zero_t = {**inp, "emb_t": torch.zeros_like(inp["emb_t"])}
        _, without = e2e.step_fn(model, zero_t, jvp=True)()
    else:
        _, without = e2e.step_fn(model, inp, True, loss_fn=_scm_without_tangent)()
    assert max((a - b).abs().max().item() for a, b in zip(grads, without)) > 1e-6


@pytest.mark.parametrize("attention", ["flash_jvp", "plain"])
def test_dit_jvp_along_x_and_t_matches_finite_differences(fallback, attention):
    """torch.func.jvp through the DiT, tangents on x and t (and MeanFlow's second time),
    against central differences in float64: a silently zero tangent on t cannot pass."""
    torch.manual_seed(0)
    model = dit.DiT(8, 2, 1, 32, 2, 2, 16, num_classes=10, num_times=2, time_scale=3.0,
                    attention=attention).double()  # fmt: skip
    e2e._perturb(model)
    x, x_t = torch.randn(3, 1, 8, 8, dtype=torch.float64), torch.randn(3, 1, 8, 8).double()
    t, t_t = torch.rand(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    h, h_t = torch.rand(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    y = torch.tensor([1, 5, 7])

    def f(x, t, h):
        return model(x, t, y, t2=h)

    _, out_t = torch.func.jvp(f, (x, t, h), (x_t, t_t, h_t))
    eps = 1e-6
    fd = (f(x + eps * x_t, t + eps * t_t, h + eps * h_t)
          - f(x - eps * x_t, t - eps * t_t, h - eps * h_t)) / (2 * eps)  # fmt: skip
    _, only_t = torch.func.jvp(f, (x, t, h), (torch.zeros_like(x), t_t, torch.zeros_like(h)))
    assert only_t.abs().max() > 1e-3  # the time tangent alone moves the output
    torch.testing.assert_close(out_t, fd, rtol=1e-6, atol=1e-7)


def test_attention_rule():
    """Kernels by name wherever launched; other kernels by their launching op's chain; the
    cross-entropy's log-softmax and the linear layers' GEMMs are not attention."""
    from torch.autograd import DeviceType

    def op(name, parent=None, kernels=()):
        kernels = [SimpleNamespace(name=n, duration=d) for n, d in kernels]
        return SimpleNamespace(name=name, cpu_parent=parent, kernels=kernels,
                               device_type=DeviceType.CPU)  # fmt: skip

    def kernel(name, us):
        return SimpleNamespace(name=name, device_time_total=us, device_type=DeviceType.CUDA)

    matmul = op("aten::matmul")
    softmax = op("aten::softmax")
    events = [
        kernel("attn_fwd_kernel", 1.0),  # ours, launched outside any op
        kernel("attn_bwd_dq_kernel", 2.0),
        kernel("pytorch_flash::flash_fwd_kernel<...>", 4.0),
        kernel("sm90_xmma_gemm_bf16", 999.0),  # counted through its op below, not here
        matmul,
        op("aten::bmm", matmul, [("sm90_xmma_gemm_bf16", 8.0)]),
        softmax,
        op("aten::_softmax", softmax, [("cunn_SoftMaxForward", 16.0)]),
        op("aten::mul", op("aten::_softmax", softmax), [("elementwise_kernel", 32.0)]),
        op("aten::mm", op("BmmBackward0"), [("gemm", 64.0)]),
        op("aten::_to_copy", softmax, [("cast_kernel", 128.0)]),
        op("aten::addmm", op("aten::linear"), [("sm90_xmma_gemm_bf16", 1000.0)]),
        op("aten::_log_softmax", op("aten::cross_entropy_loss"), [("cunn_SoftMaxForward", 2000.0)]),
        op("aten::mul", op("aten::gelu"), [("elementwise_kernel", 4000.0)]),
    ]
    assert e2e.attention_us(events) == 255.0
    assert e2e.attention_us(events, by_op=False) == 7.0


def _args(**kw):
    return e2e.parse_args([f"--{k}={v}" for k, v in kw.items()])


def test_plan_runs_compile_rows_last_and_fallback_after_full_depth():
    args = _args(rows="dit256,lm4k")
    todo = e2e.plan(args)
    runners = [m.runner for _, m, _ in todo]
    assert all(r == "compile" for r in runners[runners.index("compile") :])
    assert runners.count("compile") == 4  # two per model
    # dit256's plain step ran out of memory: its fall-back rows come after dit256's
    # remaining full-depth rows and before lm4k's
    spec = e2e.SPECS["dit256"]
    done, todo = todo[:3], todo[3:]  # flash_jvp, flash_jvp graph, plain
    rows = [e2e.Row("dit256", "", m.name, spec.depth, 64, 256) for _, m, _ in done]
    e2e._add_fallback(todo, rows, spec, args.methods)
    order = [(s.name, m.name, d) for s, m, d in todo]
    first_lm = next(i for i, o in enumerate(order) if o[0] == "lm4k")
    fb = [i for i, o in enumerate(order) if o[2] == spec.fallback_depth]
    assert fb and max(fb) < first_lm and min(fb) > order.index(("dit256", "sdpa no-JVP", 28))
    assert {order[i][1] for i in fb} == {
        "flash_jvp",
        "plain",
        "flash_jvp graph",
        "plain graph",
        "sdpa no-JVP",
    }


def test_ratios_and_report(tmp_path):
    def row(model, method, depth, ms, peak, tokens, status="ok"):
        return e2e.Row(model, model, method, depth, 1, tokens, status, ms, [ms], peak)

    rows = [
        row("dit256", "plain graph", 28, 130.0, 45.0, 256),
        row("dit256", "flash_jvp graph", 28, 100.0, 27.0, 256),
        row("dit256", "sdpa no-JVP", 28, 60.0, 20.0, 256),
        row("dit1024", "plain", 28, None, None, 1024, "OOM"),
        row("dit1024", "flash_jvp", 28, 160.0, 28.0, 1024),
        row("dit1024", "plain", 12, 281.0, 103.0, 1024),
        row("dit1024", "flash_jvp", 12, 70.0, 12.0, 1024),
    ]
    targets = {(t["model"], t["depth"]): t for t in e2e.ratios(rows)}
    t256 = targets[("dit256", 28)]
    assert t256["plain / flash_jvp (graphs)"] == pytest.approx(1.3)
    assert t256["flash_jvp graph / no-JVP eager"] == pytest.approx(100 / 60)
    assert t256["met"] is True
    assert targets[("dit1024", 28)]["met"] is None
    assert "out of memory" in targets[("dit1024", 28)]["note"]
    t1024 = targets[("dit1024", 12)]
    assert t1024["plain / flash_jvp (eager)"] == pytest.approx(281 / 70)
    assert t1024["peak flash_jvp / plain"] == pytest.approx(12 / 103)
    assert t1024["met"] is True
    text = e2e.markdown({"date": "d"}, rows, e2e.ratios(rows))
    assert "| DiT" not in text and "| dit1024 | plain | 28 |" in text and "OOM" in text


def test_smoke_command(fallback, capsys):
    assert e2e.main(["--smoke"]) == 0
    assert "largest relative difference" in capsys.readouterr().out


def test_bad_rows_are_refused():
    with pytest.raises(SystemExit):
        e2e.parse_args(["--rows", "dit256,nope"])


def test_host_time_stub_runs():
    """benchmarks/host_time.py --stub (the CPU proxy; its own process: it sets
    TRITON_INTERPRET and replaces the launchers) yields a finite time and its garbage
    collection counts for every row."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "benchmarks" / "host_time.py"), "--child", "--stub",
           "--calls", "2", "--repeats", "1", "--profile=flash_jvp fwd+bwd"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stderr[-2000:]
    result = json.loads(lines[0][len("RESULT ") :])
    rows = result["host_us"]
    # --profile: the fwd+bwd row's profile sees our backward (run on the calling thread)
    assert (
        "_bwd" in result["profiles"]["flash_jvp fwd+bwd"]
        or "backward" in result["profiles"]["flash_jvp fwd+bwd"]
    ), result["profiles"]
    wanted = {"flash_jvp fwd", "flash_jvp fwd+JVP (torch.func.jvp)",
              "flash_jvp sCM step (jvp + backward)",
              "torch.func.jvp of addcmul(q, k, v) (3-input floor)"}  # fmt: skip
    assert wanted <= set(rows), rows
    assert all(0 < us < float("inf") for us in rows.values()), rows
    gcs = result["gc_per_call"]  # collections by generation, per timed call
    assert set(gcs) == set(rows) and all(len(g) == 3 and min(g) >= 0 for g in gcs.values()), gcs
