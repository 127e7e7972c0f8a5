"""What both examples share: the digits data, presets, the training loop, sample quality
(a classifier trained on the real digits), plots and the command line.

An example supplies a :class:`Method`: how to build its DiT, its loss for one batch, and its
1- and 2-step samplers. :func:`main` trains it once per attention kind with the same seed
(same init, same batches, same noise), so the loss curves of flash_jvp and math SDPA can be
compared step by step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from .dit import DiT

Tensor = torch.Tensor
NUM_CLASSES = 10
IMAGE_SHAPE = (1, 8, 8)


@dataclass(frozen=True)
class Preset:
    """Model and training sizes. ``cpu`` trains in a few minutes on two cores; ``cuda`` is
    the full-size setting for one GPU (about a minute per attention kind on an H200)."""

    patch_size: int
    dim: int
    depth: int
    heads: int
    head_dim: int
    batch_size: int
    steps: int
    lr: float
    ema: float  # EMA decay of the weights used for sampling
    warmup: int  # learning-rate warm-up steps
    evals: int = 8  # sample-quality evaluations during training (FD curve)


PRESETS = {
    # 16 tokens of 2x2 pixels; ~80 ms/step on one CPU core (~2 min per attention kind)
    "cpu": Preset(2, 64, 4, 4, 16, 64, 1500, 1e-3, 0.995, 100),
    # 64 tokens of one pixel; host-bound on a GPU (est. 30-40 ms/step eager: ~1 min per kind)
    "cuda": Preset(1, 256, 6, 4, 64, 256, 1600, 1e-3, 0.998, 100),
}


@dataclass
class Method:
    """One training objective: the example's name, how many time inputs its DiT embeds, its
    time-embedding scale, ``loss(model, x0, y, step, total_steps, gen) -> (loss (B,), stats)``
    (per-sample objective and a dict of logged scalars), and ``sample(model, y, steps, gen)``
    for 1 or 2 steps. ``extra_params(model)`` may return modules trained beside the model
    (sCM's adaptive weighting). ``curve`` names what loss.png plots."""

    name: str
    num_times: int
    time_scale: float
    loss: Callable
    sample: Callable
    make_extra: Callable[[torch.device, torch.dtype], torch.nn.Module | None] = lambda d, t: None
    curve: str = "loss"  # what loss.png plots: "loss" (the objective) or a logged scalar
    notes: dict = field(default_factory=dict)


def load_digits(device, dtype, test_size: int = 600):
    """scikit-learn's bundled 8x8 digits (1797 images, no download) in [-1, 1], split into a
    training set (used by the generative model and the classifier) and a held-out test set,
    stratified by label. Returns (x_train, y_train, x_test, y_test) as tensors."""
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    digits = sk_load_digits()
    x = digits.images.astype(np.float64) / 16.0 * 2.0 - 1.0
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, digits.target, test_size=test_size, stratify=digits.target, random_state=0
    )

    def tensor(a, dt):
        return torch.as_tensor(a, device=device, dtype=dt)

    return (
        tensor(x_tr, dtype)[:, None],
        tensor(y_tr, torch.int64),
        tensor(x_te, dtype)[:, None],
        tensor(y_te, torch.int64),
    )


class Judge:
    """A classifier of the real digits (scikit-learn MLP, one hidden layer of 64 ReLUs)
    that scores generated samples: accuracy (predicted label == the label the sample was
    generated for), mean confidence (probability of the top class) and the Fréchet distance
    between the hidden-layer features of real and generated images (FID's formula, in this
    classifier's feature space)."""

    def __init__(self, x_train: Tensor, y_train: Tensor, seed: int = 0):
        from sklearn.neural_network import MLPClassifier

        self.clf = MLPClassifier((64,), max_iter=600, random_state=seed)
        self.clf.fit(_flat(x_train), y_train.cpu().numpy())

    def features(self, x: Tensor) -> np.ndarray:
        h = _flat(x) @ self.clf.coefs_[0] + self.clf.intercepts_[0]
        return np.maximum(h, 0.0)

    def scores(self, x: Tensor, y: Tensor, reference: Tensor) -> dict:
        """Accuracy and confidence on x (labels y), and the Fréchet distance of x's features
        to ``reference``'s."""
        proba = self.clf.predict_proba(_flat(x))
        labels = y.cpu().numpy()
        return {
            "accuracy": float((proba.argmax(1) == labels).mean()),
            "confidence": float(proba.max(1).mean()),
            "fd": frechet_distance(self.features(x), self.features(reference)),
        }


