"""Route ``torch.nn.functional.scaled_dot_product_attention`` to flash_jvp in unchanged models.

:func:`patch_sdpa` replaces the attribute ``torch.nn.functional.scaled_dot_product_attention``
with a router. Code that looks the name up when it calls (``F.scaled_dot_product_attention(...)``
after ``import torch.nn.functional as F``) reaches the router; code that bound the function
earlier (``from torch.nn.functional import scaled_dot_product_attention`` at import, a default
argument, a dict of functions built at import) keeps torch's, and so does anything that calls
``torch._C._nn.scaled_dot_product_attention`` or the ``aten`` SDPA ops directly.
"""

from __future__ import annotations

import torch
from torch._C._functorch import TransformType, get_interpreter_stack
from torch.autograd import forward_ad as fwAD
from torch.nn import functional as F
from torch.nn.attention.bias import CausalBias

from .. import api

Tensor = torch.Tensor

# Patches in force, oldest first. Each hands the calls it does not serve to `previous`, the
# function it replaced; the newest one's router is torch.nn.functional's attribute.
_active: list[SDPAPatch] = []


def _sdpa_arguments(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    *,
    scale=None,
    enable_gqa=False,
    **extra,
):
    """A call's ``*args, **kwargs`` bound as torch's SDPA binds them (scale and enable_gqa
    keyword-only), by the interpreter, cheaper than ``inspect.Signature.bind``: query, key,
    value, the other arguments by name, and ``extra``, keywords SDPA does not have."""
    options = dict(
        attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )  # fmt: skip
    return query, key, value, options, extra


def _under_forward_ad(query, key, value, attn_mask) -> bool:
    """Whether a call runs under torch.func's forward mode (``jvp``, ``jacfwd``, ``hessian``) or
    one of query, key, value, attn_mask carries a ``torch.autograd.forward_ad`` tangent."""
    stack = get_interpreter_stack()  # None outside every torch.func transform
    if stack is not None and any(i.key() == TransformType.Jvp for i in stack):
        return True
    return any(
        isinstance(x, Tensor)
        and not isinstance(x, CausalBias)
        and fwAD.unpack_dual(x).tangent is not None
        for x in (query, key, value, attn_mask)
    )


class SDPAPatch:
    """An active :func:`patch_sdpa`: a context manager, and ``undo()`` ends it.

    Attributes:
        only_forward_ad: whether only forward-mode calls are routed to flash_jvp.
        previous: the function this patch replaced; it gets every call flash_jvp does not serve.
        active: False once undone.
    """

    def __init__(self, only_forward_ad: bool):
        if not isinstance(only_forward_ad, bool):
            raise TypeError(f"Expected only_forward_ad to be a bool, but got {only_forward_ad!r}.")
        self.only_forward_ad = only_forward_ad
        self.previous = F.scaled_dot_product_attention
        self.active = True
        self.router = self._make_router()
        _active.append(self)
        F.scaled_dot_product_attention = self.router

    def _make_router(self):
        patch = self

        def scaled_dot_product_attention(*args, **kwargs):
            """flash_jvp.patch_sdpa's router: flash_jvp.attention where it serves the call,
            else the SDPA function it replaced, with the same arguments."""
            previous = patch.previous
            if not patch.active:
                return previous(*args, **kwargs)
            try:
                q, k, v, options, extra = _sdpa_arguments(*args, **kwargs)
            except TypeError:  # not an SDPA call: torch reports it
                return previous(*args, **kwargs)
            if extra or options["dropout_p"]:  # the common refusal, before supports()
                return previous(*args, **kwargs)
            # While torch.compile traces, which transforms are active cannot be asked (Dynamo
            # cannot trace functorch's interpreter stack): every call flash_jvp serves is routed.
            if (patch.only_forward_ad and not torch.compiler.is_compiling()
                    and not _under_forward_ad(q, k, v, options["attn_mask"])):  # fmt: skip
                return previous(*args, **kwargs)
            if api.supports(q, k, v, **options):
                return previous(*args, **kwargs)
            return api.attention(q, k, v, **options)

        return scaled_dot_product_attention

    def undo(self) -> None:
        """Restore what this patch replaced; a second call does nothing.

        Patches may be undone in any order: undoing one that a newer patch replaced hands the
        newer one's unserved calls to what this one replaced. If other code replaced
        ``torch.nn.functional.scaled_dot_product_attention`` after this patch, its function
        stays, and this patch's router, which it may call, passes every call through.
        """
        if not self.active:
            return
        self.active = False
        i = _active.index(self)
        del _active[i]
        if i < len(_active):
            newer = _active[i]
            if newer.previous is self.router:
                newer.previous = self.previous
        elif F.scaled_dot_product_attention is self.router:
            F.scaled_dot_product_attention = self.previous

    def __enter__(self) -> SDPAPatch:
        return self

    def __exit__(self, *exc_info) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"SDPAPatch(only_forward_ad={self.only_forward_ad}, active={self.active})"


