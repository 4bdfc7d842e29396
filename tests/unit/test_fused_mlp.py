"""`--use-transformer-engine-op-fuser` and `--use-te-activation-func` on our layer specs (`models.modules.fused_mlp`):
every dense MLP of a Transformer Engine layer becomes megatron-core's `TEFusedMLP` with the same submodules, or
gets Transformer Engine's activation op, mixture-of-experts layers stay as they are, and what has no such form is
refused in one line. Transformer Engine is absent on a
CPU machine, so its classes are stand-ins here; tests/gpu/test_paths.py trains with the real ones."""

import dataclasses
import functools
import types

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_patch.models.family import UnsupportedConfig
from megatron_patch.models.modules import mlp_class
from megatron_patch.models.modules.fused_mlp import with_te_activation, with_te_fused_mlp, with_te_mlp


class LayerNormLinear:  # stand-ins for Transformer Engine's classes
    pass


class ColumnLinear:
    pass


class RowLinear:
    pass


class FusedMLP(MLP):
    pass


class PostNormMLP(MLP):
    pass


@pytest.fixture
def te(monkeypatch):
    from megatron.core.extensions import transformer_engine as te_ext

    monkeypatch.setattr(te_ext, "TEFusedMLP", FusedMLP, raising=False)
    monkeypatch.setattr(te_ext, "TELayerNormColumnParallelLinear", LayerNormLinear, raising=False)
    monkeypatch.setattr(te_ext, "TERowParallelLinear", RowLinear, raising=False)
    return te_ext


def _config(**kw):
    return types.SimpleNamespace(**{"use_transformer_engine_op_fuser": True, "transformer_impl": "transformer_engine",
                                    "activation_func": F.silu, "gated_linear_unit": True, **kw})


def _mlp(cls=MLP, fc1=LayerNormLinear, fc2=RowLinear, partial=True):
    subs = MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)
    if partial:  # megatron-core's TE layer spec (both ends of the supported range)
        return functools.partial(cls.as_mlp_submodule, submodules=subs)
    return ModuleSpec(module=cls, submodules=subs)


def _layer(mlp):
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(mlp=mlp))


@pytest.mark.parametrize("partial", [True, False])
@pytest.mark.parametrize("activation", [F.silu, F.relu])
def test_a_dense_layer_gets_the_fused_mlp_with_the_same_submodules(te, partial, activation):
    layer = _layer(_mlp(partial=partial))
    fused = with_te_fused_mlp(layer, _config(activation_func=activation))
    assert mlp_class(fused.submodules.mlp) is FusedMLP
    before = layer.submodules.mlp.keywords if partial else {"submodules": layer.submodules.mlp.submodules}
    after = fused.submodules.mlp.keywords if partial else {"submodules": fused.submodules.mlp.submodules}
    assert after == before  # the same linear layers: the same parameters, names and checkpoints
    # the rest of the layer is untouched, and the spec given is not changed in place
    assert dataclasses.replace(fused.submodules, mlp=None) == dataclasses.replace(layer.submodules, mlp=None)
    assert fused.module is TransformerLayer and mlp_class(layer.submodules.mlp) is MLP


def test_off_the_spec_is_returned_as_it_is(te):
    layer = _layer(_mlp(cls=PostNormMLP))
    assert with_te_fused_mlp(layer, _config(use_transformer_engine_op_fuser=False)) is layer
    assert with_te_fused_mlp(layer, types.SimpleNamespace(transformer_impl="local")) is layer


@pytest.mark.parametrize("wrapped", [True, False])
def test_a_block_fuses_its_dense_layers_and_keeps_its_experts(te, wrapped):
    """A per-layer block spec (mixture-of-experts families with dense first layers): dense MLPs fused, MoE
    layers the same objects; as a bare TransformerBlockSubmodules or a ModuleSpec of TransformerBlock."""
    moe = _layer(ModuleSpec(module=MoELayer))
    block = TransformerBlockSubmodules(layer_specs=[_layer(_mlp()), moe, moe], layer_norm=LayerNormLinear)
    spec = ModuleSpec(module=TransformerBlock, submodules=block) if wrapped else block
    fused = with_te_fused_mlp(spec, _config())
    out = fused.submodules if wrapped else fused
    assert [mlp_class(layer.submodules.mlp) for layer in out.layer_specs] == [FusedMLP, MoELayer, MoELayer]
    assert out.layer_specs[1] is moe and out.layer_norm is LayerNormLinear
    assert [mlp_class(layer.submodules.mlp) for layer in block.layer_specs] == [MLP, MoELayer, MoELayer]


