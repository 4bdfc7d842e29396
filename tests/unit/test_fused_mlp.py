"""`--use-transformer-engine-op-fuser` on our layer specs (`models.modules.fused_mlp`): every dense MLP of a
Transformer Engine layer becomes megatron-core's `TEFusedMLP` with the same submodules, mixture-of-experts
layers stay as they are, and what has no fused form is refused in one line. Transformer Engine is absent on a
CPU machine, so its classes are stand-ins here; tests/gpu/test_paths.py trains with the real ones."""

import dataclasses
import functools
import types

import pytest
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_patch.models.family import UnsupportedConfig
from megatron_patch.models.modules import mlp_class
from megatron_patch.models.modules.fused_mlp import with_te_fused_mlp


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
