"""Bloom (`BloomForCausalLM`): ALiBi attention (no position embedding; `modules/alibi.py`), a LayerNorm
on the word embeddings (`modules/embedding_norm.py`), LayerNorm with bias everywhere, biases on every
linear layer, GELU-tanh MLP of width 4 x hidden, tied embeddings. The fused `query_key_value` is laid
out per head as [q, k, v] — megatron-core's own `linear_qkv` order for MHA — so it is split over TP by
whole heads and otherwise copied.

Config keys: `hidden_size` (or `n_embed`), `n_head`, `n_layer`, `layer_norm_epsilon`, `vocab_size`;
`apply_residual_connection_post_layernorm` must be false (as in every release).
"""

from typing import Any

from megatron_patch.models.dense import DenseDecoder, DenseNames
from megatron_patch.models.family import UnsupportedConfig


class BloomFamily(DenseDecoder):
    name = "bloom"
    architectures = ("BloomForCausalLM",)
    model_type = "bloom"
    names = DenseNames(
        embed="transformer.word_embeddings", embed_norm="transformer.word_embeddings_layernorm",
        layer="transformer.h.{layer}.", qkv="self_attention.query_key_value", qkv_grouped=True,
        attn_out="self_attention.dense", mlp_in="mlp.dense_h_to_4h", mlp_out="mlp.dense_4h_to_h",
        final_norm="transformer.ln_f", layer_drops=(),
    )
    norm = "LayerNorm"
    gated_mlp = False
    embedding_norm = True
    defaults = {"tie_word_embeddings": True, "layer_norm_epsilon": 1e-5}

    def translate(self, config: dict) -> dict:
        if config.get("apply_residual_connection_post_layernorm", False):
            raise UnsupportedConfig("Bloom apply_residual_connection_post_layernorm=true is not supported")
        hidden = int(config.get("hidden_size") or config["n_embed"])
        return {**config, "hidden_size": hidden, "intermediate_size": 4 * hidden,
                "num_attention_heads": config.get("n_head", config.get("num_attention_heads")),
                "num_hidden_layers": config.get("n_layer", config.get("num_hidden_layers")),
                "rms_norm_eps": config["layer_norm_epsilon"], "hidden_act": "gelu_pytorch_tanh",
                "attention_bias": True, "mlp_bias": True, "head_dim": None}

    def positions(self, c: Any) -> str:
        return "alibi"

    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        return {"architectures": list(self.architectures), "model_type": self.model_type, "vocab_size": vocab_size,
                "hidden_size": config.hidden_size, "n_head": config.num_attention_heads, "n_layer": config.num_layers,
                "layer_norm_epsilon": config.layernorm_epsilon, "initializer_range": config.init_method_std,
                "attention_dropout": config.attention_dropout, "hidden_dropout": 0.0,
                "tie_word_embeddings": bool(gpt_kwargs.get("share_embeddings_and_output_weights"))}


FAMILY = BloomFamily()
