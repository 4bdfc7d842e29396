"""Test configs derived from the repo's tiny LLaMA, and helpers around `megatron_patch.testing`.

Every variant is a `Case`: the config.json and the tensors a converter sees (by the checkpoint's own
names), and a `transformers` model computing the same function (the logits reference). For
transformers-native families the reference is the model itself; for remote-code families
(`tests/remote.py`) it is the native class the remote code is an exact rename of."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from megatron_patch.conversion.hf_io import checkpoint_state_dict  # noqa: F401 (the tests' name for it)
from megatron_patch.models.registry import load_hf_config
from megatron_patch.testing import TINY_LLAMA
from megatron_patch.testing import random_hf_model as hf_model

DROP = object()  # an override that removes the key (None stays an explicit null)

# name -> overrides of the tiny LLaMA config
LLAMA_VARIANTS: dict[str, dict] = {
    "gqa": {},
    "mqa": {"num_key_value_heads": 1},
    "mha": {"num_key_value_heads": 8},
    "tied": {"tie_word_embeddings": True},
    "llama3_rope": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                    "max_position_embeddings": 16384},
    "linear_rope": {"rope_scaling": {"type": "linear", "factor": 4.0}, "rope_theta": 1000000.0},
    "head_dim": {"head_dim": 16},
    "bias": {"attention_bias": True, "mlp_bias": True},
    "pad_vocab": {"vocab_size": 1100},
    "geglu": {"hidden_act": "gelu"},
    # Yi as re-released (LlamaForCausalLM), Yi-6B-like shape ratios
    "yi_llama": {"rope_theta": 5000000.0, "num_key_value_heads": 4, "vocab_size": 1024},
    # InternLM-1 / "llamafied" checkpoints: q/k/v/o biased, the MLP not
    "attn_bias_only": {"attention_bias": True, "mlp_bias": False},
    # llama3 scaling from a 4k pretraining context (megatron-core's GPTModel assumes 8192)
    "llama3_rope_4k": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 4096},
                       "max_position_embeddings": 16384},
}


def _arch(arch: str, model_type: str, **kw) -> dict:
    return {"architectures": [arch], "model_type": model_type, **kw}


# name -> overrides turning the tiny LLaMA into another transformers-native family
FAMILY_VARIANTS: dict[str, dict] = {
    "qwen2": _arch("Qwen2ForCausalLM", "qwen2", tie_word_embeddings=True, head_dim=DROP,
                   rope_theta=1000000.0, use_sliding_window=False),
    "qwen2_untied": _arch("Qwen2ForCausalLM", "qwen2", head_dim=DROP),
    "qwen3": _arch("Qwen3ForCausalLM", "qwen3", head_dim=16, tie_word_embeddings=True),
    "qwen3_untied": _arch("Qwen3ForCausalLM", "qwen3", num_key_value_heads=4),
    "mistral": _arch("MistralForCausalLM", "mistral", sliding_window=None, attention_bias=DROP,
                     mlp_bias=DROP),
    # a window (8) shorter than the test prompts (24-48 tokens), Nemo-style explicit head_dim
    "mistral_swa": _arch("MistralForCausalLM", "mistral", sliding_window=8, head_dim=16,
                         attention_bias=DROP, mlp_bias=DROP),
    "starcoder2": _arch("Starcoder2ForCausalLM", "starcoder2", hidden_act="gelu_pytorch_tanh", use_bias=True,
                        norm_epsilon=1e-5, tie_word_embeddings=True, rms_norm_eps=DROP, head_dim=DROP,
                        attention_bias=DROP, mlp_bias=DROP, sliding_window=None),
    "starcoder2_swa": _arch("Starcoder2ForCausalLM", "starcoder2", hidden_act="gelu_pytorch_tanh",
                            use_bias=False, norm_epsilon=1e-5, num_key_value_heads=4, sliding_window=16,
                            rms_norm_eps=DROP, head_dim=DROP, attention_bias=DROP, mlp_bias=DROP),
    "glm": _arch("GlmForCausalLM", "glm", pad_token_id=0, attention_bias=True, partial_rotary_factor=0.5,
                 mlp_bias=DROP),
    "glm_tied": _arch("GlmForCausalLM", "glm", pad_token_id=0, attention_bias=False, num_key_value_heads=4, head_dim=16,
                     partial_rotary_factor=0.5, tie_word_embeddings=True, mlp_bias=DROP),
    "glm4": _arch("Glm4ForCausalLM", "glm4", pad_token_id=0, attention_bias=True, partial_rotary_factor=0.5,
                  mlp_bias=DROP),
    "glm4_mha": _arch("Glm4ForCausalLM", "glm4", pad_token_id=0, attention_bias=False, num_key_value_heads=8,
                      partial_rotary_factor=0.5, mlp_bias=DROP, rope_theta=10000.0),
    # mixture of experts: 4 experts, top-2 (Mixtral renormalises the top-k weights)
    "mixtral": _arch("MixtralForCausalLM", "mixtral", num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=None, attention_bias=DROP, mlp_bias=DROP),
    # shared expert with its sigmoid gate, a dense first layer, softmax over all experts before the top-k
    "qwen2_moe": _arch("Qwen2MoeForCausalLM", "qwen2_moe", num_experts=4, num_experts_per_tok=2, head_dim=DROP,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[0],
                       norm_topk_prob=False, use_sliding_window=False, attention_bias=DROP, mlp_bias=DROP),
    # qk-norm, renormalised top-k, a dense last layer
    "qwen3_moe": _arch("Qwen3MoeForCausalLM", "qwen3_moe", num_experts=4, num_experts_per_tok=2, head_dim=16,
                       moe_intermediate_size=32, mlp_only_layers=[3], norm_topk_prob=True, mlp_bias=DROP),
}


# complete configs of families whose config.json does not use LLaMA's keys
OTHER_VARIANTS: dict[str, dict] = {
    "bloom": {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "vocab_size": 1000, "hidden_size": 64,
              "n_head": 8, "n_layer": 4, "layer_norm_epsilon": 1e-5, "pad_token_id": 0, "bos_token_id": 1,
              "eos_token_id": 2},
    # 6 heads: ALiBi slopes for a head count that is not a power of two, 3 per rank at TP2
    "bloom_6heads": {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "vocab_size": 1000,
                     "hidden_size": 48, "n_head": 6, "n_layer": 4, "layer_norm_epsilon": 1e-5, "pad_token_id": 0},
    "starcoder": {"architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode", "vocab_size": 1000,
                  "n_embd": 64, "n_head": 8, "n_layer": 4, "n_inner": 160, "n_positions": 256,
                  "multi_query": True, "activation_function": "gelu_pytorch_tanh", "layer_norm_epsilon": 1e-5},
    "starcoder_mha": {"architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode", "vocab_size": 1000,
                      "n_embd": 64, "n_head": 8, "n_layer": 4, "n_positions": 256, "multi_query": False,
                      "activation_function": "gelu", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False},
    # Falcon-7B: MQA, attention and MLP in parallel from one shared norm, no biases
    "falcon_7b": {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "vocab_size": 1000,
                  "hidden_size": 64, "num_attention_heads": 8, "num_hidden_layers": 4, "multi_query": True,
                  "parallel_attn": True, "bias": False, "rope_theta": 10000.0, "pad_token_id": 0},
    # Falcon-40B/180B: new decoder architecture, GQA, ln_attn + ln_mlp
    "falcon_40b": {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "vocab_size": 1000,
                   "hidden_size": 64, "num_attention_heads": 8, "num_kv_heads": 2, "num_hidden_layers": 4,
                   "new_decoder_architecture": True, "parallel_attn": True, "bias": False, "pad_token_id": 0},
    # Falcon2-11B: new decoder architecture with one shared norm (splits over TP)
    "falcon_11b": {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "vocab_size": 1000,
                   "hidden_size": 64, "num_attention_heads": 8, "num_kv_heads": 2, "num_hidden_layers": 4,
                   "new_decoder_architecture": True, "num_ln_in_parallel_attn": 1, "parallel_attn": True,
                   "bias": False, "ffn_hidden_size": 96, "tie_word_embeddings": False, "pad_token_id": 0},
    # DeepSeek-V3: MLA, a dense first layer, 8 experts in 2 groups (one chosen per token), sigmoid router
    # with its bias, a shared expert; one multi-token-prediction layer (its tensors are dropped)
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 1000,
                    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "q_lora_rank": 32,
                    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
                    "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
                    "rope_theta": 10000.0, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
                    "num_nextn_predict_layers": 1, "tie_word_embeddings": False},
    # DeepSeek-V2: softmax router, greedy top-k scaled without renormalisation, two shared experts
    "deepseek_v2": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 1000,
                    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "n_shared_experts": 2, "first_k_dense_replace": 1, "q_lora_rank": 24,
                    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
                    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.5,
                    "norm_topk_prob": False, "rope_theta": 10000.0, "max_position_embeddings": 256,
                    "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    # GPT-J-6B's shape ratios: rotary on a quarter of each head (interleaved pairs), one shared norm,
    # attention and MLP in parallel, MLP and lm_head biased, attention not
    "gptj": {"architectures": ["GPTJForCausalLM"], "model_type": "gptj", "vocab_size": 1000, "n_embd": 64,
             "n_head": 4, "n_layer": 4, "rotary_dim": 4, "n_positions": 256, "activation_function": "gelu_new",
             "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2},
    # Pythia: parallel residual (two norms), rotary_pct 0.25 (GPT-NeoX-library keys), biases everywhere
    "gpt_neox": {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": 1000,
                 "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "intermediate_size": 160,
                 "rotary_pct": 0.25, "rotary_emb_base": 10000, "use_parallel_residual": True, "hidden_act": "gelu",
                 "layer_norm_eps": 1e-5, "max_position_embeddings": 256, "tie_word_embeddings": False},
    # sequential blocks, no attention biases, transformers 5's rope_parameters keys
    "gpt_neox_seq": {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": 1000,
                     "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4, "intermediate_size": 160,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.5},
                     "use_parallel_residual": False, "attention_bias": False, "hidden_act": "gelu_new",
                     "layer_norm_eps": 1e-5, "max_position_embeddings": 256},
    # sequential blocks, MHA, biases
    "falcon_seq": {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "vocab_size": 1000,
                   "hidden_size": 64, "num_attention_heads": 8, "num_hidden_layers": 4, "multi_query": False,
                   "parallel_attn": False, "bias": True, "pad_token_id": 0},
}


def family_config(variant: str, **extra) -> dict:
    """A tiny config of another family (see FAMILY_VARIANTS and OTHER_VARIANTS)."""
    if variant in OTHER_VARIANTS:
        return {**OTHER_VARIANTS[variant], **extra}
    return llama_config("gqa", **FAMILY_VARIANTS[variant], **extra)


def llama_config(variant: str = "gqa", **extra) -> dict:
    """The tiny LLaMA config with a variant's and `extra` overrides (DROP removes a key)."""
    cfg = {**load_hf_config(TINY_LLAMA), **LLAMA_VARIANTS[variant], **extra}
    return {k: v for k, v in cfg.items() if v is not DROP}


