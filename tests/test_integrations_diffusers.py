"""diffusers models through flash_jvp: DiT and SD3 (AttnProcessor2_0 / JointAttnProcessor2_0,
reached by patch_sdpa) and Flux (dispatch_attention_fn: the "flash_jvp" backend, and
patch_sdpa through the default "native" backend). Tiny random models, no downloads."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE
from integration_helpers import (
    MODES,
    assert_step_matches,
    converted,
    count_served,
    on_device,
    randn,
    randomize_,
    scm_step,
    served_by_flash,
    via_math_sdpa,
    via_patch_sdpa,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_jvp

diffusers = pytest.importorskip("diffusers", reason="needs diffusers (the integrations extra)")
dispatch = pytest.importorskip("diffusers.models.attention_dispatch")
flash_jvp_diffusers = pytest.importorskip("flash_jvp.integrations.diffusers")

B = 2


@pytest.fixture(autouse=True)
def _keep_active_backend():
    """set_attention_backend also sets diffusers' process-wide active backend: restore it."""
    registry = dispatch._AttentionBackendRegistry
    old = registry._active_backend
    yield
    registry._active_backend = old


def _model(cls, dtype, **config):
    torch.manual_seed(0)
    return randomize_(cls(**config)).to(DEVICE, dtype)


def build_dit(dtype):
    model = _model(
        diffusers.DiTTransformer2DModel,
        dtype,
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        num_layers=2,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    )
    gen = torch.Generator().manual_seed(1)
    x, x_t = randn(B, 4, 8, 8, gen=gen), randn(B, 4, 8, 8, gen=gen)
    t, t_t = torch.rand(B, generator=gen) * 100, torch.ones(B)
    x, x_t, t, t_t, y = on_device((x, x_t, t, t_t, torch.tensor([1, 7])), dtype)

    def fn(x, t):
        return model(x, timestep=t, class_labels=y).sample

    return model, fn, (x, t), (x_t, t_t)


def build_sd3(dtype):
    model = _model(
        diffusers.SD3Transformer2DModel,
        dtype,
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=32,
        out_channels=4,
        pos_embed_max_size=8,
    )
    gen = torch.Generator().manual_seed(1)
    x, x_t = randn(B, 4, 8, 8, gen=gen), randn(B, 4, 8, 8, gen=gen)
    text, pooled = randn(B, 8, 32, gen=gen), randn(B, 32, gen=gen)
    t, t_t = torch.rand(B, generator=gen) * 1000, torch.ones(B)
    x, x_t, t, t_t, text, pooled = on_device((x, x_t, t, t_t, text, pooled), dtype)

    def fn(x, t):
        return model(x, text, pooled, timestep=t).sample

    return model, fn, (x, t), (x_t, t_t)


def build_flux(dtype):
    model = _model(
        diffusers.FluxTransformer2DModel,
        dtype,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 4, 8),
    )
    gen = torch.Generator().manual_seed(1)
    x, x_t = randn(B, 16, 4, gen=gen), randn(B, 16, 4, gen=gen)
    text, pooled = randn(B, 8, 32, gen=gen), randn(B, 32, gen=gen)
    img_ids = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij"), -1)
    img_ids = torch.cat([torch.zeros(16, 1), img_ids.reshape(16, 2).float()], 1)
    t, t_t = torch.rand(B, generator=gen), torch.ones(B)
    x, x_t, t, t_t, text, pooled, img_ids, txt_ids = on_device(
        (x, x_t, t, t_t, text, pooled, img_ids, torch.zeros(8, 3)), dtype
    )

    def fn(x, t):
        return model(x, text, pooled, timestep=t, img_ids=img_ids, txt_ids=txt_ids).sample

    return model, fn, (x, t), (x_t, t_t)


def via_backend(name):
    def run(model, fn, primals, tangents):
        with dispatch.attention_backend(name), sdpa_kernel(SDPBackend.MATH):
            return scm_step(model, fn, primals, tangents)

    return run


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("build, calls", [(build_dit, 2), (build_sd3, 2)], ids=["dit", "sd3"])
def test_patch_sdpa_attn_processor(mode, build, calls, monkeypatch):
    """DiT / SD3: jvp and sCM-loss gradients through patch_sdpa equal math SDPA's."""
    log = count_served(monkeypatch)
    assert_step_matches(mode, build, served_by_flash(log, calls, via_patch_sdpa), via_math_sdpa)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("build", [build_dit, build_sd3, build_flux], ids=["dit", "sd3", "flux"])
