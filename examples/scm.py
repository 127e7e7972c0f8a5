"""sCM (continuous-time consistency training) on scikit-learn's 8x8 digits: a
class-conditional DiT in the TrigFlow parameterisation, sampled in 1 and 2 steps.

Lu & Song 2024, "Simplifying, Stabilizing and Scaling Continuous-Time Consistency Models"
(arXiv 2410.11081). TrigFlow: x_t = cos(t) x0 + sin(t) z, z ~ N(0, sigma_d^2 I), t in
[0, pi/2]; the consistency function f(x_t, t) = cos(t) x_t - sin(t) sigma_d F(x_t / sigma_d, t)
(c_noise(t) = t). Consistency training (no teacher) uses dx_t/dt = cos(t) z - sin(t) x0 and
the JVP of F along (x_t / sigma_d, t) with tangents (cos(t) sin(t) dx_t/dt / sigma_d,
cos(t) sin(t)), i.e. cos(t) sin(t) dF/dt in one ``torch.func.jvp`` (the paper's rearrangement
that keeps the tangent bounded). With F- = stop-gradient(F):

    g = -cos^2(t) (sigma_d F- - dx_t/dt) - r cos(t) sin(t) (x_t + sigma_d dF-/dt)
    g <- g / (||g|| + 0.1)                                   (tangent normalisation)
    loss = exp(-logvar(t)) / D ||F - F- - g||^2 + logvar(t)   (adaptive weighting)

r = min(1, step / warm-up steps) (tangent warm-up; here 10 % of training). logvar(t) is a
learned linear function of Fourier features of t (the paper's adaptive weighting network w_phi
with w = -logvar). Training times: tan(t) = exp(tau) / sigma_d, tau ~ N(-1.0, 1.4^2) (the
paper's CIFAR-10 values); sigma_d = 0.5. 1-step sampling: x0 = f(z, pi/2); 2-step: noise
again to t = 1.1 and apply f once more (the paper's mid time).

    python -m examples.scm                              # CPU, ~4 min with both attentions
    python -m examples.scm --device cuda                # full size on a GPU

Outputs (``--out``, default ``examples/out/scm``): samples.png, loss.png, quality.png,
metrics.json.
"""

from __future__ import annotations

import math
import sys

import torch
from torch import nn

from .common import IMAGE_SHAPE, Method, main
from .dit import wide

SIGMA_D = 0.5
P_MEAN, P_STD = -1.0, 1.4
TANGENT_C = 0.1  # tangent normalisation constant
WARMUP_FRACTION = 0.1  # tangent warm-up over this fraction of training
T_MID = 1.1  # 2-step sampling's intermediate time


def sample_times(n: int, gen, device, dtype) -> torch.Tensor:
    """t = arctan(exp(tau) / sigma_d), tau ~ N(P_MEAN, P_STD^2): (n,) in (0, pi/2)."""
    tau = P_MEAN + P_STD * torch.randn(n, generator=gen, device=device, dtype=torch.float64)
    return torch.atan(tau.exp() / SIGMA_D).to(dtype)


