"""Qwen families on the LLaMA math -> megatron-core `GPTModel`:

- `Qwen2ForCausalLM` (Qwen2, Qwen2.5): biases on q/k/v only (`add_qkv_bias`), tied embeddings on the
  small sizes; sliding-window attention must be off (`use_sliding_window: false`, as released).
- `Qwen3ForCausalLM`: per-head RMSNorm of queries and keys (`q_norm`/`k_norm` -> `qk_layernorm`),
  explicit `head_dim`, no biases.

Checkpoint names are LLaMA's, plus `self_attn.{q,k,v}_proj.bias` (Qwen2) and
`self_attn.{q,k}_norm.weight` (Qwen3).
"""

from __future__ import annotations

from typing import Any

from megatron_patch.models.family import UnsupportedConfig, cfg_get
from megatron_patch.models.llama import LlamaFamily


class Qwen2Family(LlamaFamily):
    name = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    model_type = "qwen2"

    def qkv_bias(self, c: Any) -> bool:
        return True

    def linear_bias(self, c: Any) -> bool:
        return False

    def config_kwargs(self, c: Any) -> dict:
        if cfg_get(c, "use_sliding_window", False):
            raise UnsupportedConfig("use_sliding_window=true: Qwen2 sliding-window attention is not supported")
        return super().config_kwargs(c)

    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        out = super().hf_config_from_megatron(config, gpt_kwargs, vocab_size)
        for key in ("attention_bias", "mlp_bias", "head_dim"):
            out.pop(key)
        return {**out, "use_sliding_window": False}


class Qwen3Family(LlamaFamily):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    model_type = "qwen3"

    def qk_layernorm(self, c: Any) -> bool:
        return True

    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        out = super().hf_config_from_megatron(config, gpt_kwargs, vocab_size)
        out.pop("mlp_bias")
        return out


QWEN2 = Qwen2Family()
QWEN3 = Qwen3Family()
