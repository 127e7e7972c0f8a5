"""flash_jvp: fused Triton attention with forward-mode AD (JVP) and backward.

``flash_jvp.attention`` (alias ``scaled_dot_product_attention``) is a drop-in for
``torch.nn.functional.scaled_dot_product_attention`` that also works under
``torch.func.jvp`` and ``torch.autograd.forward_ad``; ``flash_jvp.varlen_attention`` takes
packed variable-length batches.
"""

from .api import attention, scaled_dot_product_attention, supports, varlen_attention
from .integrations.sdpa import patch_sdpa as patch_sdpa

__version__ = "0.1.0"
__all__ = [
    "attention",
    "scaled_dot_product_attention",
    "supports",
    "varlen_attention",
    "__version__",
]
