"""DeepSeek-V2 / V3: multi-latent attention (megatron-core's MLA) and mixture-of-experts layers with
shared experts, after `first_k_dense_replace` dense layers.

Attention (HF -> megatron-core): q_a_proj -> linear_q_down_proj, q_a_layernorm -> q_layernorm, q_b_proj ->
linear_q_up_proj (a q LoRA rank is required: see config_kwargs), kv_a_proj_with_mqa ->
linear_kv_down_proj ([kv_lora_rank; rope dims]), kv_a_layernorm -> kv_layernorm, kv_b_proj ->
linear_kv_up_proj (per head [nope; v]), o_proj -> linear_proj. megatron-core's MLA rotates the rope dims
as interleaved pairs, HF's `rope_interleave: true` (a config without it is refused). Transformer Engine
fuses the q/kv norms into the up projections and keeps the down projections whole on every TP rank.

Routing: V3's sigmoid scores with the `e_score_correction_bias` (megatron's `expert_bias`) deciding the
choice only, group-limited top-k (`n_group`, `topk_group`; megatron ranks groups by the sum of their best
top_k / topk_group scores, HF by the best two: the same when top_k = 2 x topk_group, as in V3), top-k
weights renormalised and scaled by `routed_scaling_factor`. V2: softmax scores, greedy top-k, scaled.
Multi-token-prediction layers stored after the last layer (`num_nextn_predict_layers`) are dropped: HF's
model does not run them either."""

from __future__ import annotations

from typing import Any

from megatron_patch.models.dense import ArchConfig, DenseNames, UnsupportedConfig
from megatron_patch.models.families.moe import ExpertNames, MoEDecoder
from megatron_patch.models.mappings import (
    ColumnParallel,
    Drop,
    Mapping,
    Replicated,
    on_layers,
)


