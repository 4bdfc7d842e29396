"""StarCoder / SantaCoder / GPTBigCode (`GPTBigCodeForCausalLM`): learned absolute position embeddings
(`transformer.wpe`), LayerNorm with bias, GELU-tanh MLP (`c_fc` -> `c_proj`), biases everywhere, tied
embeddings, and multi-query attention (`multi_query: true`, one kv head; `c_attn` = [q | k | v]) or
MHA (`c_attn` laid out per head as [q, k, v], megatron-core's own order).

Config keys: `n_embd`, `n_head`, `n_layer`, `n_inner` (default 4 x n_embd), `n_positions`,
`layer_norm_epsilon`, `activation_function`, `multi_query`, `scale_attn_weights` (must be true),
`vocab_size`, `tie_word_embeddings`. With one kv head at TP > 1 the kv head is replicated
(`models.family.query_groups_for`).
"""

import dataclasses
from typing import Any

from megatron_patch.models.dense import DenseDecoder, DenseNames
from megatron_patch.models.family import UnsupportedConfig


class GPTBigCodeFamily(DenseDecoder):
    name = "gpt_bigcode"
    architectures = ("GPTBigCodeForCausalLM",)
    model_type = "gpt_bigcode"
    names = DenseNames(
        embed="transformer.wte", position_embed="transformer.wpe", layer="transformer.h.{layer}.",
        input_norm="ln_1", qkv="attn.c_attn", attn_out="attn.c_proj", pre_mlp_norm="ln_2",
        mlp_in="mlp.c_fc", mlp_out="mlp.c_proj", final_norm="transformer.ln_f", layer_drops=(),
    )
    norm = "LayerNorm"
    gated_mlp = False
    # GPTBigCodeConfig's defaults for keys a config.json may omit
    defaults = {"multi_query": True, "tie_word_embeddings": True, "layer_norm_epsilon": 1e-5,
                "activation_function": "gelu_pytorch_tanh", "scale_attn_weights": True, "n_positions": 1024}

    def translate(self, config: dict) -> dict:
        if not config["scale_attn_weights"]:
            raise UnsupportedConfig("GPTBigCode scale_attn_weights=false is not supported")
        hidden, heads = int(config["n_embd"]), int(config["n_head"])
        return {**config, "hidden_size": hidden, "num_attention_heads": heads, "num_hidden_layers": config["n_layer"],
                "intermediate_size": config.get("n_inner") or 4 * hidden,
                "num_key_value_heads": 1 if config["multi_query"] else heads, "head_dim": hidden // heads,
                "max_position_embeddings": config["n_positions"], "rms_norm_eps": config["layer_norm_epsilon"],
                "hidden_act": config["activation_function"], "attention_bias": True, "mlp_bias": True}

    def positions(self, c: Any) -> str:
        return "learned"

    def names_for(self, c: Any) -> DenseNames:
        return dataclasses.replace(self.names, qkv_grouped=not c["multi_query"])

    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        out = super().hf_config_from_megatron(config, gpt_kwargs, vocab_size)
        return {"architectures": out["architectures"], "model_type": self.model_type, "vocab_size": vocab_size,
                "n_embd": config.hidden_size, "n_head": config.num_attention_heads, "n_layer": config.num_layers,
                "n_inner": config.ffn_hidden_size, "layer_norm_epsilon": config.layernorm_epsilon,
                "activation_function": out["hidden_act"], "multi_query": config.num_query_groups == 1,
                "initializer_range": config.init_method_std, "tie_word_embeddings": out["tie_word_embeddings"]}


FAMILY = GPTBigCodeFamily()
