"""The diffusers attention backend ``"flash_jvp"``.

Importing this module registers it (needs diffusers; checked against 0.42)::

    import flash_jvp.integrations.diffusers  # noqa: F401

    transformer.set_attention_backend("flash_jvp")  # this model, from now on
    # or, for the block of code, every model whose processors dispatch:
    with diffusers.attention_backend("flash_jvp"):
        ...

Only processors that call ``dispatch_attention_fn`` (``models/attention_dispatch.py``) use
diffusers' backends: those of Flux, Flux 2, Wan, QwenImage, HunyuanVideo, LTX-Video, Cosmos and
other models built on ``AttentionModuleMixin``. ``AttnProcessor2_0`` and
``JointAttnProcessor2_0`` (DiT, PixArt, SD3; ``models/attention_processor.py``) call
``F.scaled_dot_product_attention`` directly, so ``set_attention_backend`` changes nothing
there: use :func:`flash_jvp.patch_sdpa` for them (it also reaches the default ``"native"``
backend). ``DIFFUSERS_ATTN_BACKEND=flash_jvp`` cannot work, as diffusers reads it before this
module can register the name.

diffusers' backend names are the members of the Enum ``AttentionBackendName``, which has no
way to add one; this module adds the member ``FLASH_JVP = "flash_jvp"`` to it (through the Enum's
own tables; tested on Python 3.10 to 3.13) and registers the function through diffusers'
``_AttentionBackendRegistry.register``, as diffusers registers its own backends.
"""

from __future__ import annotations

import enum

import torch

from .. import api

try:
    from diffusers.models import attention_dispatch as _dispatch
except ImportError as e:
    raise ImportError(
        "flash_jvp.integrations.diffusers needs diffusers: pip install 'flash_jvp[integrations]'"
    ) from e

BACKEND = "flash_jvp"


def flash_jvp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config=None,
) -> torch.Tensor:
    """diffusers' backend calling convention over :func:`flash_jvp.attention`.

    Args:
        query: ``(B, Lq, Hq, E)`` (diffusers' layout: sequence before heads).
        key, value: ``(B, Lk, Hkv, E)``, ``(B, Lk, Hkv, Ev)``.
        attn_mask: anything :func:`flash_jvp.attention` takes for ``(B, Hq, Lq, Lk)`` scores,
            or a ``(B, Lk)`` key-padding mask, read as ``(B, 1, 1, Lk)`` (as diffusers'
            ``"native"`` backend does; a 2-D mask is taken as ``(Lq, Lk)`` unless its shape is
            ``(B, Lk)``). Boolean (True = attend) or additive.
        dropout_p, is_causal, scale, enable_gqa: as in SDPA.
        return_lse: must be False.
        _parallel_config: must be None (no context parallelism).

    Returns:
        ``(B, Lq, Hq, Ev)``.

    Calls :func:`flash_jvp.supports` refuses (``dropout_p > 0``, float64 under Triton's
    interpreter, ...) go to ``torch.nn.functional.scaled_dot_product_attention``, as in
    diffusers' ``"native"`` backend.

    Raises:
        NotImplementedError: ``return_lse=True`` (the log-sum-exp output is not available yet)
            or a context-parallel config.
    """
    if return_lse:
        raise NotImplementedError(
            "The flash_jvp attention backend does not return the log-sum-exp yet "
            "(return_lse=True); use the 'native' backend for this call."
        )
    if _parallel_config is not None:
        raise NotImplementedError(
            "The flash_jvp attention backend does not support diffusers' context parallelism."
        )
    if (
        attn_mask is not None
        and attn_mask.dim() == 2
        and attn_mask.shape == (query.shape[0], key.shape[1])
    ):
        attn_mask = attn_mask[:, None, None, :]
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # views: read through strides
    kwargs = dict(
        attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )  # fmt: skip
    if api.supports(q, k, v, **kwargs):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    else:
        o = api.attention(q, k, v, **kwargs)
    return o.transpose(1, 2)


def _add_member(names: type[enum.Enum], name: str, value: str) -> enum.Enum:
    """Add ``name = value`` to the str Enum ``names`` as if it had been declared there."""
    member = str.__new__(names, value)
    member._name_, member._value_ = name, value
    member._sort_order_ = len(names._member_names_)
    member.__objclass__ = names
    names._member_names_.append(name)
    names._member_map_[name] = member
    names._value2member_map_[value] = member
    type.__setattr__(names, name, member)
    if names(value) is not member or names[name] is not member:
        raise RuntimeError(
            f"Could not add {name} to diffusers' {names.__name__} on this Python; use "
            "flash_jvp.patch_sdpa() instead of the diffusers backend."
        )
    return member


def _register() -> enum.Enum:
    names = _dispatch.AttentionBackendName
    member = names._value2member_map_.get(BACKEND) or _add_member(names, "FLASH_JVP", BACKEND)
    registry = _dispatch._AttentionBackendRegistry
    if member not in registry._backends:
        registry.register(member)(flash_jvp_attention)
    return member


BACKEND_NAME = _register()
"""The ``AttentionBackendName`` member for ``"flash_jvp"``."""
