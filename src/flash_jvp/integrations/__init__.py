"""Ways into models that call attention through a library, each in its own module.

* :mod:`flash_jvp.integrations.sdpa`: :func:`flash_jvp.patch_sdpa` routes
  ``torch.nn.functional.scaled_dot_product_attention`` to flash_jvp (timm, diffusers' default
  processors, transformers' ``"sdpa"``, hand-written DiTs, ``nn.TransformerEncoderLayer``
  in training).
* :mod:`flash_jvp.integrations.diffusers`: importing it registers the diffusers attention
  backend ``"flash_jvp"`` (``model.set_attention_backend("flash_jvp")``).
* :mod:`flash_jvp.integrations.transformers`: importing it registers the transformers
  attention implementation ``"jvp_attention"`` (``attn_implementation="jvp_attention"``).

The optional libraries are imported only by their own module.
"""
