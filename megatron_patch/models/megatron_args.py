"""A family's model in Megatron-LM's argument names: the one map from an HF config to `--num-layers`,
`--swiglu`, `--num-query-groups`, `--num-experts`, ... Training writes it into the parsed arguments before
megatron validates them (`training/arguments.py`), and the converter stores it in a checkpoint's `args`
(`conversion/mcore_io.py`): what megatron.training compares on `--load` (`check_checkpoint_args`) and reads back
with `--use-checkpoint-args` (`load_args_from_checkpoint`)."""

from __future__ import annotations

from typing import Any

# megatron-core's TransformerConfig names that are also Megatron-LM's argument names
MOE_FIELDS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_pre_softmax",
              "moe_router_score_function", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
              "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
              "moe_router_topk_scaling_factor", "moe_router_dtype")
MLA_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim", "rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "mscale",
              "mscale_all_dim", "beta_fast", "beta_slow")


def megatron_lm_args(hf_config: Any, family=None, num_query_groups: int | None = None) -> dict:
    """Megatron-LM argument values describing the family's model for `hf_config`. `num_query_groups`: the
    layout's (a converted checkpoint at a TP above the KV heads replicates them), else the config's."""
    from megatron_patch.models.registry import get_family

    family = family or get_family(hf_config)
    ck, gk = family.config_kwargs(hf_config), family.gpt_kwargs(hf_config)
    heads = ck["num_attention_heads"]
    groups = num_query_groups or ck.get("num_query_groups") or heads
    position = gk.get("position_embedding_type", "learned_absolute")
    out = dict(
        num_layers=ck["num_layers"], hidden_size=ck["hidden_size"], ffn_hidden_size=ck["ffn_hidden_size"],
        num_attention_heads=heads, kv_channels=ck["kv_channels"], group_query_attention=groups != heads,
        num_query_groups=groups, normalization=ck["normalization"], norm_epsilon=ck["layernorm_epsilon"],
        swiglu=bool(ck["gated_linear_unit"]) and ck["activation_func"].__name__ == "silu",
        add_bias_linear=ck["add_bias_linear"], add_qkv_bias=ck["add_qkv_bias"], qk_layernorm=ck["qk_layernorm"],
        position_embedding_type=position,
        # Megatron-LM's legacy flag: its argument check refuses it off unless the type is rope (ALiBi's "none"
        # included); the model's embedding follows position_embedding_type
        add_position_embedding=position != "rope",
        rotary_base=gk.get("rotary_base", 10000), rotary_percent=gk.get("rotary_percent", 1.0),
        rotary_interleaved=ck.get("rotary_interleaved", False),
        untie_embeddings_and_output_weights=not gk.get("share_embeddings_and_output_weights", False),
        max_position_embeddings=family.max_sequence_length(hf_config),
        hidden_dropout=ck["hidden_dropout"], attention_dropout=ck["attention_dropout"],
        init_method_std=ck["init_method_std"],
    )
    if gk.get("rope_scaling"):
        out.update(use_rope_scaling=True, rope_scaling_factor=gk["rope_scaling_factor"])
    if ck.get("num_moe_experts"):  # mixture of experts: megatron's names are the config fields but one
        out["num_experts"] = ck["num_moe_experts"]
        out.update({k: ck[k] for k in MOE_FIELDS if k in ck})
    if ck.get("multi_latent_attention"):
        out.update({k: ck[k] for k in MLA_FIELDS if k in ck})
    return out
