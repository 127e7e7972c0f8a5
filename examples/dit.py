"""Transformer building blocks and a DiT, shared by the examples and ``benchmarks/e2e.py``.

DiT: Peebles & Xie, "Scalable Diffusion Models with Transformers" (arXiv 2212.09748):
patchify, transformer blocks conditioned through adaLN-Zero (every block's scale, shift and
gate come from the conditioning vector; the gates and the output layer start at zero),
unpatchify. The time inputs go through sinusoidal features and an MLP, made of plain
differentiable ops, so ``torch.func.jvp`` can carry a tangent along t (MeanFlow's du/dt, sCM's
dF/dt).

Choices made for forward-mode AD and ``torch.compile``:

* norms are ``nn.LayerNorm`` / ``nn.RMSNorm`` subclasses written out in plain ops
  (``F.layer_norm`` under ``torch.compile`` of ``torch.func.jvp`` fails inside torch),
  computed in at least float32, so the residual stream of an fp32 model stays fp32 under bf16
  autocast (a pure-bf16 LayerNorm under jvp on CUDA hands the next bf16 Linear a float
  tangent); they take the adaLN modulation as arguments, so ``flash_jvp.nn.convert`` can swap
  in the fused layers (norm, modulation and tangent in one pass);
* weights stay in the model's dtype (fp32 on the GPU, fp32 or fp64 on the CPU); callers use
  ``torch.autocast("cuda", torch.bfloat16)`` for bf16 matmuls;
* the attention is selectable (:data:`ATTENTIONS`), so one model runs through flash_jvp,
  math SDPA, attention in plain ops, or torch's default SDPA (no JVP: the no-JVP floor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_jvp
import flash_jvp.nn

Tensor = torch.Tensor

# flash_jvp: the fused kernels (CPU: the fallback or the interpreter); math: torch SDPA's math
# backend, the only torch SDPA that supports forward AD; plain: softmax(q k^T * scale) v in
# plain ops; sdpa: torch's default SDPA dispatch (flash on the GPU; no forward AD).
ATTENTIONS = ("flash_jvp", "math", "plain", "sdpa")


def plain_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(E)) v in plain ops, as a model written without SDPA does it.

    q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) with Hq a multiple of Hkv (grouped
    query heads share a key/value head); ``is_causal``: query i sees keys j <= i. Under
    autocast the softmax runs in float32, as autocast decides for ``softmax``.
    """
    if k.shape[-3] != q.shape[-3]:
        k, v = (x.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3) for x in (k, v))
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if is_causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    return s.softmax(-1) @ v


def attend(q: Tensor, k: Tensor, v: Tensor, kind: str, is_causal: bool = False) -> Tensor:
    """Attention of q (B, Hq, L, E) over k, v (B, Hkv, S, E|Ev) through ``kind``, one of
    :data:`ATTENTIONS`; Hq != Hkv means grouped-query attention."""
    gqa = q.shape[-3] != k.shape[-3]
    if kind == "flash_jvp":
        return flash_jvp.attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)
    if kind == "math":
        # Under bf16 autocast, torch's math SDPA inside a JVP fails in its backward ("expected
        # input and grad types to match", softmax's backward; H200, torch 2.11): the math
        # reference computes in at least float32, autocast off, and hands back q's dtype.
        dtype = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False), sdpa_kernel(SDPBackend.MATH):
            o = F.scaled_dot_product_attention(
                q.to(dtype), k.to(dtype), v.to(dtype), is_causal=is_causal, enable_gqa=gqa
            )
        return o.to(q.dtype)
    if kind == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa)
    if kind == "plain":
        return plain_attention(q, k, v, is_causal)
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {kind!r}")


