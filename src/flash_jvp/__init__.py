"""flash_jvp: fused Triton attention with forward-mode AD (JVP) and backward.

``flash_jvp.attention`` (alias ``scaled_dot_product_attention``) is a drop-in for
``torch.nn.functional.scaled_dot_product_attention`` that also works under
``torch.func.jvp`` and ``torch.autograd.forward_ad``; ``flash_jvp.attention_with_lse`` also
returns the log-sum-exp; ``flash_jvp.varlen_attention`` takes packed variable-length batches;
``flash_jvp.patch_sdpa`` routes unchanged models' SDPA calls to flash_jvp.
"""

from .api import (
    attention,
    attention_with_lse,
    scaled_dot_product_attention,
    supports,
    varlen_attention,
)
from .integrations.sdpa import patch_sdpa

__version__ = "0.1.0"
__all__ = [
    "attention",
    "attention_with_lse",
    "patch_sdpa",
    "scaled_dot_product_attention",
    "supports",
    "varlen_attention",
    "__version__",
]


def __getattr__(name: str):
    """``flash_jvp.distributed`` on first use (it imports torch.distributed)."""
    if name == "distributed":
        import importlib

        return importlib.import_module(f"{__name__}.distributed")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