class LogVar(nn.Module):
    """logvar(t) = Linear(Fourier features of t): the adaptive weighting's learned per-time
    log-variance (starts at 0, i.e. weight 1)."""

    def __init__(self, n_freqs: int = 64):
        super().__init__()
        self.register_buffer("freqs", torch.randn(n_freqs), persistent=False)
        self.register_buffer("phases", torch.rand(n_freqs), persistent=False)
        self.linear = nn.Linear(n_freqs, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        feats = torch.cos(2 * math.pi * (t[:, None] * self.freqs + self.phases)) * math.sqrt(2)
        return self.linear(feats.to(self.linear.weight.dtype))[:, 0]


def scm_loss(model, x0, z, t, y, warmup: float = 1.0, logvar=None):
    """The sCM consistency-training objective per sample (B,), and ||g|| before normalisation.

    x0: data (B, C, H, W); z: noise ~ N(0, sigma_d^2) like x0; t: (B,) in (0, pi/2); y: (B,)
    labels or None; warmup: the tangent warm-up factor r in [0, 1]; logvar: a module t ->
    (B,) log-variance, or None for weight 1. The model is F: ``model(x_t / sigma_d, t, y)``.
    """
    bshape = (-1,) + (1,) * (x0.dim() - 1)
    cos_t, sin_t = torch.cos(t).view(bshape), torch.sin(t).view(bshape)
    x_t = cos_t * x0 + sin_t * z
    dxt_dt = cos_t * z - sin_t * x0
    cs = (torch.cos(t) * torch.sin(t)).to(t.dtype)

    def F_fn(x, t):
        return model(x, t, y)

    F, dF = torch.func.jvp(
        F_fn, (x_t / SIGMA_D, t), (cs.view(bshape) * dxt_dt / SIGMA_D, cs)
    )  # dF = cos(t) sin(t) dF/dt
    F, F_minus, dF = wide(F), wide(F).detach(), wide(dF).detach()
    g = -(cos_t**2) * (SIGMA_D * F_minus - dxt_dt) - warmup * (cs.view(bshape) * x_t + SIGMA_D * dF)
    g_norm = g.flatten(1).norm(dim=1)
    g = g / (g_norm.view(bshape) + TANGENT_C)
    sq = (F - F_minus - g).square().flatten(1).mean(1)
    if logvar is None:
        return sq, g_norm
    lv = wide(logvar(t))
    return torch.exp(-lv) * sq + lv, g_norm


def loss(model, x0, y, step, total_steps, gen, extra=None):
    """Noise and times for this batch from ``gen``, then :func:`scm_loss`."""
    z = SIGMA_D * torch.randn(x0.shape, generator=gen, device=x0.device, dtype=x0.dtype)
    t = sample_times(len(x0), gen, x0.device, x0.dtype)
    warmup = min(1.0, step / max(1.0, WARMUP_FRACTION * total_steps))
    objective, g_norm = scm_loss(model, x0, z, t, y, warmup, logvar=extra)
    return objective, {"g_norm": g_norm.mean().item(), "warmup": warmup}


def consistency_fn(model, x_t, t, y):
    """f(x_t, t) = cos(t) x_t - sin(t) sigma_d F(x_t / sigma_d, t)."""
    dtype = x_t.dtype
    tt = torch.full((len(x_t),), t, device=x_t.device, dtype=dtype)
    F = model(x_t / SIGMA_D, tt, y).to(dtype)
    return math.cos(t) * x_t - math.sin(t) * SIGMA_D * F


def sample(model, y, steps: int, gen) -> torch.Tensor:
    """1 step: f(z, pi/2); 2 steps: then x_mid = cos(T_MID) x0 + sin(T_MID) z', f(x_mid, T_MID)."""
    dtype = next(model.parameters()).dtype

    def noise():
        shape = (len(y), *IMAGE_SHAPE)
        return SIGMA_D * torch.randn(shape, generator=gen, device=y.device, dtype=dtype)

    x0 = consistency_fn(model, noise(), math.pi / 2, y)
    for t in (T_MID,) * (steps - 1):
        x0 = consistency_fn(model, math.cos(t) * x0 + math.sin(t) * noise(), t, y)
    return x0


METHOD = Method(
    name="scm",
    num_times=1,
    # features of t itself (frequencies <= 1 rad per unit t): with 100 t, 1-step samples of
    # the CPU preset stayed unrecognisable (classifier accuracy 0.10 after 1000 steps) where
    # t gave 0.72 (Lu & Song 2024 trace instabilities to time embeddings that turn fast)
    time_scale=1.0,
    loss=loss,
    sample=sample,
    make_extra=lambda device, dtype: LogVar().to(device, dtype),
    notes={
        "paper": "Lu & Song 2024, arXiv 2410.11081",
        "parameterisation": f"TrigFlow, sigma_d = {SIGMA_D}, c_noise(t) = t",
        "time_embedding": "DiT's sinusoidal features of t (scale 1)",
        "time_sampler": f"tan(t) = exp(tau) / sigma_d, tau ~ N({P_MEAN}, {P_STD}^2)",
        "tangent": f"normalised g / (||g|| + {TANGENT_C}); warm-up over {WARMUP_FRACTION:.0%}",
        "adaptive_weight": "learned logvar(t), linear in 64 Fourier features of t",
        "two_step_mid_time": T_MID,
        "logged": "objective incl. logvar; g_norm = ||g|| before normalisation",
    },
)


def run(argv=None) -> dict:
    return main(METHOD, argv, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    run(sys.argv[1:])
