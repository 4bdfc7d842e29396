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


# name -> overrides turning the tiny LLaMA into another LLaMA-shaped family
FAMILY_VARIANTS: dict[str, dict] = {
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True,
              "head_dim": None, "rope_theta": 1000000.0, "use_sliding_window": False},
    "qwen2_untied": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "head_dim": None},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16,
              "tie_word_embeddings": True},
    "qwen3_untied": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_key_value_heads": 4},
}


def family_config(variant: str, **extra) -> dict:
    """A tiny config of another family (see FAMILY_VARIANTS); None values drop the key."""
    cfg = {**llama_config(), **FAMILY_VARIANTS[variant], **extra}
    return {k: v for k, v in cfg.items() if v is not None}


def llama_config(variant: str = "gqa", **extra) -> dict:
    cfg = load_hf_config(TINY_LLAMA)
    cfg.update(LLAMA_VARIANTS[variant])
    cfg.update(extra)
    return cfg


def any_config(variant: str) -> dict:
    """A LLaMA variant or another family's tiny config, by name."""
    return llama_config(variant) if variant in LLAMA_VARIANTS else family_config(variant)


def save_hf(model, path: str) -> str:
    model.save_pretrained(path)
    return path