def wide(x: Tensor) -> Tensor:
    """x in at least float32 (float64 stays float64): norms and losses under bf16 autocast
    stay fp32, and float64 runs stay float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _modulated(y: Tensor, shift: Tensor | None, scale: Tensor | None) -> Tensor:
    """adaLN modulation ``y * (1 + scale) + shift`` (either may be None)."""
    if scale is not None:
        y = y * (1 + scale)
    return y if shift is None else y + shift


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (DiT: without affine parameters, adaLN supplies them) written in plain
    ops and at least float32; ``forward(x, shift=None, scale=None)`` applies the adaLN
    modulation too. ``flash_jvp.nn.convert(model, types=FUSABLE)`` swaps in the
    fused layers, which compute the same function."""

    def forward(self, x: Tensor, shift: Tensor | None = None, scale: Tensor | None = None):
        x = wide(x)
        centred = x - x.mean(-1, keepdim=True)
        y = centred * torch.rsqrt(centred.square().mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight
        if self.bias is not None:
            y = y + self.bias
        return _modulated(y, shift, scale)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (Zhang & Sennrich 2019) with a learned gain, in plain ops and at least
    float32; ``forward(x, shift=None, scale=None)`` as :class:`LayerNorm`'s."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps=eps)

    def forward(self, x: Tensor, shift: Tensor | None = None, scale: Tensor | None = None):
        x = wide(x)
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight
        return _modulated(y, shift, scale)


class GatedResidual(flash_jvp.nn.GatedResidual):
    """adaLN-Zero's gated residual ``x + gate * y`` in plain ops (``flash_jvp.nn.convert``
    swaps in the fused one)."""

    def forward(self, x: Tensor, gate: Tensor, y: Tensor) -> Tensor:
        return x + gate * y


# The example's own layers that ``flash_jvp.nn.convert(model, types=FUSABLE)`` may swap for
# the fused ones (they compute the same functions; nn.Linear, nn.GELU, nn.SiLU need no entry).
FUSABLE = (LayerNorm, RMSNorm, GatedResidual)


class Attention(nn.Module):
    """Multi-head self-attention: fused qkv projection, ``heads`` query heads and ``kv_heads``
    key/value heads (GQA when fewer) of ``head_dim`` each, output projection.

    ``attention`` picks the kernel (:data:`ATTENTIONS`); it is a plain attribute, so one
    model can be switched between kernels after construction (:func:`set_attention`).
    """

    def __init__(self, dim, heads, head_dim, kv_heads=None, attention="flash_jvp", causal=False):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        kv_heads = heads if kv_heads is None else kv_heads
        if heads % kv_heads:
            raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.attention, self.causal = attention, causal
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim)
        self.proj = nn.Linear(heads * head_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        sizes = [n * self.head_dim for n in (self.heads, self.kv_heads, self.kv_heads)]
        q, k, v = self.qkv(x).split(sizes, dim=-1)
        # (B, L, H*E) -> (B, H, L, E) views; every attention here takes strided inputs
        q, k, v = (t.view(B, L, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        o = attend(q, k, v, self.attention, self.causal)
        return self.proj(o.transpose(1, 2).reshape(B, L, -1))


class Mlp(nn.Module):
    """Linear, tanh-GELU, Linear (DiT's MLP)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    """Pre-norm attention and MLP, each scaled, shifted and gated by adaLN-Zero."""

    def __init__(self, dim, heads, head_dim, mlp_ratio=4.0, attention="flash_jvp"):
        super().__init__()
        self.attn = Attention(dim, heads, head_dim, attention=attention)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))  # zeroed by init_weights
        self.norm1, self.norm2 = (LayerNorm(dim, 1e-6, elementwise_affine=False) for _ in "12")
        self.residual = GatedResidual()

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c)[:, None].chunk(6, -1)
        x = self.residual(x, gate1, self.attn(self.norm1(x, shift1, scale1)))
        return self.residual(x, gate2, self.mlp(self.norm2(x, shift2, scale2)))


class TimeEmbedding(nn.Module):
    """Sinusoidal features of ``scale * t`` at DiT's frequencies 10000^(-i/half), then an MLP.

    ``scale`` sets how fast the features turn with t (DiT: 1000 for steps 0..1000). Under a
    JVP along t the tangent of each feature is its frequency times ``scale`` times t's
    tangent; sCM (Lu & Song 2024, sec. 4.1) traces training instabilities to time embeddings
    that turn too fast, so the examples keep ``scale`` moderate.
    """

    def __init__(self, dim: int, scale: float = 1000.0, freq_dim: int = 256):
        super().__init__()
        half = freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / half)
        self.register_buffer("freqs", (scale * freqs).float(), persistent=False)
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        args = t[:, None] * self.freqs.to(wide(t).dtype)
        return self.mlp(torch.cat([args.cos(), args.sin()], dim=-1))


def _sincos_2d(dim: int, grid: tuple[int, int]) -> Tensor:
    """Fixed 2-D sine-cosine position embedding (grid_h * grid_w, dim), as DiT uses."""
    quarter = dim // 4
    omega = 1.0 / 10000.0 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    ys, xs = torch.meshgrid(
        torch.arange(grid[0], dtype=torch.float64),
        torch.arange(grid[1], dtype=torch.float64),
        indexing="ij",
    )
    parts = []
    for pos in (ys.flatten(), xs.flatten()):
        args = pos[:, None] * omega[None]
        parts += [args.sin(), args.cos()]
    emb = torch.cat(parts, dim=-1)
    return F.pad(emb, (0, dim - emb.shape[-1])).float()


class DiT(nn.Module):
    """DiT with adaLN-Zero over a (C, H, W) input, conditioned on times and an optional label.

    Args:
        input_size: (H, W) of the input (an int for square inputs).
        patch_size: p; the input becomes (H/p) * (W/p) tokens of p*p*C values.
        in_channels: C; the output has the same shape as the input.
        dim: width of the residual stream.
        depth: number of blocks.
        heads, head_dim: attention heads and their width (head_dim * heads need not be dim).
        mlp_ratio: MLP hidden width / dim.
        num_classes: labels 0..num_classes-1 are embedded and added to the conditioning
            (0: unconditional).
        num_times: how many scalar time inputs are embedded and summed (1: t; 2: MeanFlow's
            (t, t - r)).
        time_scale: see :class:`TimeEmbedding`.
        attention: one of :data:`ATTENTIONS`.

    ``forward(x, t, y=None, t2=None)``: x (B, C, H, W); t (B,); y (B,) int64 labels; t2 (B,),
    the second time input when ``num_times == 2``. Returns (B, C, H, W). t and t2 take part in
    ``torch.func.jvp`` like x.
    """

    def __init__(
        self,
        input_size: int | Sequence[int] = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        dim: int = 1152,
        depth: int = 28,
        heads: int = 16,
        head_dim: int = 72,
        mlp_ratio: float = 4.0,
        num_classes: int = 0,
        num_times: int = 1,
        time_scale: float = 1000.0,
        attention: str = "flash_jvp",
    ):
        super().__init__()
        h, w = (input_size, input_size) if isinstance(input_size, int) else tuple(input_size)
        if h % patch_size or w % patch_size:
            raise ValueError(f"input_size {(h, w)} must be a multiple of patch_size {patch_size}")
        if num_times not in (1, 2):
            raise ValueError(f"num_times must be 1 or 2, got {num_times}")
        self.grid = (h // patch_size, w // patch_size)
        self.patch_size, self.in_channels = patch_size, in_channels
        self.patch = nn.Linear(patch_size * patch_size * in_channels, dim)
        self.register_buffer("pos", _sincos_2d(dim, self.grid), persistent=False)
        self.times = nn.ModuleList(TimeEmbedding(dim, time_scale) for _ in range(num_times))
        self.labels = nn.Embedding(num_classes, dim) if num_classes else None
        self.blocks = nn.ModuleList(
            DiTBlock(dim, heads, head_dim, mlp_ratio, attention) for _ in range(depth)
        )
        self.final_ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.final_norm = LayerNorm(dim, 1e-6, elementwise_affine=False)
        self.final = nn.Linear(dim, patch_size * patch_size * in_channels)
        self.init_weights()

    def init_weights(self) -> None:
        """DiT's init: Xavier-uniform linears, N(0, 0.02) embeddings, adaLN-Zero (every
        block's modulation and the output layer start at zero)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        for emb in self.times:
            for m in emb.mlp:
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
        if self.labels is not None:
            nn.init.normal_(self.labels.weight, std=0.02)
        for m in [*(b.ada[1] for b in self.blocks), self.final_ada[1], self.final]:
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    def patchify(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, L, p*p*C)."""
        B, C, _, _ = x.shape
        p, (gh, gw) = self.patch_size, self.grid
        x = x.reshape(B, C, gh, p, gw, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(B, gh * gw, p * p * C)

    def unpatchify(self, x: Tensor) -> Tensor:
        """(B, L, p*p*C) -> (B, C, H, W)."""
        B = x.shape[0]
        p, (gh, gw), C = self.patch_size, self.grid, self.in_channels
        x = x.reshape(B, gh, gw, p, p, C).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(B, C, gh * p, gw * p)

    def forward(self, x: Tensor, t: Tensor, y: Tensor | None = None, t2: Tensor | None = None):
        times = (t,) if t2 is None else (t, t2)
        if len(times) != len(self.times):
            raise ValueError(f"this DiT takes {len(self.times)} time input(s), got {len(times)}")
        c = self.times[0](times[0])
        for emb, s in zip(self.times[1:], times[1:]):  # (not sum(): no 0 + c op under the JVP)
            c = c + emb(s)
        if self.labels is not None:
            if y is None:
                raise ValueError("this DiT is class-conditional: pass y (B,) int64 labels")
            c = c + self.labels(y)
        h = self.patch(self.patchify(x)) + self.pos
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.final_ada(c)[:, None].chunk(2, -1)
        return self.unpatchify(self.final(self.final_norm(h, shift, scale)))


def set_attention(model: nn.Module, kind: str) -> nn.Module:
    """Switch every :class:`Attention` in ``model`` to ``kind`` (one of :data:`ATTENTIONS`)."""
    if kind not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {kind!r}")
    for m in model.modules():
        if isinstance(m, Attention):
            m.attention = kind
    return model
