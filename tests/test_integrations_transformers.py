"""transformers models through attn_implementation="jvp_attention": a Llama with grouped-query
attention and left padding (fully masked query rows), a Mistral with a sliding window and a
BERT with right padding. Tiny random models, no downloads."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE
from integration_helpers import (
    MODES,
    assert_step_matches,
    count_served,
    on_device,
    randn,
    randomize_,
    scm_step,
    served_by_flash,
    via_math_sdpa,
)

transformers = pytest.importorskip("transformers", reason="needs transformers (integrations extra)")
flash_jvp_transformers = pytest.importorskip("flash_jvp.integrations.transformers")
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

NAME = flash_jvp_transformers.ATTN_IMPLEMENTATION
B, L, HIDDEN = 2, 12, 32


def _model(cls, config, dtype):
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation="sdpa")
    return randomize_(model).to(DEVICE, dtype).train()


def _case(cls, config, dtype, padded):
    """(model, fn, primals, tangents) of the model on embeddings with a padding mask whose
    ``padded`` (batch row, token slice) entries are 0."""
    model = _model(cls, config, dtype)
    padding = torch.ones(B, L, dtype=torch.long)
    padding[padded] = 0
    gen = torch.Generator().manual_seed(1)
    x, x_t = randn(B, L, HIDDEN, gen=gen), randn(B, L, HIDDEN, gen=gen)
    x, x_t, padding = on_device((x, x_t, padding), dtype)

    def fn(x):
        return model(inputs_embeds=x, attention_mask=padding).last_hidden_state

    return model, fn, (x,), (x_t,)


def build_llama(dtype):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    # left padding: under the causal mask, query rows 0-4 see no key
    return _case(transformers.LlamaModel, config, dtype, (1, slice(None, 5)))


def build_mistral_sliding_window(dtype):
    config = transformers.MistralConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        sliding_window=4,
    )
    return _case(transformers.MistralModel, config, dtype, (0, slice(None, 2)))


def build_bert(dtype):
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return _case(transformers.BertModel, config, dtype, (0, slice(9, None)))  # right padding


def via_implementation(name, run):
    def switched(model, *args):
        model.set_attn_implementation(name)
        return run(model, *args)

    return switched


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "build",
    [build_llama, build_mistral_sliding_window, build_bert],
    ids=["llama_gqa", "mistral_sliding_window", "bert"],
)
def test_model(mode, build, monkeypatch):
    """jvp and sCM-loss gradients with attn_implementation="jvp_attention" equal "sdpa" on
    math SDPA, padding masks included (sliding windows arrive as sdpa_mask's boolean mask)."""
    log = count_served(monkeypatch)
    flash = served_by_flash(log, 2, via_implementation(NAME, scm_step))
    assert_step_matches(mode, build, flash, via_implementation("sdpa", via_math_sdpa))


def test_registered_name():
    assert NAME in transformers.AttentionInterface()
    assert NAME in transformers.masking_utils.AttentionMaskInterface()
    # transformers takes a name with "flash" in it for a flash-attn kernel to load
    is_flash = getattr(transformers.utils.generic, "is_flash_attention_requested", None)
    assert is_flash is None or not is_flash(requested_attention_implementation=NAME)


def _qkv(Hq=4, Hkv=2, Lq=6, Lk=6, E=8):
    gen = torch.Generator().manual_seed(2)
    q = randn(2, Hq, Lq, E, gen=gen).to(DEVICE)
    k, v = (randn(2, Hkv, Lk, E, gen=gen).to(DEVICE) for _ in range(2))
    return q, k, v


def _sdpa_reference(module, q, k, v, mask, **kwargs):
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        return sdpa_attention_forward(module, q.double(), k.double(), v.double(), mask, **kwargs)[0]


@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_give_zeros(causal, monkeypatch):
    """A boolean mask with query rows that see no key (as transformers' sdpa_mask makes for
    left padding under a causal mask): zeros there, never NaN; the rest equals "sdpa"."""
    module = torch.nn.Module()
    module.is_causal = causal
    module.num_key_value_groups = 2
    q, k, v = _qkv()
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool, device=DEVICE).tril()
    mask[1, :, :, :3] = False  # batch 1: keys 0-2 are padding; rows 0-2 see no key
    log = count_served(monkeypatch)
    o, weights = flash_jvp_transformers.jvp_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert log == ["flash_jvp"] and weights is None
    assert o.shape == (2, 6, 4, 8) and torch.isfinite(o).all()
    assert (o[1, :3] == 0).all()
    ref = _sdpa_reference(module, q, k, v, mask, scaling=0.3)
    err = (o.double() - ref).norm() / ref.norm()
    assert err <= 1e-5, f"rel err {err:.2e}"


def test_gqa_causal_without_mask_matches_sdpa(monkeypatch):
    """No mask: the layer's is_causal applies (as in "sdpa"), GQA without repeat_kv."""
    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = 2
    q, k, v = _qkv(Lq=5, Lk=7)
    log = count_served(monkeypatch)
    o, _ = flash_jvp_transformers.jvp_attention_forward(module, q, k, v, None)
    assert log == ["flash_jvp"]
    ref = _sdpa_reference(module, q, k, v, None)
    err = (o.double() - ref).norm() / ref.norm()
    assert err <= 1e-5, f"rel err {err:.2e}"


@pytest.mark.parametrize(
    "kwargs",
    [{"dropout": 0.1}, {"output_attentions": True}, {"position_bias": "bias"}],
    ids=["dropout", "output_attentions", "position_bias"],
)
def test_unsupported_options_run_sdpa(kwargs, monkeypatch):
    """Dropout, output_attentions and position_bias calls run transformers' "sdpa" function
    with the same arguments (the test's log sees torch's SDPA serve them)."""
    module = torch.nn.Module()
    module.is_causal = False
    q, k, v = _qkv(Hq=2, Hkv=2)
    if kwargs.get("position_bias") == "bias":
        kwargs = {"position_bias": torch.randn(1, 2, 6, 6, device=DEVICE)}
    log = count_served(monkeypatch)
    torch.manual_seed(5)
    o, weights = flash_jvp_transformers.jvp_attention_forward(module, q, k, v, None, **kwargs)
    assert log == ["torch"] and weights is None
    torch.manual_seed(5)
    ref, _ = sdpa_attention_forward(module, q, k, v, None, **kwargs)
    torch.testing.assert_close(o, ref, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["softcap", "s_aux", "sinks"])
def test_softcap_and_sinks_refused(name):
    module = torch.nn.Module()
    q, k, v = _qkv(Hq=2, Hkv=2)
    with pytest.raises(NotImplementedError, match=name):
        flash_jvp_transformers.jvp_attention_forward(module, q, k, v, None, **{name: 30.0})
