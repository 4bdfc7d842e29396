"""Falcon (`FalconForCausalLM`; the original remote-code `RWForCausalLM` configs too): rotary, LayerNorm
with bias, GELU MLP (`dense_h_to_4h` -> `dense_4h_to_h`, width `ffn_hidden_size` or 4 x hidden),
optional biases (`bias`), tied embeddings by default, and three block shapes:

- Falcon-7B (`parallel_attn`, `multi_query`): attention and MLP read the same `input_layernorm` output
  and are summed into the residual (`modules/parallel_attn.py`, shared norm); one kv head.
- Falcon-40B/180B (`new_decoder_architecture`, `num_kv_heads`): `ln_attn` and `ln_mlp` on the layer
  input, attention and MLP in parallel (separate norms); Falcon2-11B's `num_ln_in_parallel_attn: 1`
  shares one norm.
- `parallel_attn: false`: sequential blocks (`input_layernorm`, `post_attention_layernorm`).

`query_key_value` is, in every shape, grouped per kv head as [its q heads, k, v] (MHA: per head
[q, k, v]; MQA: [all q, k, v]) — megatron-core's own `linear_qkv` order — so it is split over TP by whole
groups and otherwise copied. `alibi: true` (Falcon-RW) is refused: Falcon scales its ALiBi bias with
the scores, unlike Bloom. At TP larger than the kv heads (Falcon-7B at TP=2) the kv heads are
replicated (`models.family.query_groups_for`).
"""

import dataclasses
from typing import Any

from megatron_patch.models.dense import DenseDecoder, DenseNames
from megatron_patch.models.family import UnsupportedConfig


class FalconFamily(DenseDecoder):
    name = "falcon"
    architectures = ("FalconForCausalLM", "RWForCausalLM")
    model_type = "falcon"
    names = DenseNames(
        embed="transformer.word_embeddings", layer="transformer.h.{layer}.",
        qkv="self_attention.query_key_value", qkv_grouped=True, attn_out="self_attention.dense",
        mlp_in="mlp.dense_h_to_4h", mlp_out="mlp.dense_4h_to_h", final_norm="transformer.ln_f", layer_drops=(),
    )
    norm = "LayerNorm"
    gated_mlp = False
    # FalconConfig's defaults for keys a config.json may omit
    defaults = {"multi_query": True, "parallel_attn": True, "new_decoder_architecture": False, "bias": False,
                "alibi": False, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "activation": "gelu",
                "num_ln_in_parallel_attn": None, "max_position_embeddings": 2048}

    def translate(self, config: dict) -> dict:
        if config["alibi"]:
            raise UnsupportedConfig("Falcon alibi=true (Falcon-RW) is not supported: its ALiBi bias is scaled with "
                                    "the attention scores")
        if config["new_decoder_architecture"] and not config["parallel_attn"]:
            raise UnsupportedConfig("Falcon new_decoder_architecture with parallel_attn=false is not supported")
        hidden = int(config["hidden_size"])
        heads = int(config.get("num_attention_heads") or config["n_head"])
        if config["new_decoder_architecture"]:
            kv = config.get("num_kv_heads") or config.get("n_head_kv") or heads
        else:
            kv = 1 if config["multi_query"] else heads
        return {**config, "num_attention_heads": heads, "num_key_value_heads": int(kv), "head_dim": hidden // heads,
                "num_hidden_layers": config.get("num_hidden_layers") or config["n_layer"],
                "intermediate_size": config.get("ffn_hidden_size") or 4 * hidden,
                "rms_norm_eps": config["layer_norm_epsilon"], "hidden_act": config["activation"],
                "attention_bias": config["bias"], "mlp_bias": config["bias"]}

    def parallel_attention(self, c: Any) -> str | None:
        if not c["parallel_attn"]:
            return None
        two = c["new_decoder_architecture"] and (c["num_ln_in_parallel_attn"] or 2) == 2
        return "separate" if two else "shared"

    def names_for(self, c: Any) -> DenseNames:
        if self.parallel_attention(c) == "separate":
            return dataclasses.replace(self.names, input_norm="ln_attn", pre_mlp_norm="ln_mlp")
        return self.names


FAMILY = FalconFamily()
