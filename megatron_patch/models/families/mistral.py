"""Mistral (`MistralForCausalLM`): the LLaMA layout (GQA, SwiGLU, RMSNorm, untied) plus sliding-window
attention when `sliding_window` is set (Mistral-7B-v0.1: 4096; v0.2+ and Nemo: null). The window is
megatron-core's `window_size` = (sliding_window - 1, 0), honoured by both implementations (TE's fused
attention, and the local one's masked softmax). Mistral-Nemo's explicit `head_dim` is read.
"""

from typing import Any

from megatron_patch.models.dense import DenseDecoder


class MistralFamily(DenseDecoder):
    name = "mistral"
    architectures = ("MistralForCausalLM",)
    model_type = "mistral"
    defaults = {"sliding_window": 4096}  # MistralConfig's default when the key is absent

    def sliding_window(self, c: Any) -> int | None:
        return c.get("sliding_window")

    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        out = super().hf_config_from_megatron(config, gpt_kwargs, vocab_size)
        for key in ("attention_bias", "mlp_bias"):
            out.pop(key)
        return {"sliding_window": None, **out}
FAMILY = MistralFamily()
