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


_AWARE_ARGS = {"throughput_profile": "default", "transformer_impl": "transformer_engine", "reset_attention_mask": False,
               "lean_cross_entropy": False, "wgrad_fusion_without_apex": False, "fp8": None, "bf16": True,
               "use_distributed_optimizer": True, "optimizer": "adam", "lora_rank": None, "lora_import": None,
               "optimizer_cpu_offload": False, "cpu": False, "use_precision_aware_optimizer": False,
               "fp8_recipe": "delayed", "model_class": "gpt", "untie_embeddings_and_output_weights": True,
               "fp8_output_layer": False, "fp8_output_layer_impl": "auto"}


@pytest.mark.parametrize("over, given, te, expected", [
    ({}, set(), True, True),                                      # where it was measured: bf16, distributed Adam
    ({"throughput_profile": "benchmark"}, set(), True, True),
    ({"throughput_profile": "none"}, set(), True, False),         # Megatron's defaults
    ({}, {"--no-use-precision-aware-optimizer"}, True, False),    # the user's choice wins
    ({}, set(), False, False),                                    # no Transformer Engine: no FusedAdam to keep them
    ({"use_distributed_optimizer": False}, set(), True, False),   # megatron-core asserts it
    ({"optimizer": "sgd"}, set(), True, False),
    ({"bf16": False}, set(), True, False),                        # fp32 / fp16 parameters: no remainders
    ({"fp8": "hybrid"}, set(), True, False),                      # not measured in FP8
    ({"lora_rank": 8}, set(), True, False),                       # adapters only: not measured
    ({"optimizer_cpu_offload": True}, set(), True, False),
])
def test_default_profile_keeps_master_weights_as_remainders_where_measured(monkeypatch, over, given, te, expected):
    """The default and benchmark profiles take `--use-precision-aware-optimizer` (5.2 GB less at LLaMA-3-8B widths,
    the same speed) with the distributed optimizer, Adam and bf16 parameters, where Transformer Engine is installed;
    nowhere else."""
    from megatron_patch.models import build

    monkeypatch.setattr(build, "transformer_engine_available", lambda: te)
    args = Namespace(**{**_AWARE_ARGS, **over})
    applied = apply_throughput_profile(args, given)
    assert args.use_precision_aware_optimizer is expected
    assert ("use_precision_aware_optimizer" in applied) == expected


def test_no_use_precision_aware_optimizer_is_a_flag_of_the_command_line():
    """`--no-use-precision-aware-optimizer` parses (Megatron's parser offers only the `--use-` form) and leaves it off
    (a resumed run follows its checkpoint where neither flag is given: `match_resumed_optimizer`); without it the
    attribute is Megatron's default, off."""
    import argparse

    from megatron_patch.training.arguments import add_patch_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--use-precision-aware-optimizer", action="store_true")  # Megatron's, added first
    parser = add_patch_args(parser)
    assert parser.parse_args([]).use_precision_aware_optimizer is False
    assert parser.parse_args(["--use-precision-aware-optimizer"]).use_precision_aware_optimizer is True
    assert parser.parse_args(["--use-precision-aware-optimizer", "--no-use-precision-aware-optimizer"]
                             ).use_precision_aware_optimizer is False


@pytest.fixture(scope="module")
def training_checkpoint(tmp_path_factory):
    """A torch_dist checkpoint folder as training leaves it: `iter_0000002/` and the tracker's "2" (a converted
    tiny model, its saved arguments those of the converter: no distributed optimizer)."""
    import os

    from megatron_patch.conversion.convert import hf_to_mcore
    from megatron_patch.names import TRACKER
    from tests.helpers import tiny_lm_folder

    root = tmp_path_factory.mktemp("resume")
    ckpt = str(root / "ckpt")
    hf_to_mcore(tiny_lm_folder(str(root / "hf")), ckpt)
    os.rename(os.path.join(ckpt, "release"), os.path.join(ckpt, "iter_0000002"))
    with open(os.path.join(ckpt, TRACKER), "w") as f:
        f.write("2")
    return ckpt


def _resume_args(load: str | None, **over) -> Namespace:
    return Namespace(**{"load": load, "no_load_optim": None, "finetune": False, "ckpt_step": None,
                        "use_precision_aware_optimizer": True, "use_distributed_optimizer": True, "bf16": True,
                        **over})


def test_a_resumed_run_keeps_the_plain_optimizer_of_its_checkpoint(training_checkpoint, capsys):
    """Where no flag of the command line chose the precision-aware optimizer (a throughput profile's setting) and the
    checkpoint's optimizer state holds fp32 master weights (saved without it: here read from the checkpoint's own
    saved arguments), the run resumes without it and says so; megatron-core would read the fp32 values as 16-bit
    remainders without a word."""
    from megatron_patch.training.checkpoint import match_resumed_optimizer

    args = _resume_args(training_checkpoint)
    match_resumed_optimizer(args, set())
    assert args.use_precision_aware_optimizer is False
    assert "iter_0000002 was saved without --use-precision-aware-optimizer" in capsys.readouterr().err


