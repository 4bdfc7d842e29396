"""`--use-transformer-engine-op-fuser` (megatron's own option, the `TransformerConfig` field
`use_transformer_engine_op_fuser`): each Transformer Engine layer's dense MLP as megatron-core's `TEFusedMLP`,
which runs norm, fc1, the (gated) activation and fc2 as one `transformer_engine.pytorch.ops.Sequential`, so
Transformer Engine may fuse across them (under fp8: the activation writes fc2's fp8 input, and its backward
the fp8 gradient fc1 needs, where the plain MLP runs megatron-core's compiled SwiGLU in bf16 and TE casts
again). The parameters, their names and the checkpoints are the plain MLP's. megatron.training's own model
builder passes the option to megatron-core's layer spec; ours applies it to every family's layer specs here."""

from __future__ import annotations

import dataclasses
import functools

from megatron_patch.models.family import UnsupportedConfig
from megatron_patch.models.modules import mlp_class, replace_mlp

FLAG = "--use-transformer-engine-op-fuser"


def _mlp_submodules(mlp):
    return mlp.keywords.get("submodules") if isinstance(mlp, functools.partial) else getattr(mlp, "submodules", None)


def _check_activation(config) -> None:
    import torch.nn.functional as F

    # TEFusedMLP's activation ops (megatron-core's _make_activation_op): F.silu / F.relu / F.gelu, gated or not;
    # Transformer Engine computes silu and relu exactly, but its GELU is the tanh approximation (common/util/math.h),
    # which megatron-core hands exact (erf) GELU to, and the tanh form (a partial) it does not map at all
    fn = config.activation_func
    if fn not in (F.silu, F.relu):
        raise UnsupportedConfig(f"{FLAG}: Transformer Engine's fused MLP does not compute this model's activation "
                                f"{getattr(fn, '__name__', type(fn).__name__)} as it is (it is exact for silu and "
                                "relu, gated or not; its GELU is the tanh approximation, taken for exact GELU)")
    for field, plain in (("activation_func_clamp_value", None), ("glu_linear_offset", 0.0)):
        if getattr(config, field, plain) not in (plain, None):
            raise UnsupportedConfig(f"{FLAG}: Transformer Engine's fused MLP ignores {field} "
                                    f"({getattr(config, field)}) that this model sets")


def _fused_layer(layer_spec, fused: type, fc1: type, fc2: type):
    """The layer spec with its dense MLP fused; a mixture-of-experts layer's unchanged (megatron-core's experts
    read the option themselves where they have a fused form)."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    sub = getattr(layer_spec, "submodules", None)
    mlp = getattr(sub, "mlp", None)
    cls = mlp_class(mlp)
    if cls is not None and issubclass(cls, MoELayer):
        return layer_spec
    if cls is not MLP:
        name = getattr(cls, "__name__", type(mlp).__name__)
        raise UnsupportedConfig(f"{FLAG}: this model's MLP is {name}, not megatron-core's MLP, which Transformer "
                                "Engine's fused MLP stands in for")
    parts = _mlp_submodules(mlp)
    if not (isinstance(parts.linear_fc1, type) and issubclass(parts.linear_fc1, fc1)
            and isinstance(parts.linear_fc2, type) and issubclass(parts.linear_fc2, fc2)):
        raise UnsupportedConfig(f"{FLAG}: Transformer Engine's fused MLP needs the norm fused into fc1 "
                                f"({fc1.__name__}) and fc2 {fc2.__name__}; this model's MLP has "
                                f"{getattr(parts.linear_fc1, '__name__', parts.linear_fc1)} and "
                                f"{getattr(parts.linear_fc2, '__name__', parts.linear_fc2)}")
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(sub, mlp=replace_mlp(mlp, module=fused)))


def _fused_block(block, parts: tuple):
    return dataclasses.replace(block, layer_specs=[_fused_layer(layer, *parts) for layer in block.layer_specs])


def with_te_fused_mlp(spec, config):
    """`spec` (what `GPTModel` takes as `transformer_layer_spec`: one layer spec, or a block spec of one per
    layer) with every dense MLP as `TEFusedMLP` when `config.use_transformer_engine_op_fuser`, else `spec`.
    UnsupportedConfig, saying why, where a layer's MLP has no fused form."""
    if not getattr(config, "use_transformer_engine_op_fuser", False):
        return spec
    if config.transformer_impl != "transformer_engine":
        raise UnsupportedConfig(f"{FLAG} needs --transformer-impl transformer_engine, not {config.transformer_impl}")
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    fused = getattr(te_ext, "TEFusedMLP", None)
    if fused is None:
        raise UnsupportedConfig(f"{FLAG} needs Transformer Engine 1.13 or newer (megatron-core's TEFusedMLP)")
    _check_activation(config)
    parts = (fused, te_ext.TELayerNormColumnParallelLinear, te_ext.TERowParallelLinear)
    if isinstance(getattr(spec, "submodules", None), TransformerBlockSubmodules):  # a ModuleSpec of the block
        return dataclasses.replace(spec, submodules=_fused_block(spec.submodules, parts))
    if isinstance(spec, TransformerBlockSubmodules):
        return _fused_block(spec, parts)
    return _fused_layer(spec, *parts)