def _flat(x: Tensor) -> np.ndarray:
    """(N, 1, 8, 8) in [-1, 1] (clamped: generated samples may overshoot) -> (N, 64)."""
    return x.detach().clamp(-1, 1).reshape(len(x), -1).cpu().double().numpy()


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)) of two feature sets (N, D)
    (Heusel et al. 2017, the FID formula). Tr((S_a S_b)^(1/2)) is taken as the sum of the
    square roots of the eigenvalues of S_a^(1/2) S_b S_a^(1/2), a symmetric PSD matrix, which
    stays exact where features are constant (ReLUs that never fire make S singular)."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root_a = _psd_sqrt(cov_a)
    cross = np.linalg.eigvalsh(root_a @ cov_b @ root_a).clip(min=0.0)
    return float(
        ((mu_a - mu_b) ** 2).sum() + np.trace(cov_a) + np.trace(cov_b) - 2.0 * np.sqrt(cross).sum()
    )


def _psd_sqrt(m: np.ndarray) -> np.ndarray:
    w, u = np.linalg.eigh(m)
    return (u * np.sqrt(w.clip(min=0.0))) @ u.T


def balanced_labels(n_per_class: int, device) -> Tensor:
    return torch.arange(NUM_CLASSES, device=device).repeat_interleave(n_per_class)


def autocast(device: torch.device):
    """bf16 autocast on CUDA (fp32 weights); nothing on the CPU, where the dtype is explicit."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass
class Run:
    attention: str
    losses: list[float]
    stats: dict[str, list[float]]
    evals: list[dict]
    seconds: float  # training, evaluations excluded
    eval_seconds: float
    model: torch.nn.Module  # EMA weights


def train(method: Method, preset: Preset, attention: str, data, judge, args) -> Run:
    """Train ``method``'s DiT for ``preset.steps`` steps through ``attention``. Everything
    random (init, batches, noise, times) comes from ``args.seed``, so two attention kinds see
    the same run. Returns the per-step losses, logged scalars, FD evaluations and the EMA
    model."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(args.seed)
    model = make_model(method, preset, attention).to(device, dtype)
    extra = method.make_extra(device, dtype)
    params = [*model.parameters(), *(extra.parameters() if extra is not None else ())]
    opt = torch.optim.Adam(params, lr=preset.lr, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / preset.warmup))
    ema = copy.deepcopy(model).requires_grad_(False)
    gen = torch.Generator(device).manual_seed(args.seed)
    eval_gen = torch.Generator(device)
    eval_at = set(np.linspace(0, preset.steps, preset.evals + 1).round().astype(int)[1:].tolist())
    losses, stats, evals, eval_seconds = [], {}, [], 0.0
    start = time.perf_counter()
    for step in range(preset.steps):
        idx = torch.randint(len(x_train), (preset.batch_size,), generator=gen, device=device)
        with autocast(device):
            loss, logged = method.loss(
                model, x_train[idx], y_train[idx], step, preset.steps, gen, extra=extra
            )
            loss = loss.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            decay = min(preset.ema, (1 + step) / (10 + step))
            for p_ema, p in zip(ema.parameters(), model.parameters()):
                p_ema.lerp_(p, 1 - decay)
        losses.append(loss.item())
        for key, value in logged.items():
            stats.setdefault(key, []).append(float(value))
        if step + 1 in eval_at:
            t0 = time.perf_counter()
            eval_gen.manual_seed(args.seed + 1)  # the same noise at every evaluation
            evals.append({"step": step + 1, **evaluate(method, ema, judge, x_test, 20, eval_gen)})
            eval_seconds += time.perf_counter() - t0
        if args.log_every and (step + 1) % args.log_every == 0:
            logged = " ".join(f"{k} {v[-1]:.4g}" for k, v in stats.items())
            print(
                f"  {method.name} {attention} {step + 1}/{preset.steps}: loss {loss:.4g} {logged}"
            )
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"{method.name} {attention}: loss {losses[-1]} at {step}")
    seconds = time.perf_counter() - start - eval_seconds
    return Run(attention, losses, stats, evals, seconds, eval_seconds, ema)


def make_model(method: Method, preset: Preset, attention: str) -> DiT:
    return DiT(
        input_size=IMAGE_SHAPE[1:],
        patch_size=preset.patch_size,
        in_channels=IMAGE_SHAPE[0],
        dim=preset.dim,
        depth=preset.depth,
        heads=preset.heads,
        head_dim=preset.head_dim,
        num_classes=NUM_CLASSES,
        num_times=method.num_times,
        time_scale=method.time_scale,
        attention=attention,
    )