def any_config(variant: str) -> dict:
    """A LLaMA variant or another native family's tiny config, by name."""
    return llama_config(variant) if variant in LLAMA_VARIANTS else family_config(variant)


@dataclass
class Case:
    cfg: dict  # the checkpoint's config.json
    sd: dict[str, torch.Tensor]  # the checkpoint's tensors, by its own names
    ref: torch.nn.Module  # transformers model with the same logits

    @property
    def vocab_size(self) -> int:
        return int(self.ref.config.vocab_size)


def case(variant: str) -> Case:
    from tests.remote import REMOTE_VARIANTS

    if variant in REMOTE_VARIANTS:
        return REMOTE_VARIANTS[variant]()
    return case_of(any_config(variant))


def case_of(cfg: dict) -> Case:
    """The case of a config.json (a tiny config with overrides): a random transformers model and its tensors."""
    hf = hf_model(cfg)
    return Case(cfg, checkpoint_state_dict(hf), hf)


# YaRN as DeepSeek's released models rotate (`rope_scaling`; V3: mscale_all_dim 1.0, V2-Lite 0.707), at tiny lengths
DEEPSEEK_YARN = {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def all_variants() -> list[str]:
    from tests.remote import REMOTE_VARIANTS

    return sorted(LLAMA_VARIANTS) + sorted(FAMILY_VARIANTS) + sorted(OTHER_VARIANTS) + sorted(REMOTE_VARIANTS)


def save_hf(model, path: str) -> str:
    model.save_pretrained(path)
    return path


def save_case(c: Case, path: str) -> str:
    """An HF folder for the case: config.json + model.safetensors with the checkpoint's names
    (tied duplicates dropped, as save_pretrained does)."""
    from safetensors.torch import save_file

    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c.cfg, f)
    seen, tensors = set(), {}
    for k, v in c.sd.items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            tensors[k] = v.contiguous().clone()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path