@pytest.mark.parametrize("change, message", [
    ({"transformer_impl": "local"}, "--use-transformer-engine-op-fuser needs --transformer-impl transformer_engine, "
                                    "not local"),
    ({"activation_func": functools.partial(F.gelu, approximate="tanh")}, "does not compute this model's activation "
                                                                         "partial as it is"),
    ({"activation_func": F.gelu, "gated_linear_unit": False}, "activation gelu as it is (it is exact for silu and "
                                                              "relu, gated or not; its GELU is the tanh approximation"),
    ({"activation_func_clamp_value": 7.0}, "ignores activation_func_clamp_value (7.0)"),
    ({"glu_linear_offset": 1.0}, "ignores glu_linear_offset (1.0)"),
])
def test_what_the_fused_mlp_cannot_compute_is_refused(te, change, message):
    with pytest.raises(UnsupportedConfig) as e:
        with_te_fused_mlp(_layer(_mlp()), _config(**change))
    assert message in str(e.value) and str(e.value).startswith("--use-transformer-engine-op-fuser")


@pytest.mark.parametrize("mlp, message", [
    (_mlp(cls=PostNormMLP), "this model's MLP is PostNormMLP, not megatron-core's MLP"),
    (_mlp(fc1=ColumnLinear), "needs the norm fused into fc1 (LayerNormLinear) and fc2 RowLinear; this model's MLP "
                             "has ColumnLinear and RowLinear"),
])
def test_an_mlp_without_a_fused_form_is_refused(te, mlp, message):
    with pytest.raises(UnsupportedConfig) as e:
        with_te_fused_mlp(_layer(mlp), _config())
    assert message in str(e.value)


def test_without_transformer_engine_s_fused_mlp_it_says_so(te, monkeypatch):
    monkeypatch.setattr(te, "TEFusedMLP", None)
    with pytest.raises(UnsupportedConfig, match="needs Transformer Engine 1.13 or newer"):
        with_te_fused_mlp(_layer(_mlp()), _config())


def test_the_provider_refuses_a_model_built_with_a_plain_dense_mlp():
    """`training.model.check_built`: with the option on, a layer whose MLP is megatron-core's plain MLP stops the
    run (a moved seam would otherwise train unfused silently); mixture-of-experts layers, whose experts are MLPs
    under other names, and fused ones pass; off, nothing is checked."""
    import torch

    from megatron_patch.training.model import check_built

    def layer(mlp_cls):
        m = torch.nn.Module()
        m.mlp = mlp_cls.__new__(mlp_cls)
        torch.nn.Module.__init__(m.mlp)
        return m

    def model(*classes):
        m = torch.nn.Module()
        m.layers = torch.nn.ModuleList([layer(c) for c in classes])
        return m

    on, off = types.SimpleNamespace(use_transformer_engine_op_fuser=True), types.SimpleNamespace()
    check_built(model(FusedMLP, MoELayer), on, post_process=False)
    check_built(model(MLP), off, post_process=False)
    with pytest.raises(ValueError, match="built its plain MLP, not TEFusedMLP, for a dense layer"):
        check_built(model(FusedMLP, MLP, MoELayer), on, post_process=False)


# --use-te-activation-func: Transformer Engine's activation op in every dense MLP (with_te_activation)

class ActivationOp(torch.nn.Module):  # stand-in for megatron-core's TEActivationOp (TE's SwiGLU op)
    def __init__(self, config):
        super().__init__()

    def forward(self, x):
        gate, linear = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * linear


@pytest.fixture
def te_op(te, monkeypatch):
    monkeypatch.setattr(te, "TEActivationOp", ActivationOp, raising=False)
    return te


def _act_config(**kw):
    return _config(**{"use_transformer_engine_op_fuser": False, "use_te_activation_func": True, **kw})


