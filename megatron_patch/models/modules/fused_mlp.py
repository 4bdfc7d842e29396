"""Megatron's two Transformer Engine options for the dense MLP, which megatron.training's own model builder
passes to megatron-core's layer spec and which ours applies to every family's layer specs here (`with_te_mlp`):

- `--use-transformer-engine-op-fuser` (the `TransformerConfig` field `use_transformer_engine_op_fuser`): each
  Transformer Engine layer's dense MLP as megatron-core's `TEFusedMLP`, which runs norm, fc1, the (gated)
  activation and fc2 as one `transformer_engine.pytorch.ops.Sequential`, so Transformer Engine may fuse across
  them (under fp8: the activation writes fc2's fp8 input, and its backward the fp8 gradient fc1 needs, where the
  plain MLP runs megatron-core's compiled SwiGLU in bf16 and TE casts again).
- `--use-te-activation-func` (`use_te_activation_func`): the plain MLP with Transformer Engine's SwiGLU op
  (megatron-core's `TEActivationOp`) as its activation, one kernel forward and one backward, in place of
  megatron-core's SwiGLU compiled by torch.compile, whose backward ran at about half the HBM bandwidth at
  LLaMA-3-8B widths (docs/benchmarks.md, 2026-12-05). megatron-core's MoE specs give experts and shared experts
  the op already; a dense layer spec from `get_gpt_layer_with_transformer_engine_spec` has none, and megatron-core's
  MLP then applies the plain activation to fc1's whole output (both halves) when the option is on.

The parameters, their names and the checkpoints are the plain MLP's in both."""

from __future__ import annotations

import dataclasses
import functools

from megatron_patch.models.family import UnsupportedConfig
from megatron_patch.models.modules import mlp_class, replace_mlp

FLAG = "--use-transformer-engine-op-fuser"
ACTIVATION_FLAG = "--use-te-activation-func"


def _mlp_submodules(mlp):
    return mlp.keywords.get("submodules") if isinstance(mlp, functools.partial) else getattr(mlp, "submodules", None)


def _glu_extras(config) -> list[tuple[str, object]]:
    """The gated MLP's clamp and linear-half offset where `config` sets them (Transformer Engine's activation ops
    compute neither), as (field, value)."""
    return [(field, getattr(config, field)) for field, plain in
            (("activation_func_clamp_value", None), ("glu_linear_offset", 0.0))
            if getattr(config, field, plain) not in (plain, None)]


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
    for field, value in _glu_extras(config):
        raise UnsupportedConfig(f"{FLAG}: Transformer Engine's fused MLP ignores {field} ({value}) that this model "
                                "sets")


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


def _each_layer(spec, change):
    """`spec` (one layer spec, a TransformerBlockSubmodules of one per layer, or a ModuleSpec of such a block)
    with `change(layer_spec)` in place of each layer spec; the spec given is not changed in place."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    def block(b):
        return dataclasses.replace(b, layer_specs=[change(layer) for layer in b.layer_specs])

    if isinstance(getattr(spec, "submodules", None), TransformerBlockSubmodules):  # a ModuleSpec of the block
        return dataclasses.replace(spec, submodules=block(spec.submodules))
    if isinstance(spec, TransformerBlockSubmodules):
        return block(spec)
    return change(spec)


def with_te_fused_mlp(spec, config):
    """`spec` (what `GPTModel` takes as `transformer_layer_spec`: one layer spec, or a block spec of one per
    layer) with every dense MLP as `TEFusedMLP` when `config.use_transformer_engine_op_fuser`, else `spec`.
    UnsupportedConfig, saying why, where a layer's MLP has no fused form."""
    if not getattr(config, "use_transformer_engine_op_fuser", False):
        return spec
    if config.transformer_impl != "transformer_engine":
        raise UnsupportedConfig(f"{FLAG} needs --transformer-impl transformer_engine, not {config.transformer_impl}")
    from megatron.core.extensions import transformer_engine as te_ext

    fused = getattr(te_ext, "TEFusedMLP", None)
    if fused is None:
        raise UnsupportedConfig(f"{FLAG} needs Transformer Engine 1.13 or newer (megatron-core's TEFusedMLP)")
    _check_activation(config)
    parts = (fused, te_ext.TELayerNormColumnParallelLinear, te_ext.TERowParallelLinear)
    return _each_layer(spec, lambda layer: _fused_layer(layer, *parts))


