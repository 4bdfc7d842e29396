"""Test configs derived from the repo's tiny LLaMA, and helpers around `megatron_patch.testing`."""

from __future__ import annotations

from megatron_patch.models.registry import load_hf_config
from megatron_patch.testing import TINY_LLAMA
from megatron_patch.testing import random_hf_model as hf_model  # noqa: F401 (re-exported)

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


def save_hf(model, path: str) -> str:
    model.save_pretrained(path)
    return path
