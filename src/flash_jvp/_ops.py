"""Host launchers: allocate outputs, pick a config, build the grid, launch.

They take and return plain tensors (B, H, L, E) with any strides; autograd lives in
``_function.py``. Inputs are assumed validated by ``_validate.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
from triton.runtime.errors import OutOfResources

from .kernels import configs
from .kernels.bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, attn_bwd_preprocess_kernel
from .kernels.configs import Config
from .kernels.fwd import attn_fwd_kernel

Tensor = torch.Tensor

# key -> the first candidate config that fit the GPU's resources for it
_CHOSEN: dict[tuple, Config] = {}


def _empty(shape: Sequence[int], like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Every buffer the launchers return is allocated here (tests poison it with NaN)."""
    return torch.empty(shape, device=like.device, dtype=dtype or like.dtype)


def _head_dim(e: int) -> int:
    """Tile width for a head dim: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(e))


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 follows torch.backends.cuda.matmul.allow_tf32, like torch's own matmuls."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _strides(t: Tensor | None, prefix: str) -> dict[str, int]:
    names = ("b", "h", "m" if prefix in ("q", "o", "qt", "ot", "do", "dq") else "n", "d")
    values = t.stride() if t is not None else (0, 0, 0, 0)
    return {f"stride_{prefix}{n}": s for n, s in zip(names, values)}


MAX_GRID_Y = 65535  # CUDA's limit on the grid's second dimension (batch * heads here)


def _launch(
    kernel, grid: Callable[[Config], tuple[int, ...]], candidates: list[Config], key: tuple, **args
) -> None:
    """Launch with the first candidate that fits the GPU; remember it for this key."""
    batch_heads = grid(candidates[0])[1]
    if batch_heads > MAX_GRID_Y:
        raise NotImplementedError(
            f"flash_jvp: batch * heads = {batch_heads} is more than this version launches "
            f"({MAX_GRID_Y}, CUDA's grid limit); split the batch."
        )
    chosen = _CHOSEN.get(key)
    if chosen is not None:
        kernel[grid(chosen)](**args, **chosen.kwargs())
        return
    errors = []
    for cfg in candidates:
        try:
            kernel[grid(cfg)](**args, **cfg.kwargs())
        except OutOfResources as err:
            errors.append(f"{cfg}: {err}")
            continue
        _CHOSEN[key] = cfg
        return
    raise NotImplementedError(
        f"flash_jvp: no launch configuration of {kernel.fn.__name__} fits this GPU for {key}: "
        + "; ".join(errors)
    )


def attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_t: Tensor | None,
    k_t: Tensor | None,
    v_t: Tensor | None,
    scale: float,
    is_causal: bool,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """Fused forward. Returns o (B, H, Lq, Ev), o_t (same, or None without tangents) and
    lse (B, H, Lq) float32 in natural log. Missing tangents count as zero and cost nothing."""
    B, H, Lq, D = q.shape
    H_KV, Lk, DV = k.shape[1], k.shape[2], v.shape[3]
    tangent = q_t is not None or k_t is not None or v_t is not None
    o = _empty((B, H, Lq, DV), q)
    o_t = _empty((B, H, Lq, DV), q) if tangent else None
    lse = _empty((B, H, Lq), q, torch.float32)
    if o.numel() == 0:
        return o, o_t, lse
    head_dim, head_dim_v = _head_dim(D), _head_dim(DV)
    flags = dict(
        IS_CAUSAL=bool(is_causal),
        HAS_Q_T=q_t is not None,
        HAS_K_T=k_t is not None,
        HAS_V_T=v_t is not None,
        DOT_PRECISION=_dot_precision(q.dtype),
    )
    key = ("fwd", max(head_dim, head_dim_v), q.dtype, tuple(flags.values()), q.device.index)
    _launch(
        attn_fwd_kernel,
        lambda c: (triton.cdiv(Lq, c.BLOCK_M), B * H),
        configs.fwd(max(head_dim, head_dim_v), q.dtype, tangent),
        key,
        Q=q, K=k, V=v, O=o, LSE=lse,
        # absent tangents: any valid pointer, never read (the HAS_* switches are compile-time)
        Q_T=q if q_t is None else q_t, K_T=k if k_t is None else k_t,
        V_T=v if v_t is None else v_t, O_T=o if o_t is None else o_t,
        **_strides(q, "q"), **_strides(k, "k"), **_strides(v, "v"), **_strides(o, "o"),
        **_strides(q_t, "qt"), **_strides(k_t, "kt"), **_strides(v_t, "vt"),
        **_strides(o_t, "ot"),
        scale=scale, H=H, GROUP=H // H_KV, Lq=Lq, Lk=Lk, D=D, DV=DV,
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, **flags,
    )  # fmt: skip
    return o, o_t, lse


def attn_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    scale: float,
    is_causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients dq, dk, dv (shaped and typed like q, k, v) of sum(o * do)."""
    B, H, Lq, D = q.shape
    H_KV, Lk, DV = k.shape[1], k.shape[2], v.shape[3]
    dq = _empty(q.shape, q)
    dk = _empty(k.shape, k)
    dv = _empty(v.shape, v)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    head_dim, head_dim_v = _head_dim(D), _head_dim(DV)
    lse = lse.contiguous()  # the kernels index it as (B * H, Lq); vmap may hand us a view
    delta = _empty((B, H, Lq), q, torch.float32)
    attn_bwd_preprocess_kernel[(triton.cdiv(Lq, configs.PREPROCESS_BLOCK_M), B * H)](
        O=o, DO=do, DELTA=delta, **_strides(o, "o"), **_strides(do, "do"),
        H=H, Lq=Lq, DV=DV, HEAD_DIM_V=head_dim_v, BLOCK_M=configs.PREPROCESS_BLOCK_M,
    )  # fmt: skip
    common = dict(
        Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta,
        **_strides(q, "q"), **_strides(k, "k"), **_strides(v, "v"), **_strides(do, "do"),
        scale=scale, H=H, GROUP=H // H_KV, Lq=Lq, Lk=Lk, D=D, DV=DV,
        HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, IS_CAUSAL=bool(is_causal),
        DOT_PRECISION=_dot_precision(q.dtype),
    )  # fmt: skip
    tile = max(head_dim, head_dim_v)
    key = (tile, q.dtype, bool(is_causal), common["DOT_PRECISION"], q.device.index)
    _launch(
        attn_bwd_dkdv_kernel,
        lambda c: (triton.cdiv(Lk, c.BLOCK_N), B * H_KV),
        configs.bwd_dkdv(tile, q.dtype),
        ("dkdv",) + key,
        DK=dk, DV_OUT=dv, **_strides(dk, "dk"), **_strides(dv, "dv"), H_KV=H_KV, **common,
    )  # fmt: skip
    _launch(
        attn_bwd_dq_kernel,
        lambda c: (triton.cdiv(Lq, c.BLOCK_M), B * H),
        configs.bwd_dq(tile, q.dtype),
        ("dq",) + key,
        DQ=dq, **_strides(dq, "dq"), **common,
    )  # fmt: skip
    return dq, dk, dv
