"""GPT-J (`GPTJForCausalLM`: GPT-J-6B and its fine-tunes): attention and MLP side by side on one
LayerNorm (`ln_1`; `modules/parallel_attn.py`, shared norm), rotary embeddings on the first `rotary_dim`
dims of each head with adjacent pairs rotated (`rotate_every_two`: megatron-core `rotary_interleaved`,
`rotary_percent` = rotary_dim / head_dim; base 10000), separate q/k/v/out projections without biases,
a GELU-tanh MLP (`fc_in` -> `fc_out`, width `n_inner` or 4 x n_embd) with biases, LayerNorm with bias,
and an output layer with a bias (`lm_head.bias`; `modules/output_bias.py`). Attention biases unlike the
MLP's: `modules/attn_bias.py`.

Config keys: `n_embd`, `n_head`, `n_layer`, `n_inner`, `n_positions`, `rotary_dim` (an even number of
dims up to the head size; null is refused: transformers then rotates by the model width, which only
works with one head), `activation_function`, `layer_norm_epsilon`, `tie_word_embeddings`, `vocab_size`.
The causal-mask buffers old exports store (`attn.bias`, `attn.masked_bias`) are dropped.
"""

from typing import Any

from megatron_patch.models.dense import DenseDecoder, DenseNames
from megatron_patch.models.family import UnsupportedConfig


class GPTJFamily(DenseDecoder):
    name = "gptj"
    architectures = ("GPTJForCausalLM",)
    model_type = "gptj"
    names = DenseNames(
        embed="transformer.wte", layer="transformer.h.{layer}.", input_norm="ln_1",
        qkv=("attn.q_proj", "attn.k_proj", "attn.v_proj"), attn_out="attn.out_proj", mlp_in="mlp.fc_in",
        mlp_out="mlp.fc_out", final_norm="transformer.ln_f", layer_drops=("attn.bias", "attn.masked_bias"),
    )
    norm = "LayerNorm"
    gated_mlp = False
    rotary_interleaved = True
    # GPTJConfig's defaults for keys a config.json may omit
    defaults = {"rotary_dim": 64, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
                "tie_word_embeddings": False, "n_positions": 2048, "attn_pdrop": 0.0}

    def translate(self, config: dict) -> dict:
        hidden = int(config.get("n_embd") or config["hidden_size"])
        heads = int(config.get("n_head") or config["num_attention_heads"])
        head_dim = hidden // heads
        rotary = config["rotary_dim"]
        if rotary is None:
            raise UnsupportedConfig("GPT-J rotary_dim=null is not supported (transformers rotates by the model width)")
        rotary = int(rotary)
        if rotary % 2 or not 0 < rotary <= head_dim or int(head_dim * (rotary / head_dim)) != rotary:
            raise UnsupportedConfig(f"GPT-J rotary_dim={rotary}: must be an even number of dims up to the head size "
                                    f"{head_dim}")
        return {**config, "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": heads,
                "head_dim": head_dim, "num_hidden_layers": config.get("n_layer") or config["num_hidden_layers"],
                "intermediate_size": config["n_inner"] or 4 * hidden,
                "max_position_embeddings": config["n_positions"], "rms_norm_eps": config["layer_norm_epsilon"],
                "hidden_act": config["activation_function"], "attention_dropout": config["attn_pdrop"],
                "partial_rotary_factor": rotary / head_dim, "rope_theta": 10000.0, "rope_scaling": None,
                "rope_parameters": None}

    def qkv_bias(self, c: Any) -> bool:
        return False

    def attn_out_bias(self, c: Any) -> bool:
        return False

    def linear_bias(self, c: Any) -> bool:
        return True

    def output_bias(self, c: Any) -> bool:
        return True

    def parallel_attention(self, c: Any) -> str:
        return "shared"

    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        out = super().hf_config_from_megatron(config, gpt_kwargs, vocab_size)
        return {"architectures": out["architectures"], "model_type": self.model_type, "vocab_size": vocab_size,
                "n_embd": config.hidden_size, "n_head": config.num_attention_heads, "n_layer": config.num_layers,
                "n_inner": config.ffn_hidden_size, "rotary_dim": int(config.kv_channels * gpt_kwargs["rotary_percent"]),
                "activation_function": out["hidden_act"], "layer_norm_epsilon": config.layernorm_epsilon,
                "attn_pdrop": config.attention_dropout, "initializer_range": config.init_method_std,
                "tie_word_embeddings": out["tie_word_embeddings"]}


FAMILY = GPTJFamily()
