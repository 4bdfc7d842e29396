"""LLaMA family: HF `LlamaForCausalLM` (LLaMA-1/2/3/3.1/3.2, CodeLLaMA) -> megatron-core `GPTModel`.

Pre-norm decoder with RMSNorm, rotary embeddings (rotate-half, i.e. `rotary_interleaved=False`),
SwiGLU MLP, grouped-query attention (MHA/GQA/MQA), optional tied embeddings and biases.
`rope_scaling` of type `llama3` (Llama-3.1/3.2) and `linear` (CodeLLaMA-style interpolation) are
supported; anything else raises `UnsupportedConfig`.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from megatron_patch.models.family import (
    Impl,
    ModelFamily,
    UnsupportedConfig,
    cfg_get,
    rope_parameters,
)
from megatron_patch.models.mappings import (
    QKV,
    Drop,
    GatedMLP,
    Mapping,
    Replicated,
    RowParallel,
    VocabParallel,
)

# megatron-core's llama3 rope scaling hard-codes these (rotary_pos_embedding._apply_scaling); only
# `factor` is a GPTModel argument.
_MCORE_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}


class LlamaFamily(ModelFamily):
    """Also the base of the LLaMA-shaped families (Qwen2/Qwen3, ...), which override the three
    facts below."""

    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_type = "llama"

    def qkv_bias(self, c: Any) -> bool:
        """Biases on q/k/v (megatron-core `add_qkv_bias`)."""
        return self.linear_bias(c)

    def linear_bias(self, c: Any) -> bool:
        """Biases on every linear layer (megatron-core `add_bias_linear`: o_proj and the MLP too)."""
        attn, mlp = bool(cfg_get(c, "attention_bias", False)), bool(cfg_get(c, "mlp_bias", False))
        if attn != mlp:
            raise UnsupportedConfig(
                f"attention_bias={attn} with mlp_bias={mlp}: megatron-core's add_bias_linear switches "
                "the biases of attention and MLP projections together"
            )
        return attn

    def qk_layernorm(self, c: Any) -> bool:
        """Per-head RMSNorm of queries and keys before rotary (Qwen3's q_norm / k_norm)."""
        return False

    def config_kwargs(self, c: Any) -> dict:
        act = cfg_get(c, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedConfig(f"hidden_act={act!r}: the LLaMA family expects SwiGLU ('silu')")
        heads = int(cfg_get(c, "num_attention_heads"))
        hidden = int(cfg_get(c, "hidden_size"))
        return dict(
            num_layers=int(cfg_get(c, "num_hidden_layers")),
            hidden_size=hidden,
            ffn_hidden_size=int(cfg_get(c, "intermediate_size")),
            num_attention_heads=heads,
            num_query_groups=int(cfg_get(c, "num_key_value_heads") or heads),
            kv_channels=int(cfg_get(c, "head_dim") or hidden // heads),
            normalization="RMSNorm",
            layernorm_epsilon=float(cfg_get(c, "rms_norm_eps", 1e-6)),
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=self.linear_bias(c),
            add_qkv_bias=self.qkv_bias(c),
            qk_layernorm=self.qk_layernorm(c),
            hidden_dropout=0.0,
            attention_dropout=float(cfg_get(c, "attention_dropout", 0.0)),
            init_method_std=float(cfg_get(c, "initializer_range", 0.02)),
        )

    def gpt_kwargs(self, c: Any) -> dict:
        theta, scaling = rope_parameters(c)
        kw = dict(
            position_embedding_type="rope",
            rotary_base=theta,
            rotary_percent=1.0,
            share_embeddings_and_output_weights=bool(cfg_get(c, "tie_word_embeddings", False)),
        )
        if scaling is None:
            return kw
        kind = scaling["rope_type"]
        if kind == "linear":
            return {**kw, "seq_len_interpolation_factor": float(scaling["factor"])}
        if kind == "llama3":
            fixed = {k: float(scaling.get(k, v)) for k, v in _MCORE_LLAMA3_FIXED.items()}
            if fixed != _MCORE_LLAMA3_FIXED:
                raise UnsupportedConfig(
                    f"llama3 rope_scaling with {fixed}: megatron-core only implements "
                    f"{_MCORE_LLAMA3_FIXED} (factor is free)"
                )
            return {**kw, "rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}
        raise UnsupportedConfig(f"rope_scaling of type {kind!r} (supported: llama3, linear)")

    def layer_spec(self, c: Any, impl: Impl):
        from megatron.core.models.gpt import gpt_layer_specs as specs

        qk = self.qk_layernorm(c)
        if impl == "transformer_engine":
            return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk)
        return specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk)

    def weight_map(self, c: Any) -> list[Mapping | Drop]:
        hf, mc = "model.layers.{layer}.", "decoder.layers.{layer}."
        m: list[Mapping | Drop] = [
            VocabParallel("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
            Replicated(hf + "input_layernorm.weight", mc + "input_layernorm.weight"),
            QKV(hf + "self_attn.q_proj.weight", hf + "self_attn.k_proj.weight",
                hf + "self_attn.v_proj.weight", mc + "self_attention.linear_qkv.weight"),
            RowParallel(hf + "self_attn.o_proj.weight", mc + "self_attention.linear_proj.weight"),
            Replicated(hf + "post_attention_layernorm.weight", mc + "pre_mlp_layernorm.weight"),
            GatedMLP(hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight", mc + "mlp.linear_fc1.weight"),
            RowParallel(hf + "mlp.down_proj.weight", mc + "mlp.linear_fc2.weight"),
            Replicated("model.norm.weight", "decoder.final_layernorm.weight"),
            # Old exports store rotary caches; they are recomputed from the config.
            Drop(hf + "self_attn.rotary_emb.inv_freq", "recomputed from rope_theta"),
        ]
        if self.qkv_bias(c):
            m.append(QKV(hf + "self_attn.q_proj.bias", hf + "self_attn.k_proj.bias",
                         hf + "self_attn.v_proj.bias", mc + "self_attention.linear_qkv.bias"))
        if self.linear_bias(c):
            m += [
                Replicated(hf + "self_attn.o_proj.bias", mc + "self_attention.linear_proj.bias"),
                GatedMLP(hf + "mlp.gate_proj.bias", hf + "mlp.up_proj.bias", mc + "mlp.linear_fc1.bias"),
                Replicated(hf + "mlp.down_proj.bias", mc + "mlp.linear_fc2.bias"),
            ]
        if self.qk_layernorm(c):
            m += [
                Replicated(hf + "self_attn.q_norm.weight", mc + "self_attention.q_layernorm.weight"),
                Replicated(hf + "self_attn.k_norm.weight", mc + "self_attention.k_layernorm.weight"),
            ]
        if self.tied_embeddings(c):
            # in-memory state dicts (and some exports) repeat the tied matrix
            m.append(Drop("lm_head.weight", "tied to model.embed_tokens.weight"))
        else:
            m.append(VocabParallel("lm_head.weight", "output_layer.weight"))
        return m

    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        out = {
            "architectures": list(self.architectures),
            "model_type": self.model_type,
            "vocab_size": vocab_size,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.ffn_hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_query_groups or config.num_attention_heads,
            "head_dim": config.kv_channels,
            "hidden_act": "silu",
            "rms_norm_eps": config.layernorm_epsilon,
            "attention_bias": config.add_bias_linear,
            "mlp_bias": config.add_bias_linear,
            "attention_dropout": config.attention_dropout,
            "initializer_range": config.init_method_std,
            "tie_word_embeddings": bool(gpt_kwargs.get("share_embeddings_and_output_weights")),
            "rope_theta": gpt_kwargs.get("rotary_base", 10000.0),
        }
        if gpt_kwargs.get("rope_scaling"):
            out["rope_scaling"] = {"rope_type": "llama3", "factor": gpt_kwargs["rope_scaling_factor"],
                                   **_MCORE_LLAMA3_FIXED}
        elif gpt_kwargs.get("seq_len_interpolation_factor"):
            out["rope_scaling"] = {"rope_type": "linear", "factor": gpt_kwargs["seq_len_interpolation_factor"]}
        return out


FAMILY = LlamaFamily()