def patch_sdpa(only_forward_ad: bool = False) -> SDPAPatch:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` to :func:`flash_jvp.attention`.

    Use as a context manager, ``with flash_jvp.patch_sdpa(): ...``, or as a call whose result's
    ``.undo()`` restores the previous function (``patch = flash_jvp.patch_sdpa()`` ...
    ``patch.undo()``). Patches nest and may be undone in any order; a second ``undo()`` does
    nothing. The patch is process-wide (every thread sees it).

    Every call that :func:`flash_jvp.supports` refuses (``dropout_p > 0``, e.g. a
    ``nn.TransformerEncoderLayer`` in training; float64 or bfloat16 under Triton's
    interpreter; a key length of 0; ``attn_mask`` with ``is_causal=True``; a mask dtype
    flash_jvp does not take; ...) or that passes keywords SDPA does not have goes, with the
    same arguments, to the function the patch replaced, so behaviour (and errors) stay
    torch's there.

    Reaches code that looks the function up when it calls it (verified against these
    libraries' sources): timm's ``Attention`` with ``fused_attn`` (``timm/layers/attention.py``,
    ``timm/models/vision_transformer.py``; on by default, off with ``TIMM_FUSED_ATTN=0``);
    diffusers' ``AttnProcessor2_0`` / ``JointAttnProcessor2_0`` (DiT, SD3, PixArt; in
    ``models/attention_processor.py``) and its default ``"native"`` attention backend
    (``dispatch_attention_fn`` in ``models/attention_dispatch.py``: Flux, Wan, QwenImage, ...);
    transformers' ``attn_implementation="sdpa"`` (``integrations/sdpa_attention.py``); torch's
    ``F.multi_head_attention_forward`` when it calls SDPA (``nn.MultiheadAttention`` and
    ``nn.Transformer*Layer`` in training, or whenever the inference fast path is off).

    Does not reach: code that bound the function before the patch (``from
    torch.nn.functional import scaled_dot_product_attention`` at import, a stored reference);
    ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer``'s inference fast path
    (``torch._native_multi_head_attention`` / ``torch._transformer_encoder_layer_fwd``, taken
    in eval mode when no parameter requires grad); the ``aten`` SDPA ops (diffusers' context
    parallelism and its cuDNN/flash backends); non-SDPA attention (eager softmax code,
    flash-attn, xformers, flex attention).

    Args:
        only_forward_ad: route only calls that need forward-mode AD: under a ``torch.func``
            forward-mode transform (``jvp``, ``jacfwd``, ``hessian``), or with a
            ``torch.autograd.forward_ad`` tangent on query, key, value or attn_mask. Other
            calls (inference, a plain training step, ``torch.func.grad``/``vmap`` alone) keep
            torch's SDPA, whose cuDNN and flash backends run the primal forward faster than
            flash_jvp. Inside a function torch.compile traces, every call flash_jvp serves is
            routed (Dynamo cannot trace the check).

    Returns:
        The :class:`SDPAPatch` in force.

    Raises:
        TypeError: ``only_forward_ad`` is not a bool.

    Host time the router adds (measured on a shared 2-core CPU, tiny tensors): a routed call
    pays :func:`flash_jvp.supports` (5-7 us) and the binding of its arguments, 7-12 us in
    all; a call with ``dropout_p > 0`` or unknown keywords is handed back before that
    (about 2 us), and so is a plain call under ``only_forward_ad=True`` (3-5 us).
    """
    return SDPAPatch(only_forward_ad)