def test_converted_layers(mode, build, monkeypatch):
    """An unchanged diffusers model converted to flash_jvp.nn (its LayerNorms, Linears, SiLUs
    and GELUs): jvp and sCM-loss gradients equal math SDPA's on the unconverted model."""
    assert_step_matches(mode, build, converted(mode, monkeypatch), via_math_sdpa)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("route", ["backend", "patch_sdpa"])
def test_flux(mode, route, monkeypatch):
    """Flux (one double-stream and one single-stream block): the "flash_jvp" backend, and
    patch_sdpa under the default "native" backend, equal the native backend on math SDPA."""
    log = count_served(monkeypatch)
    run = via_backend("flash_jvp") if route == "backend" else via_patch_sdpa
    assert_step_matches(mode, build_flux, served_by_flash(log, 2, run), via_backend("native"))


def test_set_attention_backend_selects_flash_jvp(monkeypatch):
    """model.set_attention_backend("flash_jvp") routes a Flux model's attention to flash_jvp
    and leaves a DiT's AttnProcessor2_0, which calls F.scaled_dot_product_attention, as it is
    (what the module's docstring tells users)."""
    log = count_served(monkeypatch)
    names = dispatch.AttentionBackendName
    assert names("flash_jvp") is flash_jvp_diffusers.BACKEND_NAME
    assert "flash_jvp" in {m.value for m in names.__members__.values()}
    for build, expected in ((build_flux, "flash_jvp"), (build_dit, "torch")):
        model, fn, primals, _ = build(torch.float32)
        model.set_attention_backend("flash_jvp")
        log.clear()
        with torch.no_grad():
            fn(*primals)
        assert log == [expected] * 2, (build.__name__, log)


def _bshd(*shape, gen):
    return randn(*shape, gen=gen).to(DEVICE)


@pytest.mark.parametrize(
    "mask_kind", ["none", "key_padding_2d", "bool_4d", "additive_4d", "causal"]
)
def test_backend_function_matches_native(mask_kind, monkeypatch):
    """The backend's layout ((B, S, H, D) in and out) and masks equal diffusers' "native"
    backend; the 2-D (B, Lk) mask is key padding, as native reads it."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (_bshd(2, n, 2, 8, gen=gen) for n in (5, 7, 7))
    kwargs = {}
    if mask_kind == "key_padding_2d":
        kwargs["attn_mask"] = torch.tensor([[True] * 7, [True] * 4 + [False] * 3], device=DEVICE)
    elif mask_kind == "bool_4d":
        kwargs["attn_mask"] = torch.rand(2, 1, 5, 7, generator=gen).to(DEVICE) > 0.3
        kwargs["attn_mask"][..., 0] = True
    elif mask_kind == "additive_4d":
        kwargs["attn_mask"] = _bshd(2, 2, 5, 7, gen=gen)
    elif mask_kind == "causal":
        kwargs["is_causal"] = True
    native = dispatch._AttentionBackendRegistry._backends[dispatch.AttentionBackendName.NATIVE]
    with sdpa_kernel(SDPBackend.MATH):
        ref = native(q.double(), k.double(), v.double(), **kwargs)
    log = count_served(monkeypatch)
    o = flash_jvp_diffusers.flash_jvp_attention(q, k, v, **kwargs)
    assert log == ["flash_jvp"]
    assert o.shape == ref.shape == (2, 5, 2, 8)
    err = (o.double() - ref).norm() / ref.norm()
    assert err <= 1e-5, f"{mask_kind}: rel err {err:.2e}"


def test_backend_refusals_and_handback(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (_bshd(1, 4, 2, 8, gen=gen) for _ in range(3))
    with pytest.raises(NotImplementedError, match="return_lse"):
        flash_jvp_diffusers.flash_jvp_attention(q, k, v, return_lse=True)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        flash_jvp_diffusers.flash_jvp_attention(q, k, v, _parallel_config=object())
    log = count_served(monkeypatch)
    flash_jvp_diffusers.flash_jvp_attention(q, k, v, dropout_p=0.5)
    assert log == ["torch"], "dropout is handed to torch's SDPA"
    assert flash_jvp.supports(q, k, v, dropout_p=0.5)
