"""Tiny random HF models for tests: configs derived from the repo's tiny LLaMA, weights with every
parameter randomised (norm weights too, so a swapped norm cannot hide)."""

from __future__ import annotations

import json
import os

import torch

from megatron_patch.models.registry import load_hf_config

TINY_LLAMA = os.path.join(os.path.dirname(__file__), "..", "megatron_patch", "assets", "tiny_llama.json")

# name -> overrides of the tiny LLaMA config
LLAMA_VARIANTS: dict[str, dict] = {
    "gqa": {},
    "mqa": {"num_key_value_heads": 1},
    "mha": {"num_key_value_heads": 8},
    "tied": {"tie_word_embeddings": True},
    "llama3_rope": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                    "max_position_embeddings": 16384},
    "linear_rope": {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 1000000.0},
    "head_dim": {"head_dim": 16},
    "bias": {"attention_bias": True, "mlp_bias": True},
    "pad_vocab": {"vocab_size": 1100},
}


def llama_config(variant: str = "gqa", **extra) -> dict:
    cfg = load_hf_config(TINY_LLAMA)
    cfg.update(LLAMA_VARIANTS[variant])
    cfg.update(extra)
    return cfg


def hf_model(cfg: dict, seed: int = 0):
    """A transformers model for `cfg` with all parameters drawn from a seeded generator."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            p.copy_(1.0 + noise if "norm" in name else noise)
    return model.eval()


def save_hf(model, path: str) -> str:
    model.save_pretrained(path)
    return path


def write_config(cfg: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(cfg, f)