@pytest.mark.parametrize("partial", [True, False])
def test_a_dense_layer_gets_the_activation_op_and_keeps_its_linear_layers(te_op, partial):
    layer = _layer(_mlp(partial=partial))
    out = with_te_activation(layer, _act_config())
    parts = out.submodules.mlp.keywords["submodules"] if partial else out.submodules.mlp.submodules
    before = layer.submodules.mlp.keywords["submodules"] if partial else layer.submodules.mlp.submodules
    assert parts.activation_func is ActivationOp and before.activation_func is None  # not changed in place
    assert (parts.linear_fc1, parts.linear_fc2) == (before.linear_fc1, before.linear_fc2)
    assert mlp_class(out.submodules.mlp) is MLP
    assert with_te_activation(layer, _config()) is layer  # off: as it is


def test_the_activation_op_goes_to_dense_layers_of_a_block_and_into_the_fused_mlp(te_op):
    """MoE layers keep megatron-core's spec (its MoE specs carry the op); with the op fuser on too, TEFusedMLP
    gets the activation in its submodules, as megatron-core's own spec gives it."""
    moe = _layer(ModuleSpec(module=MoELayer))
    block = TransformerBlockSubmodules(layer_specs=[_layer(_mlp()), moe], layer_norm=LayerNormLinear)
    out = with_te_mlp(block, _act_config(use_transformer_engine_op_fuser=True))
    dense = out.layer_specs[0].submodules.mlp
    assert mlp_class(dense) is FusedMLP and dense.keywords["submodules"].activation_func is ActivationOp
    assert out.layer_specs[1] is moe


@pytest.mark.parametrize("change, message", [
    ({"transformer_impl": "local"}, "--use-te-activation-func needs --transformer-impl transformer_engine, not local"),
    ({"activation_func": F.gelu}, "maps only SwiGLU (a gated silu) to Transformer Engine's activation as it is; this "
                                  "model's MLP is gated, with gelu"),
    ({"gated_linear_unit": False}, "this model's MLP is not gated, with silu"),
    ({"activation_func": F.relu, "gated_linear_unit": False}, "not gated, with relu"),
    ({"activation_func_clamp_value": 7.0}, "skips activation_func_clamp_value (7.0)"),
    ({"glu_linear_offset": 1.0}, "skips glu_linear_offset (1.0)"),
])
def test_what_the_activation_op_would_compute_otherwise_is_refused(te_op, change, message):
    with pytest.raises(UnsupportedConfig) as e:
        with_te_activation(_layer(_mlp()), _act_config(**change))
    assert message in str(e.value) and str(e.value).startswith("--use-te-activation-func")


def test_a_layer_without_megatron_core_s_mlp_or_te_s_op_is_refused(te_op, monkeypatch):
    with pytest.raises(UnsupportedConfig, match="this model's MLP is TransformerLayer, not megatron-core's MLP"):
        with_te_activation(_layer(ModuleSpec(module=TransformerLayer)), _act_config())
    monkeypatch.setattr(te_op, "TEActivationOp", None)
    with pytest.raises(UnsupportedConfig, match="needs Transformer Engine 1.13 or newer"):
        with_te_activation(_layer(_mlp()), _act_config())


def _plain_and_op_mlp_agree(rank: int, bias: bool) -> bool:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patch.models.modules.fused_mlp import _with_activation_op
    from tests import _cpu

    _cpu.init_model_parallel()
    common = dict(num_layers=1, hidden_size=16, ffn_hidden_size=24, num_attention_heads=2, gated_linear_unit=True,
                  activation_func=F.silu, add_bias_linear=bias, bias_activation_fusion=False,
                  use_cpu_initialization=True, gradient_accumulation_fusion=False)
    plain_cfg, op_cfg = TransformerConfig(**common), TransformerConfig(**common, use_te_activation_func=True)
    spec = _layer(ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                  linear_fc2=RowParallelLinear)))
    plain = build_module(spec.submodules.mlp, config=plain_cfg)
    with_op = build_module(_with_activation_op(spec, ActivationOp).submodules.mlp, config=op_cfg)
    assert isinstance(with_op.activation_func, ActivationOp)
    assert not isinstance(plain.activation_func, torch.nn.Module)
    with_op.load_state_dict(plain.state_dict())
    x = torch.randn(5, 2, 16)
    (a, a_bias), (b, b_bias) = plain(x), with_op(x)
    return torch.equal(a, b) and (a_bias is None) == (b_bias is None)


