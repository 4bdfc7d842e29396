"""Qwen2 / Qwen3: logits of the converted megatron-core model vs HF transformers, CPU fp32 (<= 1e-5),
and the family-specific tensors land where megatron-core expects them."""

import pytest
import torch

from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan, megatron_to_hf
from megatron_patch.conversion.verify import fixed_prompts, megatron_logits
from megatron_patch.models import Layout, build_model, get_family
from tests.models import FAMILY_VARIANTS, family_config, hf_model


@pytest.mark.parametrize("variant", sorted(FAMILY_VARIANTS))
def test_logits_match_transformers(cpu_megatron, variant):
    cfg = family_config(variant)
    hf = hf_model(cfg)
    sd = hf.state_dict()
    ranks = hf_to_megatron(make_plan(cfg, Layout()), sd.__getitem__, sd.keys())
    model = build_model(cfg).eval()
    load_rank_state_dict(model, ranks[(0, 0)])
    ids = fixed_prompts(cfg["vocab_size"], batch=3, seq=48)
    with torch.no_grad():
        ref = hf(ids).logits
    diff = (megatron_logits(model, ids, cfg["vocab_size"]) - ref).abs().max().item()
    assert diff <= 1e-5, f"{variant}: max abs logit diff {diff}"


@pytest.mark.parametrize("variant", ["qwen2", "qwen3"])
def test_round_trip_tp2_pp2_bitwise(variant):
    cfg = family_config(variant)
    sd = hf_model(cfg).state_dict()
    plan = make_plan(cfg, Layout(2, 2), "transformer_engine")
    ranks = hf_to_megatron(plan, sd.__getitem__, sd.keys())
    names = set(ranks[(0, 0)])
    if variant == "qwen2":
        assert "decoder.layers.0.self_attention.linear_qkv.bias" in names
        assert "decoder.layers.0.self_attention.linear_proj.bias" not in names
    else:
        assert "decoder.layers.0.self_attention.q_layernorm.weight" in names
    back = megatron_to_hf(plan, ranks)
    expected = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # tied
    assert set(back) == set(expected)
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_refusals():
    with pytest.raises(ValueError, match="use_sliding_window"):
        get_family("qwen2").config_kwargs(family_config("qwen2", use_sliding_window=True))
    with pytest.raises(ValueError, match="attention_bias"):
        get_family("qwen3").config_kwargs(family_config("qwen3", attention_bias=True))
