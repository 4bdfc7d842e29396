"""Every tiny config (LLaMA variants and the other LLaMA-shaped families): logits of the converted
megatron-core model vs HF transformers, CPU fp32 (max abs <= 1e-5)."""

import pytest
import torch

from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
from megatron_patch.conversion.verify import fixed_prompts, megatron_logits
from megatron_patch.models import Layout, build_model
from tests.models import FAMILY_VARIANTS, LLAMA_VARIANTS, any_config, hf_model


@pytest.mark.parametrize("variant", sorted(LLAMA_VARIANTS) + sorted(FAMILY_VARIANTS))
def test_logits_match_transformers(cpu_megatron, variant):
    cfg = any_config(variant)
    hf = hf_model(cfg)
    sd = hf.state_dict()
    ranks = hf_to_megatron(make_plan(cfg, Layout()), sd.__getitem__, sd.keys())
    model = build_model(cfg).eval()
    load_rank_state_dict(model, ranks[(0, 0)])
    ids = fixed_prompts(cfg["vocab_size"], batch=3, seq=48)
    with torch.no_grad():
        ref = hf(ids).logits
    out = megatron_logits(model, ids, cfg["vocab_size"])
    assert out.shape == ref.shape
    diff = (out - ref).abs().max().item()
    assert diff <= 1e-5, f"{variant}: max abs logit diff {diff}"
    # the model is not trivially constant: logits vary across positions and vocab
    assert ref.std() > 0.1
