"""Training levers of issue 28 on the argument side: `--fused-single-qkv-rope` (megatron-core's TransformerConfig
field, which its parser lacks: ours passes it through, refused one line where megatron-core's attention would
assert at the first forward) and the default throughput profile's `--wgrad-fusion-without-apex` (never over the
user's `--wgrad-fusion-without-apex` / `--no-wgrad-fusion-without-apex`)."""

import dataclasses
from argparse import Namespace

import pytest
from megatron.core.transformer import TransformerConfig

from megatron_patch import patches
from megatron_patch.models import get_family
from megatron_patch.training.arguments import check_fp8_output_layer, check_fused_qkv_rope
from megatron_patch.training.profiles import apply_throughput_profile
from tests.models import any_config


def _rope_args(**over) -> Namespace:
    return Namespace(**{"fused_single_qkv_rope": True, "transformer_impl": "transformer_engine",
                        "position_embedding_type": "rope", "sft_data": None, **over})


def test_fused_qkv_rope_reaches_the_transformer_config():
    """The flag's destination is megatron-core's own field, which `core_transformer_config_from_args` copies."""
    assert "fused_single_qkv_rope" in {f.name for f in dataclasses.fields(TransformerConfig)}


@pytest.mark.parametrize("variant, over, message", [
    ("gqa", {"transformer_impl": "local"}, "--transformer-impl local"),
    ("bloom", {"position_embedding_type": "none"}, "position embedding none"),
    ("qwen3", {}, "query/key norm"),
    ("deepseek_v2", {}, "multi-latent attention"),
    ("gqa", {"sft_data": ["chat.jsonl"]}, "packed sequences"),
    # megatron-core calls TE's fused QKV RoPE without the interleaved flag or YaRN's mscale (attention.py,
    # `apply_fused_qkv_rotary_pos_emb(mixed_qkv, q_pos_emb, k_pos_emb, qkv_split_arg_list)`): it would rotate these
    # models' halves where their pairs are, silently, instead of asserting
    ("glm", {}, "interleaved rotary embedding"),
    ("gptj", {}, "interleaved rotary embedding"),
])
def test_fused_qkv_rope_is_refused_where_megatron_core_would_assert(variant, over, message):
    cfg = any_config(variant)
    with pytest.raises(ValueError, match=f"^--fused-single-qkv-rope cannot run with .*{message}"):
        check_fused_qkv_rope(_rope_args(**over), get_family(cfg).config_kwargs(cfg))


def test_fused_qkv_rope_is_accepted_for_llama():
    cfg = any_config("gqa")
    check_fused_qkv_rope(_rope_args(), get_family(cfg).config_kwargs(cfg))
    check_fused_qkv_rope(_rope_args(fused_single_qkv_rope=False, transformer_impl="local"), {})  # off: no check


@pytest.mark.parametrize("profile, given, expected", [
    ("default", set(), True),
    ("benchmark", set(), True),
    ("none", set(), False),                                       # Megatron's defaults
    ("default", {"--no-wgrad-fusion-without-apex"}, False),       # the user's choice wins
])
def test_default_profile_fuses_the_weight_gradients(profile, given, expected):
    args = Namespace(throughput_profile=profile, transformer_impl="local", reset_attention_mask=False,
                     lean_cross_entropy=False, wgrad_fusion_without_apex=False)
    applied = apply_throughput_profile(args, given)
    assert args.wgrad_fusion_without_apex is expected
    assert ("wgrad_fusion_without_apex" in applied) == expected


_TE_HEAD = patches.covers("fp8_output_layer")


@pytest.mark.parametrize("over, given, lm_head, expected", [
    ({}, set(), True, _TE_HEAD),                                  # where the convergence study trained it
    ({"throughput_profile": "benchmark"}, set(), True, _TE_HEAD),
    ({"throughput_profile": "none"}, set(), True, False),         # Megatron's defaults
    ({}, {"--no-fp8-output-layer"}, True, False),                 # the user's choice wins
    ({"fp8": None}, set(), True, False),                          # bf16
    ({"fp8_recipe": "tensorwise"}, set(), True, False),           # another recipe: not in the study
    ({"untie_embeddings_and_output_weights": False}, set(), True, False),  # tied: the torch layer, not in the study
    ({"fp8_output_layer_impl": "torch"}, set(), True, False),
    ({"model_class": "hybrid"}, set(), True, False),
    ({}, set(), False, False),                                    # a reward model's one-label head
])
def test_default_profile_puts_the_output_layer_in_fp8_where_it_was_studied(over, given, lm_head, expected):
    """The default and benchmark profiles take `--fp8-output-layer` (+11% tokens/s in fp8 at LLaMA-3-8B widths) on
    what docs/convergence.md trained: Transformer Engine's layer (untied embeddings, megatron-core 0.19 through the
    `fp8_output_layer` patch) under the delayed recipe; nowhere else."""
    args = Namespace(**{"throughput_profile": "default", "transformer_impl": "transformer_engine",
                        "reset_attention_mask": False, "lean_cross_entropy": False, "wgrad_fusion_without_apex": False,
                        "fp8": "hybrid", "fp8_recipe": "delayed", "model_class": "gpt",
                        "untie_embeddings_and_output_weights": True, "fp8_output_layer": False,
                        "fp8_output_layer_impl": "auto", **over})
    applied = apply_throughput_profile(args, given, lm_head=lm_head)
    assert args.fp8_output_layer is expected and ("fp8_output_layer" in applied) == expected


def test_a_reward_model_refuses_the_fp8_output_layer():
    args = Namespace(fp8_output_layer=True, fp8="hybrid", model_class="gpt", untie_embeddings_and_output_weights=True,
                     fp8_output_layer_impl="auto")
    with pytest.raises(ValueError, match="one-label head"):
        check_fp8_output_layer(args, lm_head=False)