def check_te_activation(config) -> None:
    """UnsupportedConfig, saying why, where `--use-te-activation-func` would not compute the model's MLP as it is:
    without Transformer Engine's layers, or for an activation other than SwiGLU (a gated SiLU). megatron-core's
    `TEActivationOp` maps a gated SiLU to TE's SwiGLU, exactly; but GELU to TE's tanh approximation (whatever the
    model's GELU), a plain SiLU to TE's ReLU, and nothing for a plain ReLU; megatron-core's MLP then also skips the
    clamp and the linear half's offset some models set. `config`: a TransformerConfig or its arguments' names."""
    import torch.nn.functional as F

    impl = getattr(config, "transformer_impl", "transformer_engine")
    if impl != "transformer_engine":
        raise UnsupportedConfig(f"{ACTIVATION_FLAG} needs --transformer-impl transformer_engine, not {impl}")
    fn, glu = getattr(config, "activation_func", F.gelu), getattr(config, "gated_linear_unit", False)  # (its defaults)
    if fn is not F.silu or not glu:
        name = getattr(fn, "__name__", type(fn).__name__)
        gated = "gated" if glu else "not gated"
        raise UnsupportedConfig(f"{ACTIVATION_FLAG}: megatron-core maps only SwiGLU (a gated silu) to Transformer "
                                f"Engine's activation as it is; this model's MLP is {gated}, with {name}")
    for field, value in _glu_extras(config):
        raise UnsupportedConfig(f"{ACTIVATION_FLAG}: megatron-core's MLP skips {field} ({value}) that this model "
                                "sets, with it on")


def _with_activation_op(layer_spec, op: type):
    """The layer spec with `op` as its dense MLP's activation module; a mixture-of-experts layer's unchanged
    (megatron-core's MoE specs carry the op), and a layer without megatron-core's MLP refused."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    sub = getattr(layer_spec, "submodules", None)
    mlp = getattr(sub, "mlp", None)
    cls = mlp_class(mlp)
    if cls is not None and issubclass(cls, MoELayer):
        return layer_spec
    if cls is None or not issubclass(cls, MLP):
        name = getattr(cls, "__name__", type(mlp).__name__)
        raise UnsupportedConfig(f"{ACTIVATION_FLAG}: this model's MLP is {name}, not megatron-core's MLP, whose "
                                "activation module the option sets")
    mlp = replace_mlp(mlp, submodules=lambda parts: dataclasses.replace(parts, activation_func=op))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(sub, mlp=mlp))


def with_te_activation(spec, config):
    """`spec` with Transformer Engine's activation op in every dense MLP when `config.use_te_activation_func`,
    else `spec` (module docstring). UnsupportedConfig, saying why, where the op would compute something else."""
    if not getattr(config, "use_te_activation_func", False):
        return spec
    check_te_activation(config)
    from megatron.core.extensions import transformer_engine as te_ext

    op = getattr(te_ext, "TEActivationOp", None)
    if op is None:
        raise UnsupportedConfig(f"{ACTIVATION_FLAG} needs Transformer Engine 1.13 or newer (megatron-core's "
                                "TEActivationOp)")
    return _each_layer(spec, lambda layer: _with_activation_op(layer, op))


def with_te_mlp(spec, config):
    """`spec` with both options of the module docstring applied as `config` sets them (the activation op first,
    so that `TEFusedMLP` takes the same submodules as megatron-core's spec gives it)."""
    return with_te_fused_mlp(with_te_activation(spec, config), config)
