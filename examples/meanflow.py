"""MeanFlow on scikit-learn's 8x8 digits: a class-conditional DiT trained to predict the
average velocity, sampled in 1 and 2 steps.

MeanFlow (Geng, Deng, Bai, Kolter, He 2025, "Mean Flows for One-step Generative Modeling",
arXiv 2505.13447): with z_t = (1 - t) x + t e (t = 0 data, t = 1 noise) and v = e - x, the
average velocity u(z_t, r, t) = 1/(t - r) * integral_r^t v(z_s, s) ds satisfies the MeanFlow
identity u = v - (t - r) du/dt, where du/dt = v . d_z u + d_t u is the JVP of u along
(dz/dt, dr/dt, dt/dt) = (v, 0, 1). Training regresses u_theta on the stop-gradient target
u_tgt = v - (t - r) * du_theta/dt with the paper's adaptive weight w = 1 / (||delta||^2 + c)^p
(p = 1, c = 1e-3). (r, t): two logit-normal(-0.4, 1) draws, t the larger; r = t for 75 % of the
batch (the paper's 25 % r != t). The DiT is conditioned on (t, t - r) (the paper's best
choice). 1-step sampling: x = e - u(e, 0, 1); 2-step: through t = 0.5. No classifier-free
guidance here (labels always given).

    python -m examples.meanflow                         # CPU, ~4 min with both attentions
    python -m examples.meanflow --device cuda           # full size on a GPU

Outputs (``--out``, default ``examples/out/meanflow``): samples.png, loss.png, quality.png,
metrics.json.
"""

from __future__ import annotations

import sys

import torch

from .common import IMAGE_SHAPE, Method, main
from .dit import wide

P_MEAN, P_STD = -0.4, 1.0  # logit-normal time sampler
R_NEQ_T = 0.25  # fraction of the batch with r != t
ADAPTIVE_P, ADAPTIVE_C = 1.0, 1e-3


def sample_times(n: int, gen, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, t), each (n,): two logit-normal draws sorted so r <= t; then r = t for a random
    1 - R_NEQ_T of the batch."""
    draws = torch.sigmoid(P_MEAN + P_STD * torch.randn(2, n, generator=gen, device=device))
    t, r = draws.max(0).values, draws.min(0).values
    same = torch.rand(n, generator=gen, device=device) >= R_NEQ_T
    r = torch.where(same, t, r)
    return r.to(dtype), t.to(dtype)


def meanflow_loss(model, x, e, r, t, y, p=ADAPTIVE_P, c=ADAPTIVE_C):
    """The MeanFlow objective for one batch, per sample (B,), and the unweighted squared error.

    x: data (B, C, H, W); e: noise like x; r, t: (B,) with r <= t; y: (B,) labels. u is
    ``model(z, t, y, t2=t - r)``; its JVP along (z, r, t) with tangents (v, 0, 1) gives
    du/dt. The target is detached; the weight w = 1 / (||u - u_tgt||^2 + c)^p is detached too.
    """
    bshape = (-1,) + (1,) * (x.dim() - 1)
    z = (1 - t.view(bshape)) * x + t.view(bshape) * e
    v = e - x

    def u_fn(z, r, t):
        return model(z, t, y, t2=t - r)

    u, dudt = torch.func.jvp(u_fn, (z, r, t), (v, torch.zeros_like(r), torch.ones_like(t)))
    u_tgt = (v - (t - r).view(bshape) * dudt).detach()
    sq = (wide(u) - wide(u_tgt)).square().flatten(1).sum(1)
    w = (sq.detach() + c).pow(-p)
    return w * sq, sq / x[0].numel()


def loss(model, x0, y, step, total_steps, gen, extra=None):
    """Noise and times for this batch from ``gen``, then :func:`meanflow_loss`."""
    e = torch.randn(x0.shape, generator=gen, device=x0.device, dtype=x0.dtype)
    r, t = sample_times(len(x0), gen, x0.device, x0.dtype)
    objective, mse = meanflow_loss(model, x0, e, r, t, y)
    return objective, {"mse": mse.mean().item()}


def sample(model, y, steps: int, gen) -> torch.Tensor:
    """``steps`` equal steps of z_r = z_t - (t - r) u(z_t, r, t) from noise at t = 1 to 0."""
    dtype = next(model.parameters()).dtype
    z = torch.randn(len(y), *IMAGE_SHAPE, generator=gen, device=y.device, dtype=dtype)
    times = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()
    for t_now, t_next in zip(times[:-1], times[1:]):
        t = torch.full((len(y),), t_now, device=y.device, dtype=dtype)
        r = torch.full_like(t, t_next)
        z = z - (t_now - t_next) * model(z, t, y, t2=t - r).to(dtype)
    return z


METHOD = Method(
    name="meanflow",
    num_times=2,
    time_scale=100.0,
    loss=loss,
    sample=sample,
    curve="mse",  # the objective is ~1 throughout: w * ||delta||^2 with w = 1 / (||delta||^2 + c)
    notes={
        "paper": "Geng et al. 2025, arXiv 2505.13447",
        "time_sampler": f"logit-normal({P_MEAN}, {P_STD}), r != t for {R_NEQ_T:.0%}",
        "conditioning": "(t, t - r)",
        "time_embedding": "DiT's sinusoidal features of 100 t and 100 (t - r)",
        "adaptive_weight": f"1 / (||delta||^2 + {ADAPTIVE_C})^{ADAPTIVE_P}",
        "logged_mse": "mean squared error ||u - u_tgt||^2 / D, unweighted",
        "cfg": "none",
    },
)


def run(argv=None) -> dict:
    return main(METHOD, argv, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    run(sys.argv[1:])
