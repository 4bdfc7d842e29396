"""`--fp8-output-layer`: what it needs (refused one line each before any model is built) and the
`fp8_output_layer` patch's gate in megatron-core >= 0.19 (the GPU run: tests/gpu/test_paths.py
`test_training_levers_train_like_the_default`)."""

from argparse import Namespace

import pytest

from megatron_patch import patches
from megatron_patch.training.arguments import check_fp8_output_layer


def _args(**over):
    return Namespace(**{"fp8_output_layer": True, "fp8": "hybrid", "model_class": "gpt",
                        "untie_embeddings_and_output_weights": True, "fp8_output_layer_impl": "auto", **over})


@pytest.mark.parametrize("over, message", [
    ({"fp8": None}, "--fp8-output-layer needs --precision fp8"),
    ({"model_class": "hybrid"}, "--fp8-output-layer needs --model-class gpt, not hybrid"),
    ({"untie_embeddings_and_output_weights": False, "fp8_output_layer_impl": "transformer_engine"},
     "--fp8-output-layer-impl transformer_engine needs untied embeddings: .* --fp8-output-layer-impl torch takes it"),
])
def test_what_it_needs(over, message):
    with pytest.raises(ValueError, match=message):
        check_fp8_output_layer(_args(**over))
    check_fp8_output_layer(_args())  # fp8, GPTModel, an output layer of its own: accepted
    check_fp8_output_layer(_args(fp8_output_layer=False, **over))  # off: nothing is checked


def _te_offered() -> bool:
    return patches.covers("fp8_output_layer")


@pytest.mark.parametrize("tied, impl, want", [
    (False, "auto", "te"), (True, "auto", "torch"), (True, "torch", "torch"), (False, "torch", "torch"),
    (False, "transformer_engine", "transformer_engine")])
def test_auto_takes_transformer_engine_s_layer_where_it_applies(tied, impl, want):
    """`auto`: Transformer Engine's output layer for an untied one where megatron-core offers it (>= 0.19), the
    FP8 GEMMs on megatron-core's own (`training.fp8_head`) for a tied one and on older megatron-core."""
    args = _args(untie_embeddings_and_output_weights=not tied, fp8_output_layer_impl=impl)
    check_fp8_output_layer(args)
    if want == "te":
        want = "transformer_engine" if _te_offered() else "torch"
    assert args.fp8_output_layer_impl == want


def test_the_patch_lifts_the_mxfp8_condition(monkeypatch):
    """megatron-core builds Transformer Engine's output layer where `is_mxfp8_output_proj_active(config)`: without
    the patch only for the MXFP8 recipe; with it for any fp8 recipe where the config asks (and TE is there)."""
    if not _te_offered():
        pytest.skip("megatron-core < 0.19 has no Transformer Engine output layer")
    from megatron.core import fp8_utils
    from megatron.core.models.gpt import gpt_model

    monkeypatch.setattr(fp8_utils, "HAVE_TE", True)
    delayed = Namespace(fp8_output_proj=True, fp8="hybrid", fp8_recipe="delayed")
    assert gpt_model.is_mxfp8_output_proj_active(delayed) is False
    with patches.applied("fp8_output_layer") as active:
        assert active
        assert gpt_model.is_mxfp8_output_proj_active(delayed) is True
        assert fp8_utils.is_mxfp8_output_proj_active(delayed) is True  # the layer's own check reads this one
        assert gpt_model.is_mxfp8_output_proj_active(Namespace(fp8_output_proj=False, fp8="hybrid")) is False
        assert gpt_model.is_mxfp8_output_proj_active(Namespace(fp8_output_proj=True, fp8=None)) is False
    assert gpt_model.is_mxfp8_output_proj_active(delayed) is False