@pytest.mark.parametrize("over", [{"no_load_optim": True}, {"finetune": True}, {"load": None}])
def test_no_optimizer_state_loaded_leaves_the_setting(training_checkpoint, over):
    """--no-load-optim, --finetune, or nothing to resume: the optimizer starts afresh, in the run's own setting."""
    from megatron_patch.training.checkpoint import match_resumed_optimizer

    args = _resume_args(**{"load": training_checkpoint, **over})
    match_resumed_optimizer(args, {"--use-precision-aware-optimizer"})
    assert args.use_precision_aware_optimizer is True


def test_a_converted_checkpoint_has_no_optimizer_state(training_checkpoint, tmp_path):
    """A `release` folder (the converter's) and a --ckpt-step without a folder: nothing to match."""
    import shutil

    from megatron_patch.names import TRACKER
    from megatron_patch.training.checkpoint import match_resumed_optimizer, resumed_optimizer_args

    release = str(tmp_path / "release-ckpt")
    shutil.copytree(training_checkpoint, release)
    (tmp_path / "release-ckpt" / TRACKER).write_text("release")
    assert resumed_optimizer_args(_resume_args(release)) is None
    assert resumed_optimizer_args(_resume_args(training_checkpoint, ckpt_step=5)) is None
    assert resumed_optimizer_args(_resume_args(training_checkpoint, ckpt_step=2))[0].endswith("iter_0000002")
    args = _resume_args(release)
    match_resumed_optimizer(args, {"--use-precision-aware-optimizer"})
    assert args.use_precision_aware_optimizer is True


def _saved_with(monkeypatch, **saved):
    from megatron_patch import compat

    monkeypatch.setattr(compat, "load_torch_dist_common", lambda step_dir: {"args": Namespace(**saved)})


@pytest.mark.parametrize("given, over, message", [
    ({"--use-precision-aware-optimizer"}, {}, "saved without --use-precision-aware-optimizer (its optimizer state "
     "holds fp32 master weights), which --use-precision-aware-optimizer cannot load; resume with "
     "--no-use-precision-aware-optimizer, or pass --no-load-optim"),
])
def test_the_command_lines_other_choice_is_refused(training_checkpoint, given, over, message):
    """The user's own flag against the checkpoint's layout: one line naming the checkpoint and the ways out."""
    from megatron_patch.training.checkpoint import match_resumed_optimizer

    with pytest.raises(ValueError, match="iter_0000002 was ") as e:
        match_resumed_optimizer(_resume_args(training_checkpoint, **over), given)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("given, over, expected", [
    (set(), {"use_precision_aware_optimizer": False}, True),       # profile none, or a run it does not suit: follow
    ({"--no-use-precision-aware-optimizer"}, {"use_precision_aware_optimizer": False},
     "which --no-use-precision-aware-optimizer cannot load; resume with --use-precision-aware-optimizer"),
    (set(), {"use_precision_aware_optimizer": False, "use_distributed_optimizer": False},
     "which this run (it needs the distributed optimizer and bf16) cannot load"),
    (set(), {"use_precision_aware_optimizer": False, "bf16": False}, "it needs the distributed optimizer and bf16"),
    (set(), {}, True),                                             # the same layout: nothing to do
])
def test_a_precision_aware_checkpoint_resumes_precision_aware(training_checkpoint, monkeypatch, given, over,
                                                               expected):
    """A checkpoint saved with --use-precision-aware-optimizer (the master weights as 16-bit remainders): a run
    whose flag came from no command line takes it again; the command line's --no-use-precision-aware-optimizer,
    or a run that cannot take it, is refused in one line."""
    from megatron_patch.training.checkpoint import match_resumed_optimizer

    _saved_with(monkeypatch, use_precision_aware_optimizer=True, use_distributed_optimizer=True)
    args = _resume_args(training_checkpoint, **over)
    if expected is True:
        match_resumed_optimizer(args, given)
        assert args.use_precision_aware_optimizer is True
    else:
        with pytest.raises(ValueError, match="saved with --use-precision-aware-optimizer") as e:
            match_resumed_optimizer(args, given)
        assert expected in str(e.value), e.value


def test_a_checkpoint_saved_without_optimizer_state_leaves_the_setting(training_checkpoint, monkeypatch):
    """--no-save-optim: megatron.training loads no optimizer state from it."""
    from megatron_patch.training.checkpoint import match_resumed_optimizer

    _saved_with(monkeypatch, use_precision_aware_optimizer=False, use_distributed_optimizer=True, no_save_optim=True)
    args = _resume_args(training_checkpoint)
    match_resumed_optimizer(args, {"--use-precision-aware-optimizer"})
    assert args.use_precision_aware_optimizer is True