@pytest.mark.parametrize("bias", [False, True])
def test_megatron_core_s_mlp_with_the_op_computes_the_plain_swiglu(bias):
    """The seam itself, built: megatron-core's MLP from a spec with the activation module our transform sets,
    under `use_te_activation_func`, hands the module fc1's whole output (with its bias added) and gives the plain
    MLP's output with the same weights (local linear layers and the stand-in op on a CPU; TE's op on the GPU,
    tests/gpu/test_paths.py)."""
    from tests import _cpu

    assert _cpu.run_world(1, _plain_and_op_mlp_agree, bias) == [True]


def test_the_provider_refuses_an_mlp_left_with_a_plain_activation():
    """`training.model.check_built` with `--use-te-activation-func`: every module with fc1 and an activation (a
    dense MLP, an expert's, a grouped experts module) must hold TE's op, not a function megatron-core would apply to
    fc1's whole output."""
    from megatron_patch.training.model import check_built

    def mlp(activation):
        m = torch.nn.Module()
        m.linear_fc1 = torch.nn.Linear(2, 4)
        m.activation_func = activation
        return m

    on = types.SimpleNamespace(use_te_activation_func=True)
    model = torch.nn.ModuleList([mlp(ActivationOp(None)), mlp(ActivationOp(None))])
    check_built(model, on, post_process=False)
    check_built(torch.nn.ModuleList([mlp(F.silu)]), types.SimpleNamespace(), post_process=False)
    with pytest.raises(ValueError, match="built Module with a plain activation function, not Transformer Engine's"):
        check_built(torch.nn.ModuleList([mlp(ActivationOp(None)), mlp(F.silu)]), on, post_process=False)


def test_the_pretrain_arguments_turn_megatron_s_compiled_swiglu_off_and_refuse_other_activations():
    """`training.arguments.apply_te_activation`: megatron-core refuses its compiled SwiGLU (`--bias-swiglu-fusion`,
    on by default) together with TE's activation, so the option turns it off; a model TE's op would compute
    otherwise is refused at parse time."""
    import argparse

    from megatron_patch.training.arguments import apply_te_activation

    args = argparse.Namespace(use_te_activation_func=True, transformer_impl="transformer_engine",
                              bias_swiglu_fusion=True, bias_gelu_fusion=True)
    apply_te_activation(args, {"activation_func": F.silu, "gated_linear_unit": True})
    assert args.bias_swiglu_fusion is False and args.bias_gelu_fusion is False
    with pytest.raises(UnsupportedConfig, match="this model's MLP is not gated, with gelu"):
        apply_te_activation(args, {"activation_func": F.gelu, "gated_linear_unit": False})
    off = argparse.Namespace(use_te_activation_func=False, bias_swiglu_fusion=True)
    apply_te_activation(off, {"activation_func": F.gelu, "gated_linear_unit": False})
    assert off.bias_swiglu_fusion is True


def test_every_family_is_taken_or_refused_in_one_line():
    """`apply_te_activation` on every tiny family config of the suite: SwiGLU models are taken, every other model is
    refused with the option's one line (never an AttributeError for a field a family's arguments leave out)."""
    import argparse

    from megatron_patch.models import get_family
    from megatron_patch.training.arguments import apply_te_activation
    from tests.models import FAMILY_VARIANTS, LLAMA_VARIANTS, OTHER_VARIANTS, any_config

    taken, refused = [], []
    for variant in [*LLAMA_VARIANTS, *FAMILY_VARIANTS, *OTHER_VARIANTS]:
        cfg = any_config(variant)
        args = argparse.Namespace(use_te_activation_func=True, transformer_impl="transformer_engine",
                                  bias_swiglu_fusion=True, bias_gelu_fusion=True)
        try:
            apply_te_activation(args, get_family(cfg).config_kwargs(cfg))
            taken.append(variant)
        except UnsupportedConfig as e:
            assert str(e).startswith("--use-te-activation-func: megatron-core maps only SwiGLU"), (variant, e)
            refused.append(variant)
    assert taken and refused, (taken, refused)
