"""Qwen families on the LLaMA math -> megatron-core `GPTModel`:

- `QWenLMHeadModel` (Qwen-1: Qwen-1.8B/7B/14B/72B, remote code). Accepted checkpoint names:
  `transformer.wte`, `transformer.h.N.{ln_1, attn.c_attn (fused [q; k; v] + bias), attn.c_proj, ln_2,
  mlp.w1 (up), mlp.w2 (gate: the MLP computes w1(x) * silu(w2(x))), mlp.c_proj}`, `transformer.ln_f`,
  `lm_head`. Accepted config keys: `num_hidden_layers`, `hidden_size`, `num_attention_heads`,
  `kv_channels` (= hidden_size / heads), `intermediate_size` (twice the MLP width, as Qwen-1 counts
  it), `layer_norm_epsilon`, `rotary_emb_base`, `rotary_pct` (1.0), `no_bias`, `seq_length`,
  `vocab_size`, `tie_word_embeddings`. `use_dynamic_ntk` / `use_logn_attn` only act on sequences longer
  than `seq_length` (both are the identity up to it); megatron-core does not extend beyond it.
  The math is Qwen2's (q/k/v bias, SwiGLU, RMSNorm), so these names are an exact rename of it.

- `Qwen2ForCausalLM` (Qwen2, Qwen2.5): biases on q/k/v only (`add_qkv_bias`), tied embeddings on the
  small sizes; sliding-window attention must be off (`use_sliding_window: false`, as released).
- `Qwen3ForCausalLM`: per-head RMSNorm of queries and keys (`q_norm`/`k_norm` -> `qk_layernorm`),
  explicit `head_dim`, no biases.

Checkpoint names are LLaMA's, plus `self_attn.{q,k,v}_proj.bias` (Qwen2) and
`self_attn.{q,k}_norm.weight` (Qwen3).
"""

from __future__ import annotations

import warnings
from typing import Any

from megatron_patch.models.dense import DenseDecoder, DenseNames
from megatron_patch.models.family import UnsupportedConfig


class Qwen2Family(DenseDecoder):
    name = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    model_type = "qwen2"

    def qkv_bias(self, c: Any) -> bool:
        return True

    def linear_bias(self, c: Any) -> bool:
        return False

    def sliding_window(self, c: Any) -> None:
        if c.get("use_sliding_window", False):
            raise UnsupportedConfig("use_sliding_window=true: Qwen2 sliding-window attention is not supported")
        return None

    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        out = super().hf_config_from_megatron(config, gpt_kwargs, vocab_size)
        for key in ("attention_bias", "mlp_bias", "head_dim"):
            out.pop(key)
        return {**out, "use_sliding_window": False}


class Qwen3Family(DenseDecoder):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    model_type = "qwen3"

    def qk_layernorm(self, c: Any) -> bool:
        return True

    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        out = super().hf_config_from_megatron(config, gpt_kwargs, vocab_size)
        out.pop("mlp_bias")
        return out


class Qwen1Family(DenseDecoder):
    name = "qwen1"
    architectures = ("QWenLMHeadModel",)
    model_type = "qwen"
    remote_code = True
    names = DenseNames(
        embed="transformer.wte", layer="transformer.h.{layer}.", input_norm="ln_1", qkv="attn.c_attn",
        attn_out="attn.c_proj", pre_mlp_norm="ln_2", mlp_in=("mlp.w2", "mlp.w1"), mlp_out="mlp.c_proj",
        final_norm="transformer.ln_f", layer_drops=(),
    )

    def translate(self, config: dict) -> dict:
        heads, hidden = int(config["num_attention_heads"]), int(config["hidden_size"])
        if config.get("kv_channels", hidden // heads) != hidden // heads:
            raise UnsupportedConfig(f"kv_channels={config['kv_channels']} != hidden_size / heads: "
                                    "Qwen-1's attention splits heads by hidden_size")
        if float(config.get("rotary_pct", 1.0)) != 1.0:
            raise UnsupportedConfig(f"rotary_pct={config['rotary_pct']}: only full rotary (1.0) is supported")
        if config.get("use_dynamic_ntk") or config.get("use_logn_attn"):
            warnings.warn(f"Qwen-1 use_dynamic_ntk / use_logn_attn: identity up to seq_length="
                          f"{config.get('seq_length')}, not extended beyond it by megatron-core", stacklevel=2)
        no_bias = bool(config.get("no_bias", True))
        return {
            **config,
            "intermediate_size": int(config["intermediate_size"]) // 2,
            "num_key_value_heads": heads,
            "head_dim": hidden // heads,
            "rms_norm_eps": config.get("layer_norm_epsilon", 1e-6),
            "rope_theta": float(config.get("rotary_emb_base", 10000.0)),
            "rope_scaling": None,
            "max_position_embeddings": config.get("seq_length") or config.get("max_position_embeddings"),
            "attention_bias": not no_bias,
            "mlp_bias": not no_bias,
        }

    def qkv_bias(self, c: Any) -> bool:
        return True  # c_attn always has a bias


QWEN1 = Qwen1Family()
QWEN2 = Qwen2Family()
QWEN3 = Qwen3Family()
