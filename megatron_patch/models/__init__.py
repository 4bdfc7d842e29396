"""Model families: HF config -> megatron-core GPTModel, layer specs and weight maps."""

from megatron_patch.models.build import build_model, transformer_config
from megatron_patch.models.family import Layout, ModelFamily, UnsupportedConfig, padded_vocab_size
from megatron_patch.models.registry import families, get_family, load_hf_config, register, vocab_size

__all__ = [
    "Layout", "ModelFamily", "UnsupportedConfig", "build_model", "families", "get_family",
    "load_hf_config", "padded_vocab_size", "register", "transformer_config", "vocab_size",
]