class DeepSeek(MoEDecoder):
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    model_type = "deepseek_v3"
    shared_expert = True
    shared_expert_gate = False
    experts_names = ExpertNames(shared="mlp.shared_experts.")
    sigmoid_router = True

    def translate(self, config: dict) -> dict:
        c = dict(config)
        c.setdefault("num_key_value_heads", c["num_attention_heads"])
        return c

    def num_experts(self, c: ArchConfig) -> int:
        return int(c["n_routed_experts"])

    def norm_topk(self, c: ArchConfig) -> bool:
        return bool(c.get("norm_topk_prob", True))

    def moe_layers(self, c: ArchConfig) -> list[int]:
        first = int(c.get("first_k_dense_replace") or 0)
        step = int(c.get("moe_layer_freq") or 1)
        return [i for i in range(int(c["num_hidden_layers"])) if i >= first and i % step == 0]

    def shared_ffn(self, c: ArchConfig) -> int | None:
        n = int(c.get("n_shared_experts") or 0)
        return n * int(c["moe_intermediate_size"]) if n else None

    def config_class(self):
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig

    def config_kwargs(self, hf_config: Any) -> dict:
        c = self.canonical(hf_config)
        if not c.get("rope_interleave", True):
            raise UnsupportedConfig("rope_interleave=false: megatron-core's MLA rotates interleaved pairs only")
        kw = super().config_kwargs(c)
        theta, scaling = _rope(c)
        q_lora = c.get("q_lora_rank")
        if not q_lora:
            raise UnsupportedConfig("q_lora_rank=null (DeepSeek-V2-Lite): megatron-core 0.19.2's MLA normalises the "
                                    "kv latent only together with a q norm, which this model does not have")
        kw.update(
            multi_latent_attention=True,
            q_lora_rank=int(q_lora),
            kv_lora_rank=int(c["kv_lora_rank"]),
            qk_head_dim=int(c["qk_nope_head_dim"]),
            qk_pos_emb_head_dim=int(c["qk_rope_head_dim"]),
            v_head_dim=int(c["v_head_dim"]),
            kv_channels=int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"]),
            num_query_groups=int(c["num_attention_heads"]),
            qk_layernorm=True,  # the q/kv LoRA norms
            rotary_base=theta,
            rope_type="rope",
            moe_router_topk_scaling_factor=float(c.get("routed_scaling_factor") or 1.0) or None,
            moe_router_dtype="fp32",
        )
        if scaling is not None:
            kw.update(rope_type="yarn", rotary_scaling_factor=float(scaling["factor"]),
                      original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                      beta_fast=float(scaling.get("beta_fast", 32)), beta_slow=float(scaling.get("beta_slow", 1)),
                      mscale=float(scaling.get("mscale", 1.0)),
                      mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)))
        if self.sigmoid_router:
            k, groups, topk_group = self.top_k(c), int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
            if not self.norm_topk(c) and k > 1:
                raise UnsupportedConfig("norm_topk_prob=false with a sigmoid router: megatron-core always "
                                        "renormalises the top-k sigmoid scores")
            if groups > 1 and k != 2 * topk_group:
                raise UnsupportedConfig(f"group-limited routing with num_experts_per_tok={k}, topk_group={topk_group}: "
                                        "megatron-core ranks groups by their best top_k/topk_group scores, HF by "
                                        "their best two (equal only when top_k = 2 x topk_group)")
            kw.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_router_pre_softmax=False)
            if groups > 1:
                kw.update(moe_router_num_groups=groups, moe_router_group_topk=topk_group)
        return kw

    def gpt_kwargs(self, hf_config: Any) -> dict:
        c = self.canonical(hf_config)
        return dict(position_embedding_type="rope", share_embeddings_and_output_weights=bool(
            c.get("tie_word_embeddings", False)))

    def decoder_spec(self, hf_config: Any, config, vp_stage: int | None = None):
        spec = super().decoder_spec(hf_config, config, vp_stage)
        if config.transformer_impl != "transformer_engine":
            from megatron_patch.models.modules.mla_core import with_local_mla_core

            spec = with_local_mla_core(spec, q_lora=bool(config.q_lora_rank))
        return spec

    def weight_map(self, hf_config: Any) -> list[Mapping | Drop]:
        c = self.canonical(hf_config)
        n: DenseNames = self.names_for(c)
        hf, mc = n.layer + "self_attn.", "decoder.layers.{layer}.self_attention."
        te = "decoder.layers.{layer}.self_attention."
        out: list[Mapping | Drop] = []
        for m in super().weight_map(c):
            if isinstance(m, Mapping) and ".linear_qkv." in m.megatron:
                continue  # MLA's projections below replace q/k/v
            if isinstance(m, Mapping) and m.megatron == "decoder.layers.{layer}.input_layernorm.weight":
                m = on_layers(m, te_name=m.megatron)  # TE's MLA keeps its own input norm
            out.append(m)
        out += [on_layers(ColumnParallel(f"{hf}q_a_proj.weight", f"{mc}linear_q_down_proj.weight"),
                          te_replicated=True),
                on_layers(Replicated(f"{hf}q_a_layernorm.weight", f"{mc}q_layernorm.weight"),
                          te_name=f"{te}linear_q_up_proj.layer_norm_weight"),
                ColumnParallel(f"{hf}q_b_proj.weight", f"{mc}linear_q_up_proj.weight"),
                on_layers(ColumnParallel(f"{hf}kv_a_proj_with_mqa.weight", f"{mc}linear_kv_down_proj.weight"),
                          te_replicated=True),
                on_layers(Replicated(f"{hf}kv_a_layernorm.weight", f"{mc}kv_layernorm.weight"),
                          te_name=f"{te}linear_kv_up_proj.layer_norm_weight"),
                ColumnParallel(f"{hf}kv_b_proj.weight", f"{mc}linear_kv_up_proj.weight")]
        for i in range(int(c.get("num_nextn_predict_layers") or 0)):  # multi-token prediction layers
            out.append(Drop(f"model.layers.{int(c['num_hidden_layers']) + i}.", "multi-token prediction layer"))
        sparse = self.moe_layers(c)
        if self.sigmoid_router and sparse:
            out.append(on_layers(Replicated(f"{n.layer}mlp.gate.e_score_correction_bias",
                                            "decoder.layers.{layer}.mlp.router.expert_bias"), sparse))
        return out


class DeepSeekV2(DeepSeek):
    name = "deepseek_v2"
    architectures = ("DeepseekV2ForCausalLM",)
    model_type = "deepseek_v2"
    sigmoid_router = False

    def norm_topk(self, c: ArchConfig) -> bool:
        return bool(c.get("norm_topk_prob", False))

    def config_kwargs(self, hf_config: Any) -> dict:
        c = self.canonical(hf_config)
        method = c.get("topk_method", "greedy")
        if method != "greedy":
            raise UnsupportedConfig(f"topk_method={method!r}: megatron-core's group-limited top-k ranks groups "
                                    "differently from DeepSeek-V2's (greedy routing is supported)")
        return {**super().config_kwargs(c), "moe_router_score_function": "softmax"}


def _rope(c: ArchConfig) -> tuple[float, dict | None]:
    params = c.get("rope_parameters") or {}
    theta = float(params.get("rope_theta") or c.get("rope_theta") or 10000.0)
    scaling = c.get("rope_scaling") or (params if params.get("rope_type") not in (None, "default") else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) not in ("yarn", "deepseek_yarn"):
        raise UnsupportedConfig(f"rope scaling {scaling.get('rope_type')!r}: DeepSeek's MLA supports yarn only")
    return theta, scaling


DEEPSEEK_V3, DEEPSEEK_V2 = DeepSeek(), DeepSeekV2()
