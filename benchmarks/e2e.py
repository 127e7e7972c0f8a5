"""End-to-end training steps with a JVP through a whole model, side by side (H200; ~5 min).

Models (fp32 weights under bf16 autocast; ``--rows`` picks them):

* ``dit256``: DiT-XL/2-like (d 1152, 16 heads of 72, 28 blocks), 256 tokens (256 px), batch 64;
* ``dit1024``: the same at 1024 tokens (512 px), batch 16;
* ``video8k``: a video-like DiT (d 1536, 12 heads of 128, 12 blocks), 8192 tokens, batch 1;
* ``video16k`` (not in the default set): the same at 16384 tokens;
* ``lm4k``: a causal LM with GQA (d 4096, 32 query / 8 key-value heads of 128, SwiGLU 11008,
  8 blocks, vocab 32000), 4096 tokens, batch 1.

Each DiT step is the sCM consistency-training step of ``examples/scm.py``: ``torch.func.jvp``
through the model with tangents on x_t and t, a loss on F and dF.detach(), backward
(``torch.autograd.grad`` over all weights). The LM step is a JVP of the LM along a tangent of
its input embeddings, loss = cross-entropy(logits) + mean(logits * dlogits.detach()), backward.
Methods (``--methods``):

* ``plain``: attention in plain ops (softmax(q k^T * scale) v), the JVP step, eager;
* ``plain graph``: the same step captured whole in one CUDA graph and replayed;
* ``flash_jvp`` / ``flash_jvp graph``: the JVP step through flash_jvp, eager / replayed;
* ``flash_jvp nn`` / ``flash_jvp nn graph``: the same with the model's norms swapped for the
  fused layers of ``flash_jvp.nn`` (``flash_jvp.nn.convert``; adaLN modulation fused in);
* ``flash_jvp compile`` (``plain compile``, on request): the JVP step's forward (jvp + loss) under
  ``torch.compile(fullgraph=True)``, backward through autograd; a failure is recorded;
* ``sdpa no-JVP`` / ``sdpa no-JVP graph`` / ``sdpa no-JVP compile``: the floor, a plain
  training step without a JVP (TrigFlow diffusion loss; LM cross-entropy) through torch's
  default SDPA (flash on the H200), eager / replayed / with every block under
  ``torch.compile`` (regional compilation).

When a model's plain-op step runs out of memory at full depth, plain, flash_jvp and the floor
are run again at ``fallback_depth`` blocks so their ratios exist (rows carry their depth).

Metrics per row: median ms/step of ``--steps`` steps after warm-up (CUDA events; steps are
enqueued back to back, so host time the GPU waits for counts); peak GiB
(``torch.cuda.max_memory_allocated`` from the row's start: weights, gradients and
activations); GPU-busy ms (torch.profiler, one step: the sum of the durations of all CUDA
kernels, memcpys and memsets) and the attention kernels' part of it. Attention kernels: a
kernel whose name matches ``KERNEL_RE`` (flash_jvp's kernels ``attn_fwd_kernel``,
``attn_fwd_hopper_kernel``, ``attn_bwd_*``, ``mask_ranges_kernel``; torch's flash/efficient/
cuDNN SDPA kernels), wherever it was launched, or one launched inside an op matching
``OP_RE`` or below one (``aten::bmm``, the softmax ops with the ops of their JVP formulas,
their backward nodes, SDPA ops; not the cross-entropy's log-softmax, not the linear layers'
GEMMs). Graph-replayed kernels have no launching op, so for ``plain graph`` the share is not
reported. The plain path's elementwise work outside those ops (the scale, the causal mask,
GQA's repeat_interleave) counts as non-attention, so its share is a lower bound.

Rows that fail (out of memory, compile errors, a CUDA graph whose loss differs from the eager
step's) are recorded and the run goes on; JSON and markdown are rewritten after every row.
Rows that would start after ``--budget-s`` seconds are skipped (compile rows run last; one
compile can itself take minutes).

    python -m benchmarks.e2e [--quick] [--rows dit256,lm4k] [--methods ...] [--out DIR]
    python -m flash_jvp bench --e2e [--quick]          # the same, from a source checkout
    python -m benchmarks.e2e --smoke                   # tiny models on the CPU (no timing)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import gc
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

import flash_jvp.nn
from examples import scm
from examples.dit import FUSABLE, Attention, DiT, RMSNorm, set_attention, wide
from flash_jvp._env import environment

GIB = 2**30
KERNEL_RE = re.compile(
    r"attn_fwd_kernel|attn_fwd_hopper_kernel|attn_bwd_|mask_ranges_kernel"  # flash_jvp
    r"|flash_fwd|flash_bwd|fmha|cudnn|sdpa"  # torch SDPA backends
)
OP_RE = re.compile(
    r"^aten::(bmm|baddbmm|softmax|_softmax|_safe_softmax|_softmax_backward_data"
    r"|_scaled_dot_product\w*|_flash_attention\w*|_efficient_attention\w*|_cudnn_attention\w*)$"
    r"|^(Bmm|Softmax|SafeSoftmax|ScaledDotProduct\w*)Backward"
)
KERNEL_RULE = (
    f"kernel name ~ /{KERNEL_RE.pattern}/ or launching op (or an ancestor) ~ /{OP_RE.pattern}/"
)


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Spec:
    """One benchmarked model and its batch."""

    name: str
    label: str
    kind: str  # "dit" or "lm"
    batch: int
    depth: int
    dim: int
    heads: int
    head_dim: int
    kv_heads: int = 0  # lm: key/value heads (GQA)
    input_hw: tuple[int, int] = (32, 32)  # dit: latent size; patch 2
    in_channels: int = 4
    seq_len: int = 0  # lm: tokens
    mlp_hidden: int = 0  # lm: SwiGLU width
    vocab: int = 32000
    fallback_depth: int | None = None  # plain-op comparison depth when full depth is OOM

    @property
    def tokens(self) -> int:
        return self.input_hw[0] * self.input_hw[1] // 4 if self.kind == "dit" else self.seq_len


_DIT_XL = dict(kind="dit", depth=28, dim=1152, heads=16, head_dim=72, fallback_depth=12)
_VIDEO = dict(kind="dit", batch=1, depth=12, dim=1536, heads=12, head_dim=128, in_channels=16)
SPECS = {
    s.name: s
    for s in (
        Spec("dit256", "DiT-XL/2, 256 tokens", batch=64, **_DIT_XL),
        Spec("dit1024", "DiT-XL/2, 1024 tokens", batch=16, input_hw=(64, 64), **_DIT_XL),
        Spec("video8k", "video-like DiT, 8192 tokens", input_hw=(128, 256), fallback_depth=4,
             **_VIDEO),
        Spec("video16k", "video-like DiT, 16384 tokens", input_hw=(256, 256), fallback_depth=1,
             **_VIDEO),
        Spec("lm4k", "causal LM, GQA 32/8, 4096 tokens", kind="lm", batch=1, depth=8, dim=4096,
             heads=32, head_dim=128, kv_heads=8, seq_len=4096, mlp_hidden=11008,
             fallback_depth=4),
    )
}  # fmt: skip
DEFAULT_ROWS = ("dit256", "dit1024", "video8k", "lm4k")
# Tiny versions for the CPU smoke mode and the tests.
SMOKE_SPECS = {
    "dit256": Spec("dit256", "tiny DiT", kind="dit", batch=2, depth=2, dim=32, heads=2,
                   head_dim=16, input_hw=(8, 8), in_channels=2),
    "lm4k": Spec("lm4k", "tiny causal LM, GQA 4/2", kind="lm", batch=2, depth=2, dim=64,
                 heads=4, head_dim=16, kv_heads=2, seq_len=24, mlp_hidden=96, vocab=50),
}  # fmt: skip


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


class LMBlock(nn.Module):
    def __init__(self, spec: Spec, attention: str):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(spec.dim), RMSNorm(spec.dim)
        self.attn = Attention(spec.dim, spec.heads, spec.head_dim, spec.kv_heads, attention, True)
        self.mlp = SwiGLU(spec.dim, spec.mlp_hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CausalLM(nn.Module):
    """Pre-norm decoder (RMSNorm, causal GQA attention, SwiGLU), no position encoding (it
    would not change the attention's cost); ``body(h)`` maps input embeddings to logits."""

    def __init__(self, spec: Spec, attention: str):
        super().__init__()
        self.embed = nn.Embedding(spec.vocab, spec.dim)
        self.blocks = nn.ModuleList(LMBlock(spec, attention) for _ in range(spec.depth))
        self.norm = RMSNorm(spec.dim)
        self.head = nn.Linear(spec.dim, spec.vocab, bias=False)

    def body(self, h):
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build(spec: Spec, attention: str, device, dtype) -> nn.Module:
    """The model of ``spec``, built on ``device`` (fp32 weights on the GPU)."""
    with torch.device(device):
        if spec.kind == "lm":
            model = CausalLM(spec, attention)
        else:
            model = DiT(
                input_size=spec.input_hw,
                patch_size=2,
                in_channels=spec.in_channels,
                dim=spec.dim,
                depth=spec.depth,
                heads=spec.heads,
                head_dim=spec.head_dim,
                num_classes=1000,
                attention=attention,
            )
    return model.to(dtype)


# ----------------------------------------------------------------------------- steps


def make_inputs(spec: Spec, device, dtype, seed: int = 0) -> dict:
    """Fixed random inputs for one step (the same for every method; a CUDA graph reads them
    from these buffers)."""
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    if spec.kind == "lm":
        tokens = torch.randint(
            spec.vocab, (spec.batch, spec.tokens + 1), generator=gen, device=device
        )
        return {
            "tokens": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "emb_t": randn(spec.batch, spec.tokens, spec.dim),
        }
    shape = (spec.batch, spec.in_channels, *spec.input_hw)
    return {
        "x0": randn(*shape) * scm.SIGMA_D,
        "z": randn(*shape) * scm.SIGMA_D,
        "t": scm.sample_times(spec.batch, gen, device, dtype),
        "y": torch.randint(1000, (spec.batch,), generator=gen, device=device),
    }


def _autocast(device, enabled: bool = True):
    """bf16 autocast on CUDA (the benchmark's fp32 weights + bf16 compute), unless disabled
    (the fp32 comparisons of smoke_compare)."""
    if enabled and torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def jvp_loss(model, inp: dict, autocast: bool = True) -> torch.Tensor:
    """The loss of the JVP step (forward part): sCM for a DiT, the embedding-tangent loss for
    the LM."""
    with _autocast(next(model.parameters()).device, autocast):
        if isinstance(model, CausalLM):
            emb = model.embed(inp["tokens"])
            logits, logits_t = torch.func.jvp(model.body, (emb,), (inp["emb_t"],))
            logits, logits_t = wide(logits), wide(logits_t).detach()
            ce = F.cross_entropy(logits.flatten(0, 1), inp["targets"].flatten())
            return ce + (logits * logits_t).mean()
        return scm.scm_loss(model, inp["x0"], inp["z"], inp["t"], inp["y"])[0].mean()


def plain_loss(model, inp: dict, autocast: bool = True) -> torch.Tensor:
    """The loss of the no-JVP floor: TrigFlow diffusion (v-prediction) for a DiT,
    cross-entropy for the LM."""
    with _autocast(next(model.parameters()).device, autocast):
        if isinstance(model, CausalLM):
            logits = wide(model.body(model.embed(inp["tokens"])))
            return F.cross_entropy(logits.flatten(0, 1), inp["targets"].flatten())
        x0, z, t = inp["x0"], inp["z"], inp["t"]
        cos_t, sin_t = torch.cos(t).view(-1, 1, 1, 1), torch.sin(t).view(-1, 1, 1, 1)
        x_t, v = cos_t * x0 + sin_t * z, cos_t * z - sin_t * x0
        pred = wide(model(x_t / scm.SIGMA_D, t, inp["y"]))
        return (scm.SIGMA_D * pred - v).square().mean()


def step_fn(
    model, inp: dict, jvp: bool, loss_fn: Callable | None = None, autocast: bool = True
) -> Callable:
    """A training step without the optimizer: () -> (loss, grads of every weight)."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss_fn = loss_fn or functools.partial(jvp_loss if jvp else plain_loss, autocast=autocast)

    def step():
        loss = loss_fn(model, inp)
        return loss.detach(), torch.autograd.grad(loss, params)

    return step


# ----------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class MethodSpec:
    name: str
    attention: str
    jvp: bool
    runner: str  # eager, graph, compile
    profile: bool = True
    fused: bool = False  # the norms swapped for flash_jvp.nn's fused layers


METHODS = {
    m.name: m
    for m in (
        MethodSpec("flash_jvp", "flash_jvp", True, "eager"),
        MethodSpec("flash_jvp graph", "flash_jvp", True, "graph"),
        MethodSpec("flash_jvp nn", "flash_jvp", True, "eager", fused=True),
        MethodSpec("flash_jvp nn graph", "flash_jvp", True, "graph", fused=True),
        MethodSpec("plain", "plain", True, "eager"),
        MethodSpec("plain graph", "plain", True, "graph", profile=False),
        MethodSpec("sdpa no-JVP", "sdpa", False, "eager"),
        MethodSpec("sdpa no-JVP graph", "sdpa", False, "graph"),
        MethodSpec("math", "math", True, "eager", profile=False),
        MethodSpec("flash_jvp compile", "flash_jvp", True, "compile", profile=False),
        MethodSpec("plain compile", "plain", True, "compile", profile=False),
        MethodSpec("sdpa no-JVP compile", "sdpa", False, "compile", profile=False),
    )
}
DEFAULT_METHODS = tuple(m for m in METHODS if m not in ("math", "plain compile"))


@dataclass
class Row:
    model: str
    label: str
    method: str
    depth: int
    batch: int
    tokens: int
    status: str = "ok"  # ok, OOM, error, FAIL (graph loss differs), skipped
    ms: float | None = None
    ms_all: list[float] = field(default_factory=list)
    peak_gib: float | None = None
    weights_gib: float | None = None
    busy_ms: float | None = None
    attn_ms: float | None = None
    attn_share: float | None = None
    loss: float | None = None
    check: dict = field(default_factory=dict)
    compile_s: float | None = None
    seconds: float | None = None  # wall time of the whole row
    note: str = ""


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def _time(fn, warmup: int, steps: int, cuda: bool = True) -> list[float]:
    """ms per call of fn. CUDA: events around each call, enqueued back to back (host time
    the GPU waits for counts); CPU: wall time."""
    for _ in range(warmup):
        fn()
    if not cuda:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return times
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(steps)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def _in_attention_op(op) -> bool:
    """Whether ``op`` or one of its ancestors is an attention op (``OP_RE``)."""
    while op is not None:
        if OP_RE.search(op.name):
            return True
        op = op.cpu_parent
    return False


def attention_us(events, by_op: bool = True) -> float:
    """Microseconds of attention kernels among profiler ``events`` (the rule of the module
    docstring): every kernel named like one (``KERNEL_RE``, wherever it was launched from:
    Triton launches need not sit inside an op), plus, with ``by_op``, every other kernel an
    attention op launched (the kernels torch attaches to their launching op)."""
    from torch.autograd import DeviceType

    named = sum(
        e.device_time_total
        for e in events
        if e.device_type == DeviceType.CUDA and KERNEL_RE.search(e.name)
    )
    if not by_op:
        return named
    return named + sum(
        k.duration
        for e in events
        if e.device_type == DeviceType.CPU and _in_attention_op(e)
        for k in e.kernels
        if not KERNEL_RE.search(k.name)
    )


def profile_step(fn, by_op: bool = True) -> tuple[float, float]:
    """(GPU-busy ms, attention ms) of one call of fn, from torch.profiler: busy = the sum of
    all CUDA kernel, memcpy and memset durations; attention by :func:`attention_us` (graph
    replays have no launching op: ``by_op=False``)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.events()
    busy = sum(e.device_time_total for e in events if e.device_type == DeviceType.CUDA)
    return busy / 1e3, attention_us(events, by_op) / 1e3


def _graph(step: Callable) -> tuple[Callable, dict]:
    """step captured whole in one CUDA graph (warm-up on a side stream, as torch's notes
    say). Returns (replay, check): check compares the replayed loss with the eager loss of
    the same inputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            eager_loss, grads = step()
    torch.cuda.current_stream().wait_stream(side)
    eager = eager_loss.item()
    del eager_loss, grads
    _free()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss, _static_grads = step()
    graph.replay()
    torch.cuda.synchronize()
    replayed = static_loss.item()
    rel = abs(replayed - eager) / max(abs(eager), 1e-30)
    check = {
        "eager_loss": eager,
        "graph_loss": replayed,
        "bitwise_equal": replayed == eager,
        "rel_diff": rel,
    }

    def replay():
        graph.replay()
        return static_loss, _static_grads

    replay.graph = graph  # keep the graph (and its memory pool) alive with the callable
    return replay, check


@contextlib.contextmanager
def _regional_compile(model):
    """Every block of ``model`` under torch.compile(fullgraph=True) (regional compilation:
    the blocks share their code, so one compile serves all of them), restored afterwards."""
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        model.blocks[i] = torch.compile(block, fullgraph=True)
    try:
        yield model
    finally:
        for i, block in enumerate(blocks):
            model.blocks[i] = block
        torch._dynamo.reset()


def run_row(method: MethodSpec, model, inp, args, row: Row) -> Row:
    """Fill ``row`` by timing ``method`` on ``model``; exceptions become the row's status."""
    start = time.perf_counter()
    cuda = torch.device(args.device).type == "cuda"
    set_attention(model, method.attention)
    if method.fused:
        flash_jvp.nn.convert(model, types=FUSABLE)
    _free()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    row.weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / GIB
    step = None
    stack = contextlib.ExitStack()
    try:
        if method.runner == "compile" and not method.jvp:
            stack.enter_context(_regional_compile(model))
            step = step_fn(model, inp, jvp=False)
        elif method.runner == "compile":
            stack.callback(torch._dynamo.reset)
            step = step_fn(model, inp, True, loss_fn=torch.compile(jvp_loss, fullgraph=True))
        else:
            step = step_fn(model, inp, jvp=method.jvp)
        t0 = time.perf_counter()
        loss, grads = step()  # first call: Triton/inductor compiles
        row.loss = loss.item()
        del loss, grads
        if method.runner == "compile":
            row.compile_s = time.perf_counter() - t0
        if method.runner == "graph":
            step, row.check = _graph(step)
            if row.check["rel_diff"] > 1e-3:
                row.status = "FAIL"
                row.note = "graph loss differs from the eager loss"
        row.ms_all = _time(step, args.warmup, args.steps, cuda)
        row.ms = statistics.median(row.ms_all)
        if cuda:
            row.peak_gib = torch.cuda.max_memory_allocated() / GIB
        if method.profile and cuda and not args.no_profile:
            by_op = method.runner != "graph"
            row.busy_ms, attn = profile_step(step, by_op)
            if by_op or method.attention == "flash_jvp":
                row.attn_ms, row.attn_share = attn, attn / row.busy_ms if row.busy_ms else None
    except torch.OutOfMemoryError:
        row.status, row.note = "OOM", "out of memory"
    except Exception as err:  # recorded; the run goes on
        row.status, row.note = "error", _first_line(err)
        # printed now: a CUDA error is sticky, and freeing memory below re-raises it
        print(f"{row.label} {row.method}: {type(err).__name__}: {err}", flush=True)
    finally:
        step = None
        stack.close()
        set_attention(model, "flash_jvp")
        flash_jvp.nn.revert(model)
        _free()
    row.seconds = time.perf_counter() - start
    return row


# ----------------------------------------------------------------------------- report


def ratios(rows: list[Row]) -> list[dict]:
    """The targets of issue #17 per model, from the rows that exist."""

    def ms(model, method, depth):
        r = next(
            (
                r
                for r in rows
                if (r.model, r.method, r.depth) == (model, method, depth) and r.status == "ok"
            ),
            None,
        )
        return r

    out = []
    for name in dict.fromkeys(r.model for r in rows):
        spec_rows = [r for r in rows if r.model == name]
        tokens = spec_rows[0].tokens
        for depth in sorted({r.depth for r in spec_rows}, reverse=True):
            plain, flash = ms(name, "plain", depth), ms(name, "flash_jvp", depth)
            plain_g, flash_g = ms(name, "plain graph", depth), ms(name, "flash_jvp graph", depth)
            floor, floor_c = ms(name, "sdpa no-JVP", depth), ms(name, "sdpa no-JVP compile", depth)
            entry = {"model": name, "tokens": tokens, "depth": depth}

            def ratio(a, b, attr="ms"):
                x, y = (None if r is None else getattr(r, attr) for r in (a, b))
                return x / y if x is not None and y else None

            entry["plain / flash_jvp (eager)"] = ratio(plain, flash)
            entry["plain / flash_jvp (graphs)"] = ratio(plain_g, flash_g)
            entry["flash_jvp graph / no-JVP eager"] = ratio(flash_g, floor)
            entry["flash_jvp graph / no-JVP compiled"] = ratio(flash_g, floor_c)
            entry["flash_jvp / no-JVP eager"] = ratio(flash, floor)
            entry["peak flash_jvp / plain"] = ratio(flash, plain, "peak_gib")
            # issue 24: the fused layers' JVP step against the no-JVP step, eager and graphs
            fused, fused_g = ms(name, "flash_jvp nn", depth), ms(name, "flash_jvp nn graph", depth)
            entry["nn / no-JVP (eager)"] = ratio(fused, floor)
            entry["nn graph / no-JVP graph"] = ratio(fused_g, ms(name, "sdpa no-JVP graph", depth))
            entry["peak nn / flash_jvp"] = ratio(fused, flash, "peak_gib")
            nn_r, nn_g = entry["nn / no-JVP (eager)"], entry["nn graph / no-JVP graph"]
            entry["nn target (<= 1.5x eager, <= 1.4x graphs)"] = (
                None if nn_r is None or nn_g is None else nn_r <= 1.5 and nn_g <= 1.4
            )
            if tokens <= 256:
                speed = entry["plain / flash_jvp (graphs)"] or entry["plain / flash_jvp (eager)"]
                floor_r = entry["flash_jvp graph / no-JVP eager"]
                entry["target"] = "speed-up >= 1.3x (graphs), <= 2.0x the no-JVP step"
                entry["met"] = (
                    None if speed is None or floor_r is None else speed >= 1.3 and floor_r <= 2.0
                )
            else:
                speed, mem = entry["plain / flash_jvp (eager)"], entry["peak flash_jvp / plain"]
                entry["target"] = "speed-up >= 1.7x, peak <= 0.3x"
                entry["met"] = None if speed is None or mem is None else speed >= 1.7 and mem <= 0.3
            if plain is None and any(
                r.method == "plain" and r.status == "OOM" and r.depth == depth for r in spec_rows
            ):
                entry["note"] = "plain-op step out of memory at this depth"
            out.append(entry)
    return out


def _fmt(x, spec=".1f"):
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return format(x, spec) if isinstance(x, float) else str(x)


def markdown(meta: dict, rows: list[Row], targets: list[dict]) -> str:
    lines = [
        f"# flash_jvp end-to-end training steps, {meta['date']}",
        "",
        "```",
        json.dumps(meta, indent=1, default=str),
        "```",
        "",
        "| model | method | blocks | batch | tokens | ms/step | peak GiB | GPU-busy ms | "
        "attention ms (share) | status | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = "—" if r.attn_ms is None else f"{r.attn_ms:.1f} ({r.attn_share:.0%})"
        note = r.note
        if r.check:
            note += (
                f" graph loss {'==' if r.check['bitwise_equal'] else '~'} eager "
                f"(rel. diff {r.check['rel_diff']:.1e})"
            )
        if r.compile_s is not None:
            note += f" first call (compile) {r.compile_s:.0f} s"
        lines.append(
            f"| {r.label} | {r.method} | {r.depth} | {r.batch} | {r.tokens} | {_fmt(r.ms)} | "
            f"{_fmt(r.peak_gib)} | {_fmt(r.busy_ms)} | {share} | {r.status} | {note.strip()} |"
        )
    lines += [
        "",
        f"Attention kernels: {KERNEL_RULE}.",
        "",
        "Targets (ratios of ms/step; peak is total allocated memory):",
        "",
    ]
    if targets:
        keys = list(dict.fromkeys(k for t in targets for k in t))
        lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for t in targets:
            lines.append("| " + " | ".join(_fmt(t.get(k), ".2f") for k in keys) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    groups = list(dict.fromkeys((r.model, r.depth) for r in rows))
    methods = list(dict.fromkeys(r.method for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.5))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        for ax, attr in zip(axes, ("ms", "peak_gib")):
            xs, ys = [], []
            for j, g in enumerate(groups):
                r = next((r for r in rows if (r.model, r.depth, r.method) == (*g, method)), None)
                if r is not None and getattr(r, attr) is not None and r.status in ("ok", "FAIL"):
                    xs.append(j + i * width)
                    ys.append(getattr(r, attr))
            ax.bar(xs, ys, width, label=method)
    for ax, label in zip(axes, ("ms per training step", "peak GiB allocated")):
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(groups))],
            [f"{m}\n{d} blocks" for m, d in groups],
            fontsize=8,
        )
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle("JVP training steps (sCM / MeanFlow-style) through whole models, bf16 autocast")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- driver


