"""Mixture-of-experts decoders on megatron-core's MoE layer: Mixtral, Qwen2-MoE, Qwen3-MoE.

The dense decoder (`dense.py`) with, in the layers the config makes sparse, megatron's `MoELayer`: a
top-k router (`mlp.router.weight`), the experts (`mlp.experts.local_experts.{j}.linear_fc{1,2}`; the
Transformer Engine implementation always uses the grouped GEMM, `mlp.experts.linear_fc{1,2}.weight{j}`),
and optionally a shared expert with a sigmoid gate (`mlp.shared_experts.*`). Routing is matched to HF:
softmax scores; with the top-k weights renormalised (Mixtral, `norm_topk_prob: true`) megatron takes the
softmax over the top-k logits (the same numbers), without (Qwen2-MoE's default) the softmax over all
experts before the top-k (`moe_router_pre_softmax`). Dense layers of a sparse model (Qwen's
`mlp_only_layers` / `decoder_sparse_step`) are megatron's `moe_layer_freq` pattern.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megatron_patch.models.dense import ArchConfig, DenseDecoder, DenseNames, UnsupportedConfig
from megatron_patch.models.mappings import Drop, GatedMLP, Mapping, Replicated, RowParallel, on_layers


@dataclass(frozen=True)
class ExpertNames:
    """Checkpoint names of a sparse layer's MLP, relative to the layer (`{expert}` = expert index)."""

    router: str = "mlp.gate"
    expert: str = "mlp.experts.{expert}."
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str = "mlp.shared_expert."
    shared_gate: str = "mlp.shared_expert_gate"


