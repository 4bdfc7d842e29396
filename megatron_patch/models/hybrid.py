"""Building a family as megatron-core's `HybridModel` (megatron-core >= 0.19, where `GPTModel` is deprecated
in its favour) instead of `GPTModel`: the same function, the same weights, the same checkpoints.

HybridModel gives every sublayer its own layer, chosen by a layer pattern: `*` attention (`+` MLA), `-`
dense MLP, `E` mixture-of-experts MLP. A family maps when its GPT layer is megatron-core's sequential
`TransformerLayer` (`x + attn(norm(x))`, then `+ mlp(norm(.))`): GPT layer `i` becomes hybrid layers `2i`
(its input norm and attention) and `2i + 1` (its pre-MLP norm and MLP), pattern `*-*-...` (`*E` for sparse
layers). The sublayer specs are cut from the family's own GPT layer specs (`family.decoder_spec`), so every
module a family plugs in (ALiBi, post-sublayer norms inside attention / MLP, qk-norm, MLA cores, routers)
is the same in both models. A layer class of its own (Falcon's parallel attention + MLP) does not map:
`hybrid_stack_spec` says why (docs/hybrid.md lists the families).

Two things HybridModel builds differently from GPTModel are set back to the GPT model's: its final norm
(`HybridStack` always builds Transformer Engine's; here the GPT decoder's norm class) and its rotary
embedding (built without `rotary_interleaved` and llama3 scaling; here rebuilt with GPTModel's arguments).

Checkpoints stay in GPT format (one converter): `to_hybrid_names` renames a GPT state dict (HF weights
loaded in memory), and `load_torch_dist` loads a GPT torch_dist checkpoint, converted or written by
`megatron.training`, through megatron-core's GPT -> Hybrid interop (`gpt_checkpoint_interop`, what a
`megatron.training` HybridModel run does on `--load`). Checkpoints with per-layer keys (the
mixture-of-experts families: their `moe_layer_freq` is a list) are outside that interop in megatron-core
0.19 and are retargeted here the same way, by renaming the layer index.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from megatron_patch.compat import require_hybrid_model
from megatron_patch.models.family import ModelFamily, UnsupportedConfig
from megatron_patch.models.modules import mlp_class
from megatron_patch.models.registry import get_family

require_hybrid_model()  # a clear error on megatron-core 0.18, before importing what it lacks

from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec, build_module  # noqa: E402

ATTENTION, MLA, MLP, MOE = "*", "+", "-", "E"  # megatron-core's hybrid_layer_allocation.Symbols
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_SUBLAYER = {"input_layernorm.": 0, "self_attention.": 0, "pre_mlp_layernorm.": 1, "mlp.": 1}
_FINAL_NORM = ("decoder.final_layernorm.", "decoder.final_norm.")  # GPT's name, HybridModel's


@dataclasses.dataclass
class FamilyHybridStackSubmodules(HybridStackSubmodules):
    final_norm: Any = None


class FamilyHybridStack(HybridStack):
    """HybridStack whose final norm is the GPT decoder's (megatron-core's HybridStack always builds TE's)."""

    def __init__(self, config, submodules: FamilyHybridStackSubmodules, post_layer_norm: bool = True,
                 post_process: bool = True, **kwargs):
        super().__init__(config, submodules, post_layer_norm=False, post_process=post_process, **kwargs)
        self.post_layer_norm = post_layer_norm
        if post_process and post_layer_norm:
            self.final_norm = build_module(submodules.final_norm, config=config, hidden_size=config.hidden_size,
                                           eps=config.layernorm_epsilon)


def _sparse_layers(arch: dict) -> list[bool]:
    """Which GPT layers are mixture-of-experts (megatron-core's `moe_layer_freq`: a list, or every n-th)."""
    n = arch["num_layers"]
    if not arch.get("num_moe_experts"):
        return [False] * n
    freq = arch.get("moe_layer_freq", 1)
    return [bool(f) for f in freq] if isinstance(freq, list) else [i % freq == 0 for i in range(n)]


def layer_pattern(hf_config: Any, family: ModelFamily | None = None) -> str:
    """The hybrid layer pattern of the family's model: an attention and an MLP position per GPT layer."""
    family = family or get_family(hf_config)
    arch = family.config_kwargs(hf_config)
    attention = MLA if arch.get("multi_latent_attention") else ATTENTION
    return "".join(attention + (MOE if sparse else MLP) for sparse in _sparse_layers(arch))


def config_overrides(hf_config: Any, family: ModelFamily | None = None) -> dict:
    """`TransformerConfig` fields of the hybrid model: the pattern's layer count (megatron-core's init
    scaling of output layers then equals the GPT model's) and no `moe_layer_freq` list (the pattern says
    which MLPs are sparse)."""
    family = family or get_family(hf_config)
    arch = family.config_kwargs(hf_config)
    out = {"num_layers": 2 * arch["num_layers"], "is_hybrid_model": True}
    if arch.get("num_moe_experts"):
        out["moe_layer_freq"] = 1
    return out