def plan(args) -> list[tuple[Spec, MethodSpec, int]]:
    """(spec, method, depth) in run order: each model's eager/graph rows, then every compile
    row (compiles take the longest, and the budget skips what it must)."""
    specs = [(SMOKE_SPECS if args.smoke else SPECS)[name] for name in args.rows]
    if args.depth:
        specs = [replace(s, depth=args.depth) for s in specs]
    methods = [METHODS[m] for m in args.methods]
    main = [(s, m, s.depth) for s in specs for m in methods if m.runner != "compile"]
    compiles = [(s, m, s.depth) for s in specs for m in methods if m.runner == "compile"]
    return main + compiles


def run(args) -> int:
    """The benchmark on the GPU (exit status 2 without one)."""
    if not torch.cuda.is_available():
        print("the end-to-end benchmark needs a CUDA GPU; `--smoke` runs tiny models on the CPU")
        return 2
    run_rows(args)
    return 0


def run_rows(args) -> list[Row]:
    """Run the planned rows on ``args.device`` and write the results (``args.out``; on the
    CPU only when given)."""
    device = torch.device(args.device)
    start = time.perf_counter()
    date = dt.datetime.now(dt.timezone.utc)
    meta = {
        "date": date.isoformat(timespec="seconds"),
        **environment(),
        "args": dict(vars(args)),
        "attention_rule": KERNEL_RULE,
    }
    if device.type == "cuda":
        meta["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / GIB
    stem = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        gpu = meta.get("gpu", device.type).replace("NVIDIA ", "").replace(" ", "-").lower()
        stem = os.path.join(args.out, f"{date:%Y-%m-%d}-{gpu}-e2e{'-smoke' if args.smoke else ''}")
    rows: list[Row] = []
    todo = plan(args)
    model = key = inp = None
    while todo:
        spec, method, depth = todo.pop(0)
        row = Row(spec.name, spec.label, method.name, depth, spec.batch, spec.tokens)
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            row.status, row.note = "skipped", f"time budget ({elapsed:.0f} s > {args.budget_s} s)"
        elif method.runner == "graph" and device.type != "cuda":
            row.status, row.note = "skipped", "CUDA graphs need CUDA"
        elif method.runner == "graph" and _eager_failed(rows, spec, method, depth):
            row.status, row.note = "skipped", "its eager step failed"
        else:
            if key != (spec.name, depth):
                model = inp = None
                _free()
                torch.manual_seed(0)
                model = build(replace(spec, depth=depth), "flash_jvp", device, args.dtype)
                inp, key = make_inputs(spec, device, args.dtype), (spec.name, depth)
            run_row(method, model, inp, args, row)
        rows.append(row)
        print(_line(row), flush=True)
        if method.name == "plain" and row.status == "OOM" and not args.depth:
            _add_fallback(todo, rows, spec, args.methods)
        if stem:
            _write(stem, meta, rows, final=False)
    model = inp = None
    _free()
    meta["wall_s"] = time.perf_counter() - start
    targets = ratios(rows)
    for t in targets:
        print(json.dumps(t))
    if stem:
        _write(stem, meta, rows, final=True)
        print(f"wrote {stem}.json, .md, .png in {meta['wall_s']:.0f} s")
    return rows


def _add_fallback(todo: list, rows: list[Row], spec: Spec, methods: list[str]) -> None:
    """The plain-op step did not fit at full depth: queue plain and flash_jvp (eager and
    graphed) and the no-JVP floor at ``spec.fallback_depth``, after this model's remaining
    full-depth rows (one model build per depth)."""
    fb = spec.fallback_depth
    if not fb or fb == spec.depth:
        return
    extra = [
        (spec, METHODS[m], fb)
        for m in ("flash_jvp", "plain", "flash_jvp graph", "plain graph", "sdpa no-JVP")
        if m in methods
        and not any((r.model, r.method, r.depth) == (spec.name, m, fb) for r in rows)
    ]
    at = next(
        (
            i
            for i, (s, m, d) in enumerate(todo)
            if (s.name, d) != (spec.name, spec.depth) or m.runner == "compile"
        ),
        len(todo),
    )
    todo[at:at] = extra


def _eager_failed(rows, spec, method, depth) -> bool:
    eager = method.name.replace(" graph", "")
    return any(
        r.model == spec.name and r.method == eager and r.depth == depth and r.status != "ok"
        for r in rows
    )


def _line(r: Row) -> str:
    share = "" if r.attn_share is None else f" attention {r.attn_ms:.1f} ms ({r.attn_share:.0%})"
    busy = "" if r.busy_ms is None else f" busy {r.busy_ms:.1f} ms"
    return (
        f"{r.label:32} {r.method:20} blocks {r.depth:2}: {_fmt(r.ms):>7} ms "
        f"{_fmt(r.peak_gib):>6} GiB{busy}{share} [{r.status}] {r.note} "
        f"{r.check or ''} ({r.seconds or 0:.0f} s)"
    )


def _write(stem: str, meta: dict, rows: list[Row], final: bool) -> None:
    """JSON and markdown after every row (a run cut short keeps its rows); the plot at the
    end. A failure here is printed, never raised: the rows are worth more than the report."""
    try:
        _write_files(stem, meta, rows, final)
    except Exception as err:
        print(f"could not write {stem}.*: {_first_line(err)}", flush=True)


def _write_files(stem: str, meta: dict, rows: list[Row], final: bool) -> None:
    targets = ratios(rows)
    with open(stem + ".json", "w") as f:
        json.dump(
            {
                "meta": meta,
                "complete": final,
                "rows": [asdict(r) for r in rows],
                "targets": targets,
            },
            f,
            indent=1,
            default=str,
        )
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta, rows, targets))
    if final:
        plot(rows, stem + ".png")