def te_checkpoint_keys(layer_spec) -> dict[str, str]:
    """The local layer's torch_dist keys renamed to Transformer Engine's, so that a checkpoint holds the
    same keys whichever implementation wrote it (megatron-core does this for dense layers). Measured
    against real TE models on an H200 (tests/gpu/RESULTS.md): TE fuses the input norm into linear_qkv
    but keeps MLA's apart, fuses MLA's q/kv norms into the up projections, and fuses the pre-MLP norm
    into a dense MLP only; megatron-core's local spec maps the pre-MLP norm for MoE layers too."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    def built(spec) -> type | None:  # the class a submodule spec builds (a ModuleSpec, a partial or a class)
        cls = getattr(spec, "func", getattr(spec, "module", spec))
        return cls if isinstance(cls, type) else None

    sub = layer_spec.submodules
    keys = {}
    if issubclass(built(sub.self_attention) or object, MLASelfAttention):
        keys["self_attention.q_layernorm."] = "self_attention.linear_q_up_proj.layer_norm_"
        keys["self_attention.kv_layernorm."] = "self_attention.linear_kv_up_proj.layer_norm_"
    else:
        keys["input_layernorm."] = "self_attention.linear_qkv.layer_norm_"
    if not issubclass(built(sub.mlp) or object, MoELayer):
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return keys


class MoEDecoder(DenseDecoder):
    experts_names = ExpertNames()
    shared_expert = False
    shared_expert_gate = True  # Qwen2-MoE's sigmoid gate on the shared expert's output

    # ---- facts from the config ------------------------------------------------------------------
    def num_experts(self, c: ArchConfig) -> int:
        return int(c.get("num_local_experts") or c.get("num_experts"))

    def top_k(self, c: ArchConfig) -> int:
        return int(c["num_experts_per_tok"])

    def norm_topk(self, c: ArchConfig) -> bool:
        return bool(c.get("norm_topk_prob", False))

    def expert_ffn(self, c: ArchConfig) -> int:
        return int(c.get("moe_intermediate_size") or c["intermediate_size"])

    def moe_layers(self, c: ArchConfig) -> list[int]:
        """Global indices of the sparse layers (Qwen: every `decoder_sparse_step`-th, minus `mlp_only_layers`)."""
        dense = set(c.get("mlp_only_layers") or [])
        step = int(c.get("decoder_sparse_step") or 1)
        return [i for i in range(int(c["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0]

    def shared_ffn(self, c: ArchConfig) -> int | None:
        return int(c["shared_expert_intermediate_size"]) if self.shared_expert else None

    # ---- megatron-core config --------------------------------------------------------------------
    def config_kwargs(self, hf_config: Any) -> dict:
        c = self.canonical(hf_config)
        kw = super().config_kwargs(c)
        sparse = set(self.moe_layers(c))
        kw.update(
            num_moe_experts=self.num_experts(c),
            moe_router_topk=self.top_k(c),
            moe_ffn_hidden_size=self.expert_ffn(c),
            moe_router_pre_softmax=not self.norm_topk(c),
            moe_router_score_function="softmax",
            moe_layer_freq=[int(i in sparse) for i in range(kw["num_layers"])],
        )
        if self.shared_expert:
            kw.update(moe_shared_expert_intermediate_size=self.shared_ffn(c),
                      moe_shared_expert_gate=self.shared_expert_gate)
        return kw

    def decoder_spec(self, hf_config: Any, config, vp_stage: int | None = None):
        """megatron's per-layer block spec (dense and MoE layers); TE means the grouped-GEMM experts."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        te = config.transformer_impl == "transformer_engine"
        config.moe_grouped_gemm = te
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization=self.norm,
                                          vp_stage=vp_stage)
        if not te:
            for layer in spec.layer_specs:
                layer.submodules = replace(layer.submodules, sharded_state_dict_keys_map=te_checkpoint_keys(layer))
        return spec

    def layer_spec(self, hf_config: Any, impl):
        raise UnsupportedConfig(f"{self.name}: a mixture-of-experts model is built per layer (decoder_spec)")

    # ---- weight map --------------------------------------------------------------------------------
    def weight_map(self, hf_config: Any) -> list[Mapping | Drop]:
        c = self.canonical(hf_config)
        n: DenseNames = self.names_for(c)
        e = self.experts_names
        hf, mc = n.layer, "decoder.layers.{layer}."
        sparse = self.moe_layers(c)
        dense = [i for i in range(int(c["num_hidden_layers"])) if i not in sparse]
        out: list[Mapping | Drop] = []
        for m in super().weight_map(c):
            if isinstance(m, Mapping) and (".mlp.linear_fc" in m.megatron or ".pre_mlp_layernorm." in m.megatron):
                if ".pre_mlp_layernorm." in m.megatron and sparse:
                    # TE keeps a sparse layer's pre-MLP norm apart (the router is no LayerNorm-linear)
                    out.append(on_layers(Replicated(m.hf[0], m.megatron), sparse, te_name=m.megatron))
                if not dense:
                    continue
                m = on_layers(m, dense)
            out.append(m)

        def moe(mapping: Mapping, expert: int | None = None, te_name: str | None = None) -> None:
            out.append(on_layers(mapping, sparse, expert=expert, te_name=te_name))

        moe(Replicated(f"{hf}{e.router}.weight", f"{mc}mlp.router.weight"))
        # the engine numbers experts per EP rank; TE's grouped GEMM numbers its weights instead of modules
        dst, grouped = f"{mc}mlp.experts.local_experts.{{expert}}.", f"{mc}mlp.experts."
        for j in range(self.num_experts(c)):
            src = hf + e.expert.format(expert=j)
            moe(GatedMLP(f"{src}{e.gate}.weight", f"{src}{e.up}.weight", f"{dst}linear_fc1.weight"), j,
                f"{grouped}linear_fc1.weight{{expert}}")
            moe(RowParallel(f"{src}{e.down}.weight", f"{dst}linear_fc2.weight"), j,
                f"{grouped}linear_fc2.weight{{expert}}")
        if self.shared_expert:
            src, dst = hf + e.shared, f"{mc}mlp.shared_experts."
            moe(GatedMLP(f"{src}{e.gate}.weight", f"{src}{e.up}.weight", f"{dst}linear_fc1.weight"))
            moe(RowParallel(f"{src}{e.down}.weight", f"{dst}linear_fc2.weight"))
            if self.shared_expert_gate:
                moe(Replicated(f"{hf}{e.shared_gate}.weight", f"{dst}gate_weight"))
        return out


class Mixtral(MoEDecoder):
    name = "mixtral"
    architectures = ("MixtralForCausalLM",)
    model_type = "mixtral"
    experts_names = ExpertNames(router="block_sparse_moe.gate", expert="block_sparse_moe.experts.{expert}.",
                                gate="w1", up="w3", down="w2")

    def norm_topk(self, c: ArchConfig) -> bool:
        return True  # Mixtral renormalises its top-k weights

    def moe_layers(self, c: ArchConfig) -> list[int]:
        return list(range(int(c["num_hidden_layers"])))

    def sliding_window(self, c: ArchConfig) -> int | None:
        return c.get("sliding_window")


class Qwen2Moe(MoEDecoder):
    name = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    model_type = "qwen2_moe"
    shared_expert = True

    def qkv_bias(self, c: ArchConfig) -> bool:
        return bool(c.get("qkv_bias", True))

    def linear_bias(self, c: ArchConfig) -> bool:
        return False


class Qwen3Moe(MoEDecoder):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    model_type = "qwen3_moe"

    def qk_layernorm(self, c: ArchConfig) -> bool:
        return True

    def qkv_bias(self, c: ArchConfig) -> bool:
        return bool(c.get("attention_bias", False))

    def linear_bias(self, c: ArchConfig) -> bool:
        return False


MIXTRAL, QWEN2_MOE, QWEN3_MOE = Mixtral(), Qwen2Moe(), Qwen3Moe()