def _gpt_config(config, hf_config: Any, family: ModelFamily):
    """`config` as the family's GPTModel has it (its layers, its MoE layer list, one pipeline stage): what
    its layer specs are read from."""
    arch = family.config_kwargs(hf_config)
    extra = {"moe_layer_freq": arch["moe_layer_freq"]} if "moe_layer_freq" in arch else {}
    return dataclasses.replace(config, num_layers=arch["num_layers"], is_hybrid_model=False,
                               pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                               num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                               **extra)


def _gpt_layer_specs(family: ModelFamily, hf_config: Any, gpt_config) -> tuple[list, Any]:
    """(the family's GPT layer specs, one per layer; the GPT decoder's final norm class)."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_patch.models.modules.fused_mlp import with_te_mlp

    spec = with_te_mlp(family.decoder_spec(hf_config, gpt_config), gpt_config)
    if isinstance(spec, ModuleSpec) and isinstance(spec.submodules, TransformerBlockSubmodules):
        spec = spec.submodules
    if isinstance(spec, TransformerBlockSubmodules):
        return list(spec.layer_specs), spec.layer_norm
    # one spec for every layer: GPTModel's TransformerBlock adds megatron-core's default final norm
    return [spec] * gpt_config.num_layers, transformer_block.LayerNormImpl


def hybrid_stack_spec(hf_config: Any, config, family: ModelFamily | None = None) -> ModuleSpec:
    """The family's `hybrid_stack_spec`: HybridStack's attention, MLP and MoE layer specs cut from the
    family's GPT layer specs, and the GPT decoder's final norm. UnsupportedConfig (saying why) when a layer
    is not megatron-core's sequential TransformerLayer."""
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    family = family or get_family(hf_config)
    gpt_config = _gpt_config(config, hf_config, family)
    layers, final_norm = _gpt_layer_specs(family, hf_config, gpt_config)
    config.moe_grouped_gemm = gpt_config.moe_grouped_gemm  # a family's decoder_spec may choose it
    pattern = layer_pattern(hf_config, family)
    parts: dict[str, ModuleSpec] = {}
    for i, spec in enumerate(layers):
        if spec.module not in (TransformerLayer, MoETransformerLayer):
            raise UnsupportedConfig(
                f"{family.name} has no HybridModel form: its layer is {spec.module.__name__}, not megatron-core's "
                "sequential TransformerLayer, so attention and MLP are not separate residual sublayers "
                "(docs/hybrid.md)")
        sub = spec.submodules
        if sub.cross_attention is not IdentityOp:
            raise UnsupportedConfig(f"{family.name} has no HybridModel form: cross-attention")
        keys = [{k: v for k, v in sub.sharded_state_dict_keys_map.items() if _sublayer(k) == part}
                for part in (0, 1)]  # the local norms' TE checkpoint names, per sublayer
        attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=sub.input_layernorm, self_attention=sub.self_attention, self_attn_bda=sub.self_attn_bda,
            sharded_state_dict_keys_map=keys[0]))
        sparse = issubclass(mlp_class(sub.mlp) or object, MoELayer)
        mlp = ModuleSpec(module=spec.module if sparse else MLPLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=sub.pre_mlp_layernorm, mlp=sub.mlp, mlp_bda=sub.mlp_bda,
            sharded_state_dict_keys_map=keys[1]))
        if (MOE if sparse else MLP) != pattern[2 * i + 1]:
            raise UnsupportedConfig(f"{family.name}: layer {i}'s spec and config disagree on a sparse MLP")
        for symbol, part in ((pattern[2 * i], attention), (pattern[2 * i + 1], mlp)):
            if parts.setdefault(symbol, part) != part:
                raise UnsupportedConfig(f"{family.name} has no HybridModel form: its layers differ beyond "
                                        "dense / sparse MLP (HybridModel has one spec per layer kind)")
    fields = {ATTENTION: "attention_layer", MLA: "mla_layer", MLP: "mlp_layer", MOE: "moe_layer"}
    return ModuleSpec(module=FamilyHybridStack, submodules=FamilyHybridStackSubmodules(
        final_norm=final_norm, **{fields[s]: spec for s, spec in parts.items()}))


