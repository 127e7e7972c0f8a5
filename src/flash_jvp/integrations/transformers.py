"""The transformers attention implementation ``"jvp_attention"``.

Importing this module registers it (needs transformers 5; checked against 5.24)::

    import flash_jvp.integrations.transformers  # noqa: F401

    model = AutoModel.from_pretrained(name, attn_implementation="jvp_attention")
    model.set_attn_implementation("jvp_attention")  # or switch a loaded model

It works in every model that supports ``attn_implementation="sdpa"``: the same masks (transformers'
``sdpa_mask``, registered for this name through ``AttentionMaskInterface``: boolean
``(B, 1, Lq, Lk)``, or None with ``is_causal``), the same ``is_causal`` rule, grouped-query
attention without repeating key/value heads. The name cannot contain "flash": transformers
treats every such name as a flash-attention variant (``is_flash_attention_requested`` in
``utils/generic.py`` tests ``"flash" in name``) and tries to load a flash-attn kernel for it.

Calls that flash_jvp does not serve run transformers' own ``"sdpa"`` function with the same
arguments: dropout in training (``dropout > 0``), ``position_bias`` (T5-style relative biases),
``output_attentions=True`` (no weights are returned either way), and whatever
:func:`flash_jvp.supports` refuses. Under forward-mode AD those need torch's math backend
(``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``), or a config without dropout. Logit
soft-capping (``softcap``) and attention sinks (``s_aux``, ``sinks``) raise
``NotImplementedError`` (``"sdpa"`` ignores them in some versions, refuses them in others).
Use it only with models that support ``"sdpa"``: transformers does not check that for a
registered name.
"""

from __future__ import annotations

import torch

from .. import api

try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:
    raise ImportError(
        "flash_jvp.integrations.transformers needs transformers >= 5: "
        "pip install 'flash_jvp[integrations]'"
    ) from e

ATTN_IMPLEMENTATION = "jvp_attention"

# what transformers' "sdpa" ignores (or, in some versions, refuses) and flash_jvp cannot compute
_REFUSED = {
    "softcap": "attention-logit soft-capping, as in Gemma 2",
    "s_aux": "attention sinks, as in gpt-oss",
    "sinks": "attention sinks",
}


def jvp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function convention over :func:`flash_jvp.attention`.

    Args:
        module: the attention layer (its ``is_causal`` is the default for ``is_causal``).
        query: ``(B, Hq, Lq, E)``.
        key, value: ``(B, Hkv, Lk, E)``, ``(B, Hkv, Lk, Ev)``; ``Hq`` a multiple of ``Hkv``.
        attention_mask: None, or a 4-D boolean (True = attend) or additive mask broadcasting to
            ``(B, Hq, Lq, Lk)``. Query rows with no visible key (left padding under a causal
            mask) give zeros.
        dropout: attention dropout probability; calls with ``dropout > 0`` run ``"sdpa"``.
        scaling: score scale (default ``1 / sqrt(E)``).
        is_causal: as in transformers' ``"sdpa"``: causal only without a mask and with more
            than one query.
        kwargs: other keywords of the model's call; those ``"sdpa"`` ignores (``position_ids``,
            ``sliding_window``, which the mask already holds, ...) are ignored here too.

    Returns:
        ``(B, Lq, Hq, Ev)`` and None (no attention weights).
    """
    for name in _REFUSED:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"attn_implementation={ATTN_IMPLEMENTATION!r} does not support {name} "
                f"({_REFUSED[name]}), which this model passes; use 'eager' for it."
            )
    if kwargs.get("position_bias") is not None or kwargs.get("output_attentions"):
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    options = dict(
        attn_mask=attention_mask, dropout_p=dropout, is_causal=causal, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )  # fmt: skip
    if api.supports(query, key, value, **options):
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    return api.attention(query, key, value, **options).transpose(1, 2).contiguous(), None


def _sdpa(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    return sdpa_attention_forward(
        module, query, key, value, attention_mask,
        dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs,
    )  # fmt: skip


AttentionInterface.register(ATTN_IMPLEMENTATION, jvp_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
