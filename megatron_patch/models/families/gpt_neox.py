"""GPT-NeoX (`GPTNeoXForCausalLM`: GPT-NeoX-20B, Pythia, and models trained with the GPT-NeoX library):
LayerNorm with bias, rotary embeddings on the first `rotary_pct` of each head's dims (rotate-half:
megatron-core `rotary_percent`), a plain GELU MLP (`dense_h_to_4h` -> `dense_4h_to_h`) with biases,
attention biases per `attention_bias` (`modules/attn_bias.py` when false: megatron-core ties the
attention output's bias to the MLP's), untied `embed_out` by default, and two block shapes:

- `use_parallel_residual: true` (every released model): `x + attn(input_layernorm(x)) +
  mlp(post_attention_layernorm(x))` (`modules/parallel_attn.py`, separate norms);
- `use_parallel_residual: false`: sequential pre-norm blocks.

The fused `query_key_value` is laid out per head as [q, k, v] — megatron-core's own `linear_qkv` order
for MHA — so it is split over TP by whole heads and otherwise copied.

Config keys: `hidden_size`, `num_attention_heads`, `num_hidden_layers`, `intermediate_size`, `hidden_act`,
`layer_norm_eps`, `use_parallel_residual`, `attention_bias`, `rotary_pct` + `rotary_emb_base` (or
transformers 5's `rope_parameters` with `partial_rotary_factor` and `rope_theta`), `rope_scaling`
(linear, dynamic), `max_position_embeddings`, `tie_word_embeddings`, `vocab_size`. Checkpoint names:
`gpt_neox.embed_in`, `gpt_neox.layers.N.{input_layernorm, attention.query_key_value, attention.dense,
post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h}`, `gpt_neox.final_layer_norm`,
`embed_out` (what transformers writes; it holds it as `lm_head` in memory); the buffers old exports
store (`attention.bias`, `attention.masked_bias`, `attention.rotary_emb.inv_freq`) are dropped.
"""

from typing import Any

from megatron_patch.models.dense import DenseDecoder, DenseNames
from megatron_patch.models.family import UnsupportedConfig


class GPTNeoXFamily(DenseDecoder):
    name = "gpt_neox"
    architectures = ("GPTNeoXForCausalLM",)
    model_type = "gpt_neox"
    names = DenseNames(
        embed="gpt_neox.embed_in", layer="gpt_neox.layers.{layer}.", qkv="attention.query_key_value",
        qkv_grouped=True, attn_out="attention.dense", mlp_in="mlp.dense_h_to_4h", mlp_out="mlp.dense_4h_to_h",
        final_norm="gpt_neox.final_layer_norm", lm_head="embed_out",
        layer_drops=("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq"),
    )
    norm = "LayerNorm"
    gated_mlp = False
    # GPTNeoXConfig's defaults for keys a config.json may omit
    defaults = {"use_parallel_residual": True, "attention_bias": True, "tie_word_embeddings": False,
                "layer_norm_eps": 1e-5, "hidden_act": "gelu", "max_position_embeddings": 2048, "rotary_pct": 0.25,
                "rotary_emb_base": 10000}

    def translate(self, config: dict) -> dict:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        params = config.get("rope_parameters") or {}
        return {**config, "num_key_value_heads": heads, "head_dim": hidden // heads,
                "rms_norm_eps": config["layer_norm_eps"],
                "partial_rotary_factor": params.get("partial_rotary_factor", config["rotary_pct"]),
                "rope_theta": params.get("rope_theta", config["rotary_emb_base"])}

    def qkv_bias(self, c: Any) -> bool:
        return bool(c["attention_bias"])

    def attn_out_bias(self, c: Any) -> bool:
        return bool(c["attention_bias"])

    def linear_bias(self, c: Any) -> bool:
        return True

    def parallel_attention(self, c: Any) -> str | None:
        return "separate" if c["use_parallel_residual"] else None

    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        raise UnsupportedConfig("GPT-NeoX: use_parallel_residual (the block shape) is not part of Megatron's config; "
                                "pass the original config.json (--hf-config)")


FAMILY = GPTNeoXFamily()
