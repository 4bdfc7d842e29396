"""The throughput profile's attention: `--attention-backend flash` (Transformer Engine → FlashAttention-4) only
where the run's attention is what was measured (plain causal softmax over whole sequences, head dim 64 / 128),
only on a Hopper GPU whose TE found FA4, never over the user's own choice."""

import argparse

import pytest
from megatron.core.transformer.enums import AttnBackend

from megatron_patch.models import get_family
from megatron_patch.models.megatron_args import megatron_lm_args
from megatron_patch.training import profiles
from tests.models import any_config


def _run(variant: str = "gqa", **overrides) -> tuple[argparse.Namespace, dict]:
    """Arguments and TransformerConfig arguments as parse_args has them for `variant`, at head dim 128."""
    cfg = any_config(variant)
    model = {**get_family(cfg).config_kwargs(cfg), "kv_channels": 128}
    args = argparse.Namespace(
        transformer_impl="transformer_engine", reset_attention_mask=False, context_parallel_size=1,
        fp8_dot_product_attention=False, attention_backend=AttnBackend.auto, throughput_profile="default",
        create_attention_mask_in_dataloader=True, **megatron_lm_args(cfg))
    args.attention_dropout = 0.0  # the tiny configs' value; a training choice, tested below
    for key, value in overrides.items():
        setattr(args, key, value)
    return args, model


@pytest.mark.parametrize("variant", ["gqa", "mha", "qwen2", "mixtral", "gpt_neox", "starcoder"])
def test_plain_causal_attention_suits(variant, monkeypatch):
    for name in profiles.BACKEND_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert profiles.flash_attention_suits(*_run(variant))


@pytest.mark.parametrize("variant, overrides, model", [
    ("bloom", {}, {}),                                    # ALiBi: position embedding "none"
    ("mistral_swa", {}, {}),                              # sliding window
    ("deepseek_v2", {}, {}),                              # multi-latent attention
    ("gqa", {"transformer_impl": "local"}, {}),
    ("gqa", {"reset_attention_mask": True}, {}),          # packed documents
    ("gqa", {"sft_data": ["chat.jsonl"]}, {}),            # SFT packs conversations (THD)
    ("gqa", {"context_parallel_size": 2}, {}),
    ("gqa", {"attention_dropout": 0.1}, {}),              # FA4 has no dropout
    ("gqa", {"fp8_dot_product_attention": True}, {}),
    ("gqa", {}, {"kv_channels": 96}),                     # not a measured head dim
    ("gqa", {}, {"softmax_type": "learnable"}),           # attention sinks
])
def test_other_attention_keeps_megatrons_choice(variant, overrides, model, monkeypatch):
    for name in profiles.BACKEND_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    args, kwargs = _run(variant, **overrides)
    assert not profiles.flash_attention_suits(args, {**kwargs, **model})


def test_users_nvte_variable_keeps_megatrons_choice(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")  # megatron-core asserts the variables agree with the backend
    assert not profiles.flash_attention_suits(*_run())


@pytest.mark.parametrize("fa4, profile, given, expected", [
    (True, "default", set(), AttnBackend.flash),
    (True, "benchmark", set(), AttnBackend.flash),
    (True, "none", set(), AttnBackend.auto),                       # Megatron's defaults
    (True, "default", {"--attention-backend"}, AttnBackend.auto),   # the user's flag wins (here: its value auto)
    (False, "default", set(), AttnBackend.auto),                    # no FA4 / not Hopper
])
def test_profile_sets_flash_only_with_fa4_on_hopper(fa4, profile, given, expected, monkeypatch):
    for name in profiles.BACKEND_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(profiles, "te_runs_fa4_on_hopper", lambda: fa4)
    args, model = _run(throughput_profile=profile)
    applied = profiles.apply_throughput_profile(args, given, model)
    assert args.attention_backend is expected
    assert ("attention_backend" in applied) == (expected is AttnBackend.flash)


def test_no_fa4_here():
    """This machine (no GPU) never takes the flash backend."""
    assert profiles.te_runs_fa4_on_hopper() is False
