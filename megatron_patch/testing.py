"""Tiny random HF models from a config dict, for the demo and the tests (no downloads).

Every parameter is drawn from a seeded generator, norm weights around 1, so a swapped or
mis-mapped tensor always shows up in the logits."""

from __future__ import annotations

import os

import torch

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
TINY_LLAMA = os.path.join(ASSETS, "tiny_llama.json")


def random_hf_model(cfg: dict, seed: int = 0):
    """A `transformers` causal LM for `cfg` (fp32, eager attention) with seeded random weights; a
    `...ForSequenceClassification` (reward model) when `cfg`'s architecture is one."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from megatron_patch.models.reward import is_reward_config

    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if is_reward_config(cfg) else AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation="eager", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1.0 + noise if "norm" in name else noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias: a buffer, not a parameter
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model.eval()
