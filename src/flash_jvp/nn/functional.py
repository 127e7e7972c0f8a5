"""Functional forms of the fused layers: ``F.layer_norm`` / ``F.rms_norm`` with an optional
adaLN modulation (``y * (1 + scale) + shift``) fused in, ``F.gelu``, ``F.silu``,
``F.linear``, and adaLN-Zero's gated residual ``x + gate * y``.

Under forward-mode AD (``torch.func.jvp``, ``torch.autograd.forward_ad``) on CUDA (or the
Triton interpreter) one kernel pass computes y and its tangent, and one pass the backward
through y; elsewhere (CPU, float64, ``torch.compile``, vmap, nested transforms, tangents on
the weights, rows wider than 16384, normalized_shape of more than one dim, modulations that
vary along the normalized rows) the same math runs in plain PyTorch ops.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from ._activation import activation
from ._linear import linear as _linear
from ._norm import norm
from ._residual import gated_residual as _gated_residual

Tensor = torch.Tensor


def _check(name: str, input: Tensor, normalized_shape, eps, params: dict) -> int:
    """Validate as F.layer_norm does, plus the modulation tensors; returns the number of
    normalized dims."""
    if not isinstance(input, Tensor):
        raise TypeError(f"{name}: expected input to be a Tensor, but got {type(input).__name__}")
    shape = ((normalized_shape,) if isinstance(normalized_shape, numbers.Integral)
             else normalized_shape)  # fmt: skip
    if not (isinstance(shape, (tuple, list, torch.Size))
            and all(isinstance(n, numbers.Integral) and not isinstance(n, bool)
                    for n in shape)):  # fmt: skip
        raise TypeError(f"{name}: expected normalized_shape to be an int or a sequence of ints, "
                        f"but got {normalized_shape!r}")  # fmt: skip
    shape = tuple(int(n) for n in shape)
    dims = len(shape)
    if dims == 0 or tuple(input.shape[-dims:]) != shape or input.dim() < dims:
        raise ValueError(
            f"{name}: expected input with shape [*, {', '.join(map(str, shape))}] "
            f"(normalized_shape {list(shape)}), but got input of size {list(input.shape)}"
        )
    if not input.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point input, but got {input.dtype}")
    if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
        raise TypeError(f"{name}: expected eps to be a float, but got {eps!r}")
    for arg, t in params.items():
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected {arg} to be a Tensor or None, but got "
                            f"{type(t).__name__}")  # fmt: skip
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point {arg}, but got {t.dtype}")
        if arg in ("weight", "bias") and tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected {arg} of shape {list(shape)}, but got "
                             f"{list(t.shape)}")  # fmt: skip
        if arg in ("shift", "scale"):
            try:
                torch.broadcast_shapes(t.shape, input.shape)
            except RuntimeError:
                raise ValueError(
                    f"{name}: {arg} of shape {list(t.shape)} does not broadcast to the input's "
                    f"shape {list(input.shape)}"
                ) from None
    return dims


def layer_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    shift: Tensor | None = None,
    scale: Tensor | None = None,
) -> Tensor:
    """``F.layer_norm(input, normalized_shape, weight, bias, eps) * (1 + scale) + shift``.

    Args:
        input: (*, D) (D = normalized_shape; of more dims, the plain-op path), fp16, bf16,
            fp32 (fp64: plain ops).
        weight, bias: (D,) or None, the elementwise affine.
        eps: added to the variance (biased, as ``F.layer_norm``).
        shift, scale: None or broadcasting to input: adaLN modulation, e.g. (B, 1, D) for an
            input (B, L, D). Their forward-mode tangents take part in the JVP.

    Returns: input's shape broadcast with shift's and scale's (as the plain ops give it:
    input's where they broadcast to it); input's dtype promoted with theirs (float32 under
    autocast, which runs layer_norm in float32).

    Raises: ValueError for a shape that does not match normalized_shape, a weight or bias not
    of that shape, or a shift / scale that does not broadcast; TypeError for non-tensors and
    integer input.

    Math: Ba et al. 2016 (LayerNorm), Peebles & Xie 2023 (adaLN); the tangent and backward
    formulas are in ``flash_jvp.kernels.norm``.
    """
    params = {"weight": weight, "bias": bias, "shift": shift, "scale": scale}
    dims = _check("layer_norm", input, normalized_shape, eps, params)
    return norm(input, weight, bias, shift, scale, False, float(eps), dims)


def rms_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    shift: Tensor | None = None,
    scale: Tensor | None = None,
) -> Tensor:
    """``F.rms_norm(input, normalized_shape, weight, eps) * (1 + scale) + shift``:
    ``input / sqrt(mean(input^2) + eps) * weight``, eps None meaning the machine epsilon of
    the dtype it computes in (float32 for fp16 / bf16 input), as in ``F.rms_norm``.
    Arguments, returns and errors as :func:`layer_norm`'s (no bias). Math: Zhang & Sennrich
    2019 (RMSNorm)."""
    params = {"weight": weight, "shift": shift, "scale": scale}
    # eps None: that of the dtype F.rms_norm computes in (at least float32)
    if eps is None and isinstance(input, Tensor) and input.is_floating_point():
        eps = torch.finfo(torch.promote_types(input.dtype, torch.float32)).eps
    dims = _check("rms_norm", input, normalized_shape, eps, params)
    return norm(input, weight, None, shift, scale, True, float(eps), dims)


def gated_residual(input: Tensor, gate: Tensor, update: Tensor) -> Tensor:
    """``input + gate * update`` (adaLN-Zero's gated residual), output and tangent (along all
    three) in one pass; the backward in plain elementwise ops. input, update: the same shape
    (*, D); gate: broadcasting to it with its own last dim D (e.g. (B, 1, D) for (B, L, D)),
    else plain ops. Returns input's shape, the three dtypes promoted. Raises
    ValueError where the shapes do not broadcast. Math: Peebles & Xie 2023 (adaLN-Zero)."""
    for name, t in (("input", input), ("gate", gate), ("update", update)):
        if not isinstance(t, Tensor):
            raise TypeError(f"gated_residual: expected {name} to be a Tensor, but got "
                            f"{type(t).__name__}")  # fmt: skip
    try:
        shape = torch.broadcast_shapes(input.shape, gate.shape, update.shape)
    except RuntimeError:
        raise ValueError(
            f"gated_residual: input {list(input.shape)}, gate {list(gate.shape)} and update "
            f"{list(update.shape)} do not broadcast"
        ) from None
    if shape != input.shape:
        raise ValueError(f"gated_residual: the result's shape {list(shape)} must be input's "
                         f"{list(input.shape)}")  # fmt: skip
    return _gated_residual(input, gate, update)


def linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(input, weight, bias)`` = input W^T + b. Under forward AD with a tangent on
    input only (the usual JVP through a model: weights carry none) one Function computes y
    and y_t = input_t W^T with the casts autocast would make, made once (no GEMM stacking
    yet); its backward is exact in plain GEMMs. Elsewhere (no tangent outside any transform,
    torch.compile, vmap, tangents on weight or bias, float64) it is ``F.linear``, whose
    errors it gives. input (*, in), weight (out, in) (a 1-D weight: ``F.linear``), bias
    (out,) or None -> (*, out)."""
    return _linear(input, weight, bias)


def gelu(input: Tensor, approximate: str = "none") -> Tensor:
    """``F.gelu(input, approximate)`` (``"none"``: x Phi(x); ``"tanh"``: the tanh
    approximation), output and tangent in one pass. input: any shape, fp16 / bf16 / fp32
    (fp64: plain ops); returns input's shape and dtype. Raises ValueError for another
    ``approximate``, TypeError for a non-tensor. Math: Hendrycks & Gimpel 2016; formulas in
    ``flash_jvp.kernels.activation``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', but got {approximate!r}")
    _check_tensor("gelu", input)
    return activation(input, "gelu_tanh" if approximate == "tanh" else "gelu")


def silu(input: Tensor) -> Tensor:
    """``F.silu(input)`` = x sigmoid(x), output and tangent in one pass; as :func:`gelu`.
    Math: Elfwing et al. 2018."""
    _check_tensor("silu", input)
    return activation(input, "silu")


def _check_tensor(name: str, input) -> None:
    if not isinstance(input, Tensor):
        raise TypeError(f"{name}: expected input to be a Tensor, but got {type(input).__name__}")