@torch.no_grad()
def evaluate(method: Method, model, judge: Judge, x_test: Tensor, n_per_class: int, gen) -> dict:
    """1- and 2-step samples (n_per_class per digit) scored by ``judge`` against x_test."""
    y = balanced_labels(n_per_class, x_test.device)
    out = {}
    for steps in (1, 2):
        with autocast(x_test.device):
            x = method.sample(model, y, steps, gen).float()
        out.update({f"{k}_{steps}step": v for k, v in judge.scores(x, y, x_test).items()})
    return out


def _curve(run: Run, key: str) -> list[float]:
    return run.losses if key == "loss" else run.stats[key]


def _pyplot():
    """matplotlib.pyplot on the file-only Agg backend (these scripts only write PNGs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_losses(runs: list[Run], path: str, title: str, key: str = "loss") -> None:
    """The training curve ``key`` of each run, their absolute difference per step, and the
    Fréchet distance of 1- and 2-step samples during training."""
    plt = _pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for i, run in enumerate(runs):  # the second run dashed, over the first
        style = {"ls": "--" if i else "-", "alpha": 0.8}
        curve = _curve(run, key)
        steps = np.arange(1, len(curve) + 1)
        axes[0].plot(steps, curve, lw=0.6, label=f"{run.attention}", **style)
        evals = [e["step"] for e in run.evals]
        for n, marker in ((1, "o"), (2, "s")):
            fds = [e[f"fd_{n}step"] for e in run.evals]
            axes[2].plot(evals, fds, marker=marker, ms=4 if i else 8, mfc="none" if i else None,
                         label=f"{run.attention}, {n}-step", **style)  # fmt: skip
    ylabel = "training objective" if key == "loss" else key
    axes[0].set(
        xlabel="step", ylabel=ylabel, title=title, yscale="linear" if key == "loss" else "log"
    )
    axes[0].legend()
    if len(runs) == 2:
        diff = np.abs(np.subtract(_curve(runs[0], key), _curve(runs[1], key)))
        if diff.max() > 0:
            axes[1].semilogy(np.arange(1, len(diff) + 1), np.maximum(diff, 1e-17), lw=0.6)
        else:
            axes[1].text(0.5, 0.5, f"identical at all {len(diff)} steps", ha="center",
                         transform=axes[1].transAxes)  # fmt: skip
            axes[1].set(xticks=[], yticks=[])
        axes[1].set(xlabel="step", title=f"|{key}, {runs[0].attention} - {runs[1].attention}|")
    else:
        axes[1].axis("off")
    axes[2].set(
        xlabel="step",
        ylabel="Fréchet distance (classifier features)",
        yscale="log",
        title="sample quality during training (EMA weights)",
    )
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_samples(images: dict[str, Tensor], path: str) -> None:
    """One 10 x 10 grid per entry (row = digit)."""
    plt = _pyplot()

    fig, axes = plt.subplots(1, len(images), figsize=(4 * len(images), 4.3))
    for ax, (name, x) in zip(np.atleast_1d(axes), images.items()):
        grid = x[:, 0].clamp(-1, 1).reshape(NUM_CLASSES, -1, 8, 8)[:, :10].float().cpu()
        grid = grid.permute(0, 2, 1, 3).reshape(NUM_CLASSES * 8, -1)
        ax.imshow(grid.numpy(), cmap="gray_r", vmin=-1, vmax=1)
        ax.set_title(name)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_quality(quality: dict[str, dict], path: str) -> None:
    plt = _pyplot()

    names = list(quality)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, key, label in (
        (axes[0], "accuracy", "classifier accuracy (label it was generated for)"),
        (axes[1], "confidence", "mean top-class probability"),
        (axes[2], "fd", "Fréchet distance to real test digits"),
    ):
        values = [quality[n][key] for n in names]
        bars = ax.bar(range(len(names)), values, color=["0.6"] + ["C0"] * (len(names) - 1))
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(runs: list[Run], key: str = "loss") -> dict:
    """How closely two runs' per-step objectives (and the plotted curve ``key``) agree."""
    if len(runs) != 2:
        return {}
    out = {"pair": [runs[0].attention, runs[1].attention]}
    for name in dict.fromkeys(("loss", key)):
        a, b = np.array(_curve(runs[0], name)), np.array(_curve(runs[1], name))
        diff = np.abs(a - b)
        rel = diff / np.maximum(np.abs(b), 1e-30)
        first = min(10, len(a))
        prefix = "" if name == "loss" else f"{name}_"
        out.update({
            f"{prefix}max_abs_diff": float(diff.max()),
            f"{prefix}max_rel_diff": float(rel.max()),
            f"{prefix}max_rel_diff_first_{first}_steps": float(rel[:first].max()),
            f"{prefix}final": [float(a[-1]), float(b[-1])],
        })  # fmt: skip
    return out