def hybrid_model(hf_config: Any, config, vocab_size: int, pre_process: bool, post_process: bool,
                 family: ModelFamily | None = None, **model_kwargs):
    """The family's `HybridModel` for a ready `TransformerConfig` (as `config_overrides` sets it); the
    counterpart of `build.gpt_model`, with the family's GPTModel kwargs."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    family = family or get_family(hf_config)
    gpt_kwargs = {**family.gpt_kwargs(hf_config), **model_kwargs}
    rope = {k: gpt_kwargs.pop(k) for k in ("rope_scaling", "rope_scaling_factor") if k in gpt_kwargs}
    model = HybridModel(
        config=config,
        hybrid_stack_spec=hybrid_stack_spec(hf_config, config, family),
        vocab_size=vocab_size,
        max_sequence_length=family.max_sequence_length(hf_config),
        hybrid_layer_pattern=layer_pattern(hf_config, family),
        pre_process=pre_process,
        post_process=post_process,
        **gpt_kwargs,
    )
    if hasattr(model, "rotary_pos_emb") and type(model.rotary_pos_emb).__name__ == "RotaryEmbedding":
        model.rotary_pos_emb = _gpt_rotary(model, gpt_kwargs, rope)
    family.finalize(model, hf_config)
    return model


def _gpt_rotary(model, kwargs: dict, rope: dict):
    """The rotary embedding GPTModel builds (HybridModel's passes neither `rotary_interleaved` nor llama3
    scaling)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(
        kv_channels=model.config.kv_channels, rotary_percent=kwargs.get("rotary_percent", 1.0),
        rotary_interleaved=model.config.rotary_interleaved,
        seq_len_interpolation_factor=kwargs.get("seq_len_interpolation_factor"),
        rotary_base=kwargs.get("rotary_base", 10000), rope_scaling=rope.get("rope_scaling", False),
        rope_scaling_factor=rope.get("rope_scaling_factor", 8.0),
        use_cpu_initialization=model.config.use_cpu_initialization, cp_group=model.pg_collection.cp)


def _sublayer(name_in_layer: str) -> int | None:
    """0 for a name in a GPT layer's attention half, 1 for its MLP half, None for neither."""
    return next((part for prefix, part in _SUBLAYER.items() if name_in_layer.startswith(prefix)), None)


# ---- GPT-format weights -> HybridModel -----------------------------------------------------------------
def hybrid_name(gpt_name: str) -> str:
    """A GPT model's parameter (or checkpoint key) name -> the HybridModel's: layer `i`'s norm + attention
    are layer `2i`, its norm + MLP layer `2i + 1`; the final norm is `decoder.final_norm`. Stage-local
    indices map the same way (a pipeline stage holds whole GPT layers)."""
    m = _LAYER.match(gpt_name)
    if m is None:
        return gpt_name.replace(*_FINAL_NORM) if gpt_name.startswith(_FINAL_NORM[0]) else gpt_name
    rest = gpt_name[m.end():]
    part = _sublayer(rest)
    if part is None:
        raise ValueError(f"{gpt_name}: not part of an attention or MLP sublayer")
    return f"decoder.layers.{2 * int(m[1]) + part}.{rest}"


def to_hybrid_names(state_dict: dict) -> dict:
    """A GPT model's (or one rank's converted) state dict under the HybridModel's names."""
    return {hybrid_name(k): v for k, v in state_dict.items()}


def to_gpt_names(state_dict: dict) -> dict:
    """A HybridModel's state dict under the GPT model's names (`to_hybrid_names`' inverse)."""
    return {_gpt_name(k): v for k, v in state_dict.items()}


def load_torch_dist(model, step_dir: str) -> None:
    """Load a GPT-format torch_dist checkpoint (converted by megatron_patch, or saved by a GPTModel run of
    megatron.training; any stored layout) into this rank's HybridModel. Layer-stacked checkpoints (the dense
    families) go through megatron-core's GPT -> Hybrid interop, exactly as a megatron.training HybridModel
    run loads them; per-layer ones (mixture of experts) are retargeted by `_retarget_per_layer`."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
        gpt_compatible_layer_maps,
        retarget_sharded_state_dict_to_gpt_checkpoint,
    )
    from torch.distributed.checkpoint import FileSystemReader

    sharded = model.sharded_state_dict()
    stored = FileSystemReader(step_dir).read_metadata().state_dict_metadata
    if any(_LAYER.match(k) for k in stored):
        _retarget_per_layer(sharded)
    else:
        retarget_sharded_state_dict_to_gpt_checkpoint(sharded, gpt_compatible_layer_maps(model.hybrid_layer_pattern))
    model.load_state_dict(dist_checkpointing.load({"model": sharded}, step_dir)["model"], strict=True)


def _retarget_per_layer(sharded: dict) -> None:
    """Point a HybridModel's sharded state dict at a GPT checkpoint that keys every layer apart
    (`decoder.layers.<i>.`; megatron-core writes these when `moe_layer_freq` is a list): the storage keys get
    GPT names (`hybrid_name` backwards), the structure keeps the model's; HybridModel's output-layer
    `_extra_state`, which GPT checkpoints omit, stays local (as in megatron-core's interop)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    def retarget(entry):
        if not isinstance(entry, ShardedBase):
            return entry
        if entry.key.endswith("output_layer._extra_state"):
            return LocalNonpersistentObject(entry.data)
        entry.key = _gpt_name(entry.key)
        return entry

    dict_list_map_inplace(retarget, sharded)


def _gpt_name(hybrid: str) -> str:
    """`hybrid_name`'s inverse."""
    m = _LAYER.match(hybrid)
    if m is None:
        return hybrid.replace(_FINAL_NORM[1], _FINAL_NORM[0]) if hybrid.startswith(_FINAL_NORM[1]) else hybrid
    return f"decoder.layers.{int(m[1]) // 2}.{hybrid[m.end():]}"