def run_smoke(args) -> int:
    """Tiny models on the CPU: the benchmark's own driver (graph rows are skipped), then
    flash_jvp's loss and gradients against the plain-op path's (float64 on the fallback,
    float32 under the interpreter). Exit status 1 if a row fails or they differ."""
    from flash_jvp import _utils

    args.dtype = torch.float32 if _utils.uses_kernels(torch.device("cpu")) else torch.float64
    failed = [r for r in run_rows(args) if r.status not in ("ok", "skipped")]
    worst = 0.0
    for name in args.rows:
        results = smoke_compare(SMOKE_SPECS[name], args.dtype)
        worst = max(worst, results["max_rel_diff"])
        print(json.dumps(results))
    print(f"smoke: largest relative difference flash_jvp vs plain {worst:.2e} ({args.dtype})")
    for r in failed:
        print(f"smoke: row failed: {r.label} {r.method}: {r.status} {r.note}")
    return 0 if not failed and worst < (1e-4 if args.dtype == torch.float32 else 1e-10) else 1


def smoke_compare(spec: Spec, dtype, device="cpu") -> dict:
    """The JVP step of ``spec`` through plain, math and flash_jvp attention on one model and
    one input, and the floor step: losses, and the largest relative gradient difference of
    flash_jvp and math from plain."""
    torch.manual_seed(0)
    model = build(spec, "plain", device, dtype)
    _perturb(model)
    inp = make_inputs(spec, device, dtype)
    out = {"model": spec.label, "dtype": str(dtype)}
    # no autocast: a float32 comparison on CUDA too (under bf16 autocast the step's own
    # rounding, 5e-2 relative, would hide attention's)
    ref_loss, ref_grads = step_fn(set_attention(model, "plain"), inp, True, autocast=False)()
    worst = 0.0
    for kind in ("flash_jvp", "math", "flash_jvp nn"):
        if kind == "flash_jvp nn":  # the fused norms too
            flash_jvp.nn.convert(model, types=FUSABLE)
        loss, grads = step_fn(set_attention(model, kind.split()[0]), inp, True, autocast=False)()
        flash_jvp.nn.revert(model)
        rel = max(_rel(g, r) for g, r in zip(grads, ref_grads))
        rel = max(rel, _rel(loss, ref_loss))
        out[kind] = {"loss": loss.item(), "max_rel_diff": rel}
        worst = max(worst, rel)
    floor_loss, _ = step_fn(set_attention(model, "sdpa"), inp, False, autocast=False)()
    out.update(plain_loss=ref_loss.item(), floor_loss=floor_loss.item(), max_rel_diff=worst)
    return out


