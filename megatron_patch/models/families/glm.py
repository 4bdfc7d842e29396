"""GLM families -> megatron-core `GPTModel`:

- `GlmForCausalLM` (transformers-native GLM-4-9B "-hf"): q/k/v biases (`attention_bias`), no other
  bias, fused `mlp.gate_up_proj` = [gate; up], rotary on the first `partial_rotary_factor` (0.5) of
  each head's dims with adjacent pairs rotated (megatron-core `rotary_interleaved`, `rotary_percent`).
- `Glm4ForCausalLM` (GLM-4-0414): the same plus RMSNorm on the attention and MLP outputs
  (`post_self_attn_layernorm`, `post_mlp_layernorm`; `modules/post_norm.py`).
- `ChatGLMModel` / `ChatGLMForConditionalGeneration` (remote code of ChatGLM2-6B, ChatGLM3-6B and
  GLM-4-9B-chat; not ChatGLM-6B v1, whose 2D positions are refused). Accepted checkpoint names:
  `transformer.embedding.word_embeddings`, `transformer.encoder.layers.N.{input_layernorm,
  self_attention.query_key_value (+bias), self_attention.dense, post_attention_layernorm,
  mlp.dense_h_to_4h, mlp.dense_4h_to_h}`, `transformer.encoder.final_layernorm`,
  `transformer.output_layer`; `transformer.rotary_pos_emb.inv_freq` is dropped. Accepted config keys:
  `num_layers`, `hidden_size`, `ffn_hidden_size`, `kv_channels`, `num_attention_heads`,
  `multi_query_attention` + `multi_query_group_num`, `padded_vocab_size`, `layernorm_epsilon`,
  `add_qkv_bias`, `seq_length`, `rope_ratio` (rotary base 10000 x rope_ratio), `tie_word_embeddings`;
  `rmsnorm`, `post_layer_norm` must be true and `add_bias_linear`,
  `apply_residual_connection_post_layernorm` false (as in every release). The math is GlmForCausalLM's
  (rotary on half the head dims, adjacent pairs), so the names are an exact rename of it.
"""

from typing import Any

from megatron_patch.models.dense import DenseDecoder, DenseNames
from megatron_patch.models.family import UnsupportedConfig


class GlmFamily(DenseDecoder):
    name = "glm"
    architectures = ("GlmForCausalLM",)
    model_type = "glm"
    names = DenseNames(mlp_in="mlp.gate_up_proj")
    rotary_interleaved = True
    # GlmConfig's defaults for keys a config.json may omit
    defaults = {"partial_rotary_factor": 0.5, "head_dim": 128, "attention_bias": True,
                "num_key_value_heads": 2, "rms_norm_eps": 1.5625e-07}

    def qkv_bias(self, c: Any) -> bool:
        return bool(c["attention_bias"])

    def linear_bias(self, c: Any) -> bool:
        return False

    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        out = super().hf_config_from_megatron(config, gpt_kwargs, vocab_size)
        out.pop("mlp_bias")
        return {**out, "attention_bias": config.add_qkv_bias,
                "partial_rotary_factor": gpt_kwargs["rotary_percent"]}


class Glm4Family(GlmFamily):
    name = "glm4"
    architectures = ("Glm4ForCausalLM",)
    model_type = "glm4"
    post_norms = True


class ChatGLMFamily(GlmFamily):
    name = "chatglm"
    architectures = ("ChatGLMModel", "ChatGLMForConditionalGeneration")
    model_type = "chatglm"
    remote_code = True
    names = DenseNames(
        embed="transformer.embedding.word_embeddings",
        layer="transformer.encoder.layers.{layer}.",
        qkv="self_attention.query_key_value",
        attn_out="self_attention.dense",
        mlp_in="mlp.dense_h_to_4h",
        mlp_out="mlp.dense_4h_to_h",
        final_norm="transformer.encoder.final_layernorm",
        lm_head="transformer.output_layer",
        layer_drops=(),
        drops=("transformer.rotary_pos_emb.inv_freq",),
    )
    defaults = {}

    def translate(self, config: dict) -> dict:
        if "position_encoding_2d" in config or "padded_vocab_size" not in config:
            raise UnsupportedConfig("ChatGLM-6B (v1, 2D positions) is not supported; ChatGLM2/3 and GLM-4 are")
        for key, want in (("rmsnorm", True), ("post_layer_norm", True), ("add_bias_linear", False),
                          ("apply_residual_connection_post_layernorm", False)):
            if bool(config.get(key, want)) != want:
                raise UnsupportedConfig(f"ChatGLM config {key}={config[key]}: only {key}={want} is supported")
        heads = int(config["num_attention_heads"])
        groups = int(config["multi_query_group_num"]) if config.get("multi_query_attention") else heads
        return {
            **config,
            "num_hidden_layers": config["num_layers"],
            "intermediate_size": config["ffn_hidden_size"],
            "num_key_value_heads": groups,
            "head_dim": config.get("kv_channels") or config["hidden_size"] // heads,
            "vocab_size": config["padded_vocab_size"],
            "rms_norm_eps": config.get("layernorm_epsilon", 1e-5),
            "attention_bias": config.get("add_qkv_bias", False),
            "max_position_embeddings": config.get("seq_length", 2048),
            "rope_theta": 10000.0 * float(config.get("rope_ratio", 1.0)),
            "partial_rotary_factor": 0.5,
        }


GLM = GlmFamily()
GLM4 = Glm4Family()
CHATGLM = ChatGLMFamily()
