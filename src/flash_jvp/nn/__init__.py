"""Layers whose forward-mode rule computes output and tangent together (fused Triton
kernels), as drop-ins for torch.nn layers in models trained through ``torch.func.jvp``.

* :class:`LayerNorm`, :class:`RMSNorm`: ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` with
  the same parameters and results; ``forward(x, shift=None, scale=None)`` also takes an
  adaLN modulation (``norm(x) * (1 + scale) + shift``) fused into the same pass.
* :class:`GELU`, :class:`SiLU`: ``torch.nn.GELU`` / ``torch.nn.SiLU`` with output and tangent
  in one pass (SiLU's ``inplace`` is not honoured: forward AD needs the input).
* :class:`GatedResidual`: ``forward(x, gate, y) = x + gate * y`` (adaLN-Zero's gate), output
  and tangent in one pass; models written with their own subclass of it (plain ops) get it
  through ``convert(model, types=(TheirSubclass,))``.
* :class:`Linear`: ``torch.nn.Linear`` whose JVP (tangent on the input) is one Function: one
  more GEMM, none of forward AD's per-op host work.
* :func:`convert` swaps them into a model in place (``revert`` undoes it);
  :mod:`flash_jvp.nn.functional` has the functional forms.
"""

from __future__ import annotations

import torch
from torch import nn

from . import functional

__all__ = [
    "GELU",
    "GatedResidual",
    "LayerNorm",
    "Linear",
    "RMSNorm",
    "SiLU",
    "convert",
    "revert",
    "functional",
]

Tensor = torch.Tensor


class LayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` on the fused kernels (:func:`functional.layer_norm`);
    ``forward(x, shift=None, scale=None)`` adds the adaLN modulation."""

    def forward(self, input: Tensor, shift: Tensor | None = None, scale: Tensor | None = None):
        return functional.layer_norm(
            input, self.normalized_shape, self.weight, self.bias, self.eps,
            shift=shift, scale=scale,
        )  # fmt: skip


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` on the fused kernels (:func:`functional.rms_norm`);
    ``forward(x, shift=None, scale=None)`` adds the adaLN modulation."""

    def forward(self, input: Tensor, shift: Tensor | None = None, scale: Tensor | None = None):
        return functional.rms_norm(
            input, self.normalized_shape, self.weight, self.eps, shift=shift, scale=scale
        )


class GELU(nn.GELU):
    """``torch.nn.GELU`` on the fused kernel (:func:`functional.gelu`)."""

    def forward(self, input: Tensor) -> Tensor:
        return functional.gelu(input, self.approximate)


class SiLU(nn.SiLU):
    """``torch.nn.SiLU`` on the fused kernel (:func:`functional.silu`); never in place."""

    def forward(self, input: Tensor) -> Tensor:
        return functional.silu(input)


class Linear(nn.Linear):
    """``torch.nn.Linear`` through :func:`functional.linear`."""

    def forward(self, input: Tensor) -> Tensor:
        return functional.linear(input, self.weight, self.bias)


class GatedResidual(nn.Module):
    """``x + gate * y`` through :func:`functional.gated_residual` (no parameters)."""

    def forward(self, x: Tensor, gate: Tensor, y: Tensor) -> Tensor:
        return functional.gated_residual(x, gate, y)


_FUSED = {nn.LayerNorm: LayerNorm, nn.RMSNorm: RMSNorm, nn.GELU: GELU, nn.SiLU: SiLU,
          nn.Linear: Linear, GatedResidual: GatedResidual}  # fmt: skip


_SUBCLASSES: dict[type, type] = {}


def _fused_class(module: nn.Module, types: tuple[type, ...]) -> type | None:
    """The class a module of ``type(module)`` becomes: the fused layer for the torch.nn
    classes; for a subclass named in ``types``, a subclass of it with the fused forward (so
    its own methods and isinstance checks still hold)."""
    cls = type(module)
    if cls in _FUSED:
        return _FUSED[cls]
    if cls not in types:
        return None
    if cls not in _SUBCLASSES:
        fused = next(f for base, f in _FUSED.items() if issubclass(cls, base))
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {"forward": fused.forward,
                                                       "__module__": cls.__module__})  # fmt: skip
    return _SUBCLASSES[cls]


def convert(model: nn.Module, types: tuple[type, ...] = ()) -> nn.Module:
    """Swap every ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GELU``, ``nn.SiLU`` and ``nn.Linear``
    in ``model`` (and modules of the subclasses named in ``types``, which must compute the
    same function: a subclass with its own forward is otherwise left alone, as is any other
    subclass, e.g. a parametrized module) for the fused layer, in place: the module objects
    stay (parameters, hooks, device, dtype); only their class changes (a subclass in
    ``types`` becomes a subclass of itself with the fused forward). Modules already
    converted are left as they are. Returns the model. :func:`revert` restores the original
    classes (do that before pickling a whole model converted with ``types``: those
    subclasses are made at run time; ``state_dict`` is unaffected).

    Raises: TypeError when ``model`` is not an ``nn.Module`` or ``types`` holds something
    other than subclasses of those classes (or of :class:`GatedResidual`).
    """
    _check_model("convert", model)
    types = (types,) if isinstance(types, type) else tuple(types)
    for t in types:
        if not (isinstance(t, type) and issubclass(t, tuple(_FUSED))):
            raise TypeError(
                "convert: types must be subclasses of nn.LayerNorm, nn.RMSNorm, nn.GELU, "
                f"nn.SiLU, nn.Linear or flash_jvp.nn.GatedResidual, got {t!r}"
            )
    for m in model.modules():
        if "_flash_jvp_original" in m.__dict__:
            continue
        fused = _fused_class(m, types)
        if fused is not None:
            m._flash_jvp_original = type(m)
            m._flash_jvp_fused = fused
            m.__class__ = fused
    return model


def revert(model: nn.Module) -> nn.Module:
    """Undo :func:`convert`: every converted module gets its original class back. A module
    whose class changed since (e.g. ``torch.nn.utils.parametrize`` made a subclass of it)
    stays as it is: swapping its class back would drop that change. Raises TypeError when
    ``model`` is not an ``nn.Module``."""
    _check_model("revert", model)
    for m in model.modules():
        if type(m) is m.__dict__.get("_flash_jvp_fused"):
            m.__class__ = m.__dict__.pop("_flash_jvp_original")
            del m.__dict__["_flash_jvp_fused"]
    return model


def _check_model(name: str, model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{name}: expected model to be a torch.nn.Module, but got "
                        f"{type(model).__name__}")  # fmt: skip
