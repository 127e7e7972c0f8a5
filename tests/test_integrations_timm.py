"""A timm Vision Transformer through patch_sdpa: timm's Attention calls
F.scaled_dot_product_attention when ``fused_attn`` is on (timm's default; TIMM_FUSED_ATTN=0 or
timm.layers.set_fused_attn(False) before building the model turns it off). Tiny random model,
no downloads. Runs where CUDA is: timm imports torchvision, and PyPI's torchvision fails to
import beside torch 2.13's CPU build."""

from __future__ import annotations

import pytest
import torch
from helpers import CUDA, DEVICE
from integration_helpers import (
    MODES,
    assert_step_matches,
    converted,
    count_served,
    on_device,
    randn,
    randomize_,
    served_by_flash,
    via_math_sdpa,
    via_patch_sdpa,
)

if not CUDA:
    pytest.skip(
        "timm needs torchvision, whose PyPI build fails to import beside torch 2.13's CPU "
        "build (operator torchvision::nms does not exist): the timm tests run on CUDA",
        allow_module_level=True,
    )
B = 2


def build_vit(dtype):
    vision_transformer = pytest.importorskip("timm.models.vision_transformer")
    torch.manual_seed(0)
    model = vision_transformer.VisionTransformer(
        img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=10
    )
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = True  # whatever TIMM_FUSED_ATTN says
    model = randomize_(model).to(DEVICE, dtype)
    gen = torch.Generator().manual_seed(1)
    x, x_t = on_device((randn(B, 3, 16, 16, gen=gen), randn(B, 3, 16, 16, gen=gen)), dtype)
    return model, model.forward_features, (x,), (x_t,)


@pytest.mark.parametrize("mode", MODES)
def test_vit(mode, monkeypatch):
    """jvp and sCM-loss gradients of a 2-block ViT (17 tokens) through patch_sdpa equal math
    SDPA's."""
    log = count_served(monkeypatch)
    assert_step_matches(mode, build_vit, served_by_flash(log, 2, via_patch_sdpa), via_math_sdpa)


@pytest.mark.parametrize("mode", MODES)
def test_vit_converted_layers(mode, monkeypatch):
    """The ViT converted to flash_jvp.nn (LayerNorms, Linears, GELUs): jvp and sCM-loss
    gradients equal math SDPA's on the unconverted model."""
    assert_step_matches(mode, build_vit, converted(mode, monkeypatch), via_math_sdpa)