def parse_args(argv, name: str, description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m examples.{name}", description=description)
    p.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model size (default: the device's)")
    p.add_argument(
        "--attention",
        choices=("flash_jvp", "math", "both"),
        default="both",
        help="both: train twice with the same seed and compare the loss curves",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float32",
        help="weights and data (CUDA: float32 weights under bf16 autocast)",
    )
    p.add_argument("--batch-size", type=int, help="default: the preset's")
    p.add_argument(
        "--evals", type=int, help="FD evaluations during training (default: the preset's; 0: none)"
    )
    p.add_argument(
        "--samples-per-class",
        type=int,
        default=50,
        help="samples per digit for the final scores (at most 58)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--out", default=os.path.join("examples", "out", name))
    args = p.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this torch sees no CUDA GPU "
                "(torch.cuda.is_available() is False); use --device cpu")  # fmt: skip
    return args


def main(method: Method, argv, description: str) -> dict:
    """Train ``method`` through the requested attention kinds, write samples, plots and
    metrics.json to ``args.out``, and return the metrics."""
    args = parse_args(argv, method.name, description)
    device = torch.device(args.device)
    if device.type == "cuda" and args.dtype != "float32":
        raise ValueError("--dtype float64 is for the CPU; CUDA runs fp32 weights under bf16")
    preset = PRESETS[args.preset or ("cuda" if device.type == "cuda" else "cpu")]
    preset = replace(
        preset,
        steps=args.steps or preset.steps,
        batch_size=args.batch_size or preset.batch_size,
        evals=preset.evals if args.evals is None else args.evals,
    )
    dtype = getattr(torch, args.dtype)
    os.makedirs(args.out, exist_ok=True)
    data = load_digits(device, dtype)
    judge = Judge(data[0], data[1], args.seed)
    kinds = ("flash_jvp", "math") if args.attention == "both" else (args.attention,)
    from flash_jvp.cli import path_name

    print(
        f"{method.name}: {preset}, {args.dtype}, attention {kinds}, "
        f"flash_jvp path: {path_name(device.type)}"
    )
    runs = []
    for kind in kinds:
        runs.append(train(method, preset, kind, data, judge, args))
        run = runs[-1]
        print(f"  {kind}: {run.seconds:.1f} s training ({1e3 * run.seconds / preset.steps:.1f} "
              f"ms/step) + {run.eval_seconds:.1f} s evaluations")  # fmt: skip

    # final samples of the first run (flash_jvp when both): 1 and 2 steps, scored
    x_train, _, x_test, y_test = data
    y = balanced_labels(args.samples_per_class, device)
    gen = torch.Generator(device).manual_seed(args.seed + 2)
    with torch.no_grad(), autocast(device):
        samples = {f"{n}-step": method.sample(runs[0].model, y, n, gen).float() for n in (1, 2)}
    real_pick = torch.cat([x_test[y_test == c][: args.samples_per_class] for c in range(10)])
    real_labels = torch.cat([y_test[y_test == c][: args.samples_per_class] for c in range(10)])
    if len(real_pick) != len(y):
        raise ValueError(
            f"--samples-per-class {args.samples_per_class}: the test split has "
            f"{int(torch.bincount(y_test).min())} of its rarest digit"
        )
    quality = {"real test": judge.scores(real_pick, real_labels, x_train[: len(x_test)])}
    quality["real test"]["note"] = "FD: real test vs as many real training digits"
    for name, x in samples.items():
        quality[f"{runs[0].attention} {name}"] = judge.scores(x, y, x_test)

    plot_samples(
        {"real (test)": real_pick, **{f"{k} ({runs[0].attention})": v for k, v in samples.items()}},
        os.path.join(args.out, "samples.png"),
    )
    plot_losses(runs, os.path.join(args.out, "loss.png"), method.name, method.curve)
    plot_quality(quality, os.path.join(args.out, "quality.png"))
    from flash_jvp._env import environment

    metrics = {
        "example": method.name,
        "environment": environment(),
        "args": vars(args),
        "preset": asdict(preset),
        "method": method.notes,
        "flash_jvp_path": path_name(device.type),
        "classifier_test_accuracy": judge.clf.score(_flat(x_test), y_test.cpu().numpy()),
        "quality": quality,
        "agreement": compare(runs, method.curve),
        "runs": {
            r.attention: {
                "seconds": r.seconds,
                "eval_seconds": r.eval_seconds,
                "ms_per_step": 1e3 * r.seconds / preset.steps,
                "losses": r.losses,
                "stats": r.stats,
                "evals": r.evals,
            }
            for r in runs
        },
    }
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    print(json.dumps({"quality": quality, "agreement": metrics["agreement"]}, indent=1))
    print(f"wrote {args.out}/samples.png, loss.png, quality.png, metrics.json")
    return metrics