def _perturb(model) -> None:
    """Random weights everywhere: adaLN-Zero starts with zero gates and output, which would
    make every gradient but the last layer's zero and a comparison meaningless."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    return (x - ref).abs().max().item() / scale if scale else (x - ref).abs().max().item()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.split("\n")[0])
    p.add_argument(
        "--rows",
        help=f"models, comma-separated, from {','.join(SPECS)} "
        f"(default {','.join(DEFAULT_ROWS)}; --smoke: {','.join(SMOKE_SPECS)})",
    )
    p.add_argument(
        "--methods",
        help=f"methods, comma-separated, from {','.join(METHODS)} "
        "(default: all but math and plain compile; --smoke: no compile rows, which take "
        "minutes on a CPU)",
    )
    p.add_argument(
        "--quick", action="store_true", help="3 timed steps, no compile rows, no profiles"
    )
    p.add_argument("--steps", type=int, default=6, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    p.add_argument("--depth", type=int, help="override every model's number of blocks")
    p.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="skip rows that would start after this many seconds",
    )
    p.add_argument("--no-profile", action="store_true")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny models on the CPU (not timed meaningfully): the driver runs, and "
        "flash_jvp's loss and gradients are checked against the plain-op path's",
    )
    p.add_argument("--out", help="results folder (default benchmarks/results; --smoke: none)")
    args = p.parse_args(argv)
    specs = SMOKE_SPECS if args.smoke else SPECS
    args.rows = [
        r for r in (args.rows or ",".join(specs if args.smoke else DEFAULT_ROWS)).split(",") if r
    ]
    default = [m for m in DEFAULT_METHODS if not (args.smoke and METHODS[m].runner == "compile")]
    args.methods = [m for m in args.methods.split(",") if m] if args.methods else default
    for name in args.rows:
        if name not in specs:
            p.error(f"--rows: unknown model {name!r}; choose from {', '.join(specs)}")
    for name in args.methods:
        if name not in METHODS:
            p.error(f"--methods: unknown method {name!r}; choose from {', '.join(METHODS)}")
    if args.quick:
        args.steps, args.warmup, args.no_profile = 3, 1, True
        args.methods = [m for m in args.methods if METHODS[m].runner != "compile"]
    if args.smoke:
        args.device, args.steps, args.warmup = "cpu", 1, 0
    else:
        args.device, args.dtype = "cuda", torch.float32
        args.out = args.out or os.path.join("benchmarks", "results")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_smoke(args) if args.smoke else run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
