"""Qwen2 / Qwen3: the family-specific tensors land where megatron-core expects them, round trips are
bitwise, and unsupported configs are refused (logits parity: tests/parity/test_parity.py)."""

import pytest
import torch

from megatron_patch.conversion.engine import hf_to_megatron, make_plan, megatron_to_hf
from megatron_patch.models import Layout, get_family
from tests.models import family_config, hf_model


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
