"""Arguments: everything Megatron-LM accepts, plus a few named additions (`--hf-config`, `--load-hf`,
`--save-hf`, `--precision`, `--cpu`, `--throughput-profile`, `--model-class`). The model architecture comes from
the HF `config.json` and is written into Megatron's own arguments (`models/megatron_args.py`: layers, widths,
heads, norms, positions, ...) before megatron validates them, so its bookkeeping (pipeline split, FLOP counts,
checkpoint `args`) sees the real model; the model itself is built by the family (`training/model.py`).

`parse_args` runs the steps in one order before megatron validates the arguments: the machine and `--cpu`
(`device.py`), numbers (`checks.py`), architecture, model class, precision (`device.py`), throughput profile
(`profiles.py`), data and splits (`checks.py`), schedule, LoRA, exports (`checks.py`), tokenizer; after
validation, the tokenizer against the model's vocab. Each refusal is a ValueError naming the flag.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from megatron_patch.models import Layout, get_family, load_hf_config
from megatron_patch.models.build import MODEL_CLASSES
from megatron_patch.models.megatron_args import megatron_lm_args
from megatron_patch.names import HF_SUBDIR, TRACKER
from megatron_patch.training.checkpoint import match_resumed_optimizer
from megatron_patch.training.checks import check_data_paths, check_exports, check_numbers, check_splits
from megatron_patch.training.device import PRECISIONS, apply_precision, select_device
from megatron_patch.training.profiles import THROUGHPUT_PROFILES, apply_throughput_profile, fp8_head_impl

_TRAINING_CHOICES = {"hidden_dropout", "attention_dropout", "init_method_std"}
GROUP_PREFIX = "megatron_patch"  # our argument groups: listed first in --help
DEFAULT_SPLIT = "99,1,0"
DEFAULT_EVAL_INTERVAL = 1000  # Megatron-LM's historical default
FP8_HEAD_IMPLS = ("auto", "transformer_engine", "torch")  # --fp8-output-layer-impl


def add_patch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group(GROUP_PREFIX)
    g.add_argument("--hf-config", metavar="PATH",
                   help="HF config.json (or its folder): the model architecture and family; a folder's tokenizer "
                        "is the default tokenizer")
    g.add_argument("--load-hf", metavar="DIR", help="start from this HF checkpoint folder (no separate conversion "
                                                    "step; each rank reads only its own shard); implies --hf-config "
                                                    "DIR, and its tokenizer is the default")
    g.add_argument("--save-hf", metavar="DIR", help="export the final model to this HF folder (safetensors + config); "
                                                    "needs --save; checked at start: a new folder, neither --save, "
                                                    "its hf/, nor an input")
    g.add_argument("--precision", choices=PRECISIONS,
                   help="one switch for the numeric format: bf16/fp16 (Megatron's --bf16/--fp16), fp8 (bf16 with "
                        "Transformer Engine FP8 GEMMs: --fp8-format, default hybrid; --fp8-recipe, default delayed) "
                        "or fp32; checked against the machine before any GPU work")
    g.add_argument("--throughput-profile", choices=THROUGHPUT_PROFILES, default="default",
                   help="default: Megatron settings that make a step cheaper without changing the numbers beyond "
                        "bf16 rounding (manual GC every 100 iterations, fused cross-entropy (--lean-cross-entropy), "
                        "weight gradients accumulated in fp32 inside the GEMM (--wgrad-fusion-without-apex), "
                        "the fp32 master weights as bf16 parameter + 16-bit remainder "
                        "(--use-precision-aware-optimizer, with the distributed optimizer in bf16), no attention mask "
                        "from the data loader where Transformer Engine's causal kernels ignore it); benchmark: "
                        "also skip the per-step safety checks (NaN/Inf in loss and gradients, rerun validation); "
                        "none: Megatron's own defaults. A flag given on the command line always wins")
    g.add_argument("--lean-cross-entropy", action=argparse.BooleanOptionalAction, default=False,
                   help="the loss's cross-entropy in two Triton kernels over the logits as they are (bf16), keeping "
                        "no fp32 copy of the [tokens, vocabulary] logits (megatron-core's keeps one, 4 bytes a "
                        "token a vocabulary entry: 3.9 GiB at seq 8192 and a 128k vocabulary); the same loss up to "
                        "fp32 rounding; implies --cross-entropy-loss-fusion. On in the default and benchmark "
                        "throughput profiles unless a cross-entropy flag is given; --no-lean-cross-entropy: "
                        "megatron-core's own")
    g.add_argument("--wgrad-fusion-without-apex", action=argparse.BooleanOptionalAction, default=False,
                   help="with --gradient-accumulation-fusion (Megatron's default) and no Apex, megatron-core's own "
                        "linear layers (the output layer; every layer under --transformer-impl local) accumulate "
                        "their weight gradients into the fp32 main_grad inside the GEMM (Transformer Engine's "
                        "cuBLAS call), as Transformer Engine's layers do, instead of a bf16 gradient and an add "
                        "(megatron-core needs Apex's extension for that). On in the default and benchmark "
                        "throughput profiles; --no-wgrad-fusion-without-apex leaves it out")
    g.add_argument("--no-use-precision-aware-optimizer", dest="use_precision_aware_optimizer", action="store_false",
                   default=False, help="leave out Megatron's --use-precision-aware-optimizer, which the default and "
                                       "benchmark throughput profiles take with the distributed optimizer in bf16. "
                                       "Without either flag a resumed run takes the setting its checkpoint was saved "
                                       "with")
    g.add_argument("--fp8-output-layer", action=argparse.BooleanOptionalAction, default=False,
                   help="with --precision fp8, the output layer's GEMMs (logits, their input gradient and the "
                        "weight gradient) in FP8 too (otherwise they stay bf16); needs --model-class gpt. On in "
                        "the default and benchmark throughput profiles where the convergence study trained it "
                        "(docs/convergence.md): the delayed recipe, untied embeddings, Transformer Engine's layer "
                        "(megatron-core 0.19); --no-fp8-output-layer leaves it out. How: --fp8-output-layer-impl")
    g.add_argument("--fp8-output-layer-impl", choices=FP8_HEAD_IMPLS, default="auto",
                   help="transformer_engine: Transformer Engine's output layer under the run's recipe "
                        "(megatron-core >= 0.19 offers it for MXFP8 only; needs untied embeddings); torch: "
                        "megatron-core's own output layer with its three GEMMs in FP8 by torch._scaled_mm, each "
                        "tensor scaled as it is cast (current scaling), a tied weight included; auto: "
                        "transformer_engine where it applies, torch otherwise")
    g.add_argument("--fused-single-qkv-rope", action=argparse.BooleanOptionalAction, default=False,
                   help="RoPE on the fused QKV projection's output in one Transformer Engine kernel, without "
                        "splitting it into query, key and value first (megatron-core's TransformerConfig field, "
                        "which its parser does not offer); needs Transformer Engine, plain RoPE (not interleaved, "
                        "YaRN or multimodal), no query/key norm, no multi-latent attention and no packed "
                        "sequences (SFT)")
    g.add_argument("--model-class", choices=MODEL_CLASSES, default="gpt",
                   help="gpt: megatron-core's GPTModel; hybrid: its HybridModel (megatron-core >= 0.19), the same "
                        "model with attention and MLP as separate layers (--hybrid-layer-pattern comes from the "
                        "family); both load the same checkpoints (docs/hybrid.md)")
    g.add_argument("--cpu", action="store_true",
                   help="train on the CPU, without a GPU (tiny models: debugging a recipe on a laptop): the local "
                        "implementation, CPU initialisation, gloo, no fused kernels; Transformer Engine, fp8, nccl, "
                        "sequence parallelism and the distributed optimizer are refused. Without it, a machine "
                        "with no CUDA GPU is an error")
    from megatron_patch.lora.training import add_lora_args

    return add_lora_args(parser)


def _order_help(parser: argparse.ArgumentParser, prog: str | None, description: str | None) -> None:
    """`--help` works and lists our options first: our groups go before Megatron-LM's, and help strings
    with a stray `%` (megatron-core 0.19.2 has one, which makes argparse's --help raise) are escaped."""
    ours = [g for g in parser._action_groups if (g.title or "").startswith(GROUP_PREFIX)]
    rest = [g for g in parser._action_groups if g not in ours]
    parser._action_groups[:] = rest[:2] + ours + rest[2:]  # after "positional arguments" and "options"
    for action in parser._actions:
        if isinstance(action.help, str):
            try:
                action.help % dict(vars(action), prog=parser.prog)
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")
    if prog:
        parser.prog = prog
    # the usage line names ours (Megatron-LM's several hundred options follow in the help)
    formatter = parser._get_formatter()
    formatter.add_usage(None, [a for g in ours for a in g._group_actions], [], prefix="")
    parser.usage = formatter.format_help().strip() + " [Megatron-LM arguments ...]"
    if description:
        parser.description = description.strip() + "\n\nOur options come first; every Megatron-LM argument follows."
        parser.formatter_class = argparse.RawDescriptionHelpFormatter


def given_flags(argv: list[str]) -> set[str]:
    """The options named on a command line (`--flag value` and `--flag=value`)."""
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def hf_config_source(args: argparse.Namespace) -> str:
    """Where the HF config comes from: --hf-config, --load-hf, or a checkpoint's `hf/` folder (--load;
    converted by megatron_patch, or saved by a run of ours)."""
    for source in (args.hf_config, args.load_hf):
        if source:
            return source
    if args.load and os.path.isfile(os.path.join(args.load, HF_SUBDIR, "config.json")):
        return os.path.join(args.load, HF_SUBDIR)
    raise ValueError("no model architecture: pass --hf-config PATH (an HF config.json or folder), --load-hf DIR, "
                     "or --load a checkpoint converted by megatron_patch")


def parse_args(argv: list[str] | None = None, extra_args_provider=None, indexed_data: bool = True,
               prog: str | None = None, description: str | None = None,
               adjust: Callable[[argparse.Namespace], None] | None = None,
               lm_head: bool = True) -> tuple[argparse.Namespace, dict]:
    """Megatron's argument parsing with our additions and the HF architecture applied; sets megatron's
    global args (and tokenizer) like `parse_and_validate_args`. `adjust(args)` settles an entry point's own
    arguments before megatron validates them; `lm_head`: the model's output layer is the vocabulary's (False:
    a reward model's one-label head). Returns (args, hf_config)."""
    from megatron.training.arguments import parse_args as megatron_parse_args
    from megatron.training.arguments import validate_args
    from megatron.training.global_vars import set_global_variables

    def extra(parser):
        parser = add_patch_args(parser)
        parser = extra_args_provider(parser) if extra_args_provider else parser
        _order_help(parser, prog, description)
        return parser

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    args = megatron_parse_args(extra)
    given = given_flags(sys.argv[1:])
    select_device(args, given)
    check_numbers(args)
    args.hf_config = hf_config_source(args)
    hf_config = load_hf_config(args.hf_config)
    for key, value in megatron_lm_args(hf_config).items():
        flag = "--" + key.replace("_", "-")
        if flag in given and key in _TRAINING_CHOICES:
            continue  # dropout is the user's training choice; the HF value is only the default
        if flag in given and getattr(args, key) != value:
            raise ValueError(f"{flag} {getattr(args, key)} conflicts with the HF config ({value}); the "
                             "architecture comes from --hf-config / --load-hf")
        setattr(args, key, value)
    apply_model_class(args, hf_config)
    apply_precision(args)
    # megatron prints the resulting arguments at start
    model_kwargs = get_family(hf_config).config_kwargs(hf_config)
    apply_throughput_profile(args, given, model_kwargs, lm_head)
    match_resumed_optimizer(args, given)
    apply_lean_cross_entropy(args, given)
    check_fp8_output_layer(args, lm_head)
    check_fused_qkv_rope(args, model_kwargs)
    apply_te_activation(args, model_kwargs)
    if indexed_data:
        check_data_paths(args)
        if args.split is None and (args.data_path or args.data_args_path):
            args.split = DEFAULT_SPLIT
        no_validation = "validation" not in check_splits(args) and (
            f"--split {args.split} gives validation no share" if args.split else "no --valid-data-path")
    else:
        no_validation = "this entry point trains without a validation set"
    settle_schedule(args, no_validation, given)
    if args.save_hf and not args.save:
        raise ValueError("--save-hf exports the final checkpoint: it needs --save DIR")
    from megatron_patch.lora.training import check_lora_args

    check_lora_args(args, hf_config)
    check_exports(args)
    default_tokenizer(args)
    if adjust is not None:
        adjust(args)
    validate_args(args, {})
    set_global_variables(args)
    _match_vocab(args, hf_config)
    # resuming a run (a checkpoint in --load) wins over --load-hf
    args.resuming = bool(args.load) and os.path.isfile(os.path.join(args.load, TRACKER))
    return args, hf_config


def apply_lean_cross_entropy(args: argparse.Namespace, given: set[str]) -> None:
    """`--lean-cross-entropy` runs through megatron-core's fused cross-entropy call (the `lean_cross_entropy`
    patch takes its place, `training.run`): it sets that fusion on, and refuses another implementation."""
    if not args.lean_cross_entropy:
        return
    if "--cross-entropy-fusion-impl" in given and args.cross_entropy_fusion_impl != "native":
        raise ValueError(f"--lean-cross-entropy takes the place of --cross-entropy-fusion-impl native, not "
                         f"{args.cross_entropy_fusion_impl}")
    args.cross_entropy_loss_fusion, args.cross_entropy_fusion_impl = True, "native"


def check_fp8_output_layer(args: argparse.Namespace, lm_head: bool = True) -> None:
    """`--fp8-output-layer` needs fp8 training (Transformer Engine), GPTModel and a vocabulary head (`lm_head`; a
    reward model's one-label head is too narrow for FP8's GEMMs); `--fp8-output-layer-impl auto` becomes the
    implementation that applies (`profiles.fp8_head_impl`)."""
    if not args.fp8_output_layer:
        return
    if not getattr(args, "fp8", None):
        raise ValueError("--fp8-output-layer needs --precision fp8")
    if getattr(args, "model_class", "gpt") != "gpt":
        raise ValueError(f"--fp8-output-layer needs --model-class gpt, not {args.model_class}")
    if not lm_head:
        raise ValueError("--fp8-output-layer: this model's output layer is a one-label head (a reward model's), "
                         "not the vocabulary's; FP8 GEMMs need dimensions of 16 and more")
    impl = fp8_head_impl(args)
    if impl == "transformer_engine" and not args.untie_embeddings_and_output_weights:
        raise ValueError("--fp8-output-layer-impl transformer_engine needs untied embeddings: this model's output "
                         "layer shares the word embedding's weight (tie_word_embeddings in its HF config); "
                         "--fp8-output-layer-impl torch takes it")
    args.fp8_output_layer_impl = impl


def check_fused_qkv_rope(args: argparse.Namespace, model: dict) -> None:
    """`--fused-single-qkv-rope` where megatron-core's attention takes it (otherwise it asserts at the first
    forward): Transformer Engine, RoPE, no query/key norm, no multi-latent attention, no packed sequences; and
    where it computes the model's rotation: megatron-core hands Transformer Engine's fused QKV RoPE neither the
    interleaved layout nor YaRN's mscale nor multimodal sections (it would rotate the wrong pairs silently).
    `model`: the family's TransformerConfig arguments."""
    if not getattr(args, "fused_single_qkv_rope", False):
        return
    refused = [("--transformer-impl local", args.transformer_impl != "transformer_engine"),
               (f"position embedding {args.position_embedding_type}", args.position_embedding_type != "rope"),
               ("this model's query/key norm", bool(model.get("qk_layernorm"))),
               ("multi-latent attention", bool(model.get("multi_latent_attention"))),
               ("SFT's packed sequences (--sft-data)", bool(getattr(args, "sft_data", None))),
               ("this model's interleaved rotary embedding", bool(model.get("rotary_interleaved"))),
               ("YaRN's rotary scaling", model.get("rope_type") == "yarn"),
               ("multimodal RoPE sections", model.get("mrope_section") is not None)]
    for what, bad in refused:
        if bad:
            raise ValueError(f"--fused-single-qkv-rope cannot run with {what}: it needs Transformer Engine, "
                             "plain RoPE (not interleaved, YaRN or multimodal), no query/key norm, no multi-latent "
                             "attention and no packed sequences")


def apply_te_activation(args: argparse.Namespace, model: dict) -> None:
    """`--use-te-activation-func` (megatron's option: Transformer Engine's SwiGLU op as each MLP's activation,
    `models.modules.fused_mlp`): refused where that op would compute another activation than the model's
    (`model`: the family's TransformerConfig arguments); megatron's `--bias-swiglu-fusion` (on by default) is the
    compiled activation it replaces, which megatron-core refuses to have together with it, so it goes off."""
    if not getattr(args, "use_te_activation_func", False):
        return
    from megatron_patch.models.modules.fused_mlp import check_te_activation

    check_te_activation(argparse.Namespace(**{**model, "transformer_impl": args.transformer_impl}))
    args.bias_swiglu_fusion = args.bias_gelu_fusion = False


def apply_model_class(args: argparse.Namespace, hf_config: Any) -> None:
    """`--model-class hybrid`: megatron's `--hybrid-layer-pattern` (and layer count) from the family, which
    also makes megatron.training load GPT-format checkpoints into it (megatron-core's interop)."""
    given, pattern = getattr(args, "hybrid_layer_pattern", None), None
    if args.model_class == "hybrid":
        from megatron_patch.models import hybrid  # a clear error on megatron-core < 0.19
        from megatron_patch.models.build import transformer_config

        # the specs, without a model, say why a family has no HybridModel form (alike in both implementations)
        hybrid.hybrid_stack_spec(hf_config, transformer_config(hf_config, transformer_impl="local",
                                                               **hybrid.config_overrides(hf_config)))
        pattern = hybrid.layer_pattern(hf_config)
        args.num_layers, args.hybrid_layer_pattern = len(pattern), pattern
    if given not in (None, pattern):
        raise ValueError(f"--hybrid-layer-pattern {given}: the pattern comes from the HF config with "
                         f"--model-class hybrid ({pattern or 'not given'})")


def settle_schedule(args: argparse.Namespace, no_validation: str | bool, given: set[str]) -> None:
    """Evaluation and saving defaults that let a plain command run: no evaluation without validation data
    (`no_validation`: why there is none; megatron.training would evaluate on a loader it does not have and
    fail at the end), `--eval-interval` 1000 (megatron-core 0.18 and 0.19 leave it unset and then divide by it),
    and with `--save` but no `--save-interval`, one checkpoint at the end."""
    if no_validation:
        if args.eval_iters and "--eval-iters" in given:
            raise ValueError(f"--eval-iters {args.eval_iters}: there is no validation data to evaluate on "
                             f"({no_validation}); pass --eval-iters 0")
        args.eval_iters = 0
    if args.eval_interval is None:
        args.eval_interval = DEFAULT_EVAL_INTERVAL
    if args.save and args.save_interval is None:
        # megatron.training saves the last iteration whatever the interval
        args.save_interval = args.train_iters or sys.maxsize


def default_tokenizer(args: argparse.Namespace) -> None:
    """Without --tokenizer-type: the tokenizer of the --load-hf folder, or of the --hf-config folder when it
    holds one."""
    if args.tokenizer_type is not None or (getattr(args, "mock_data", False) and not args.load_hf):
        return
    folder = args.load_hf or (args.hf_config if os.path.isdir(args.hf_config) else os.path.dirname(args.hf_config))
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any(os.path.isfile(os.path.join(folder or ".", n)) for n in names):
        raise ValueError(f"no tokenizer: {folder or '.'} holds none ({', '.join(names)}); pass --tokenizer-type "
                         "HuggingFaceTokenizer --tokenizer-model DIR")
    args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", folder


def _match_vocab(args: argparse.Namespace, hf_config: Any) -> None:
    """The embedding has the HF config's vocab (padded as the converter pads it), which must hold
    every token id the tokenizer produces."""
    from megatron.training import get_tokenizer

    shapes = get_family(hf_config).shapes(
        hf_config, Layout(args.tensor_model_parallel_size, 1, args.make_vocab_size_divisible_by))
    tokens = get_tokenizer().vocab_size
    if tokens > shapes.vocab_size:
        raise ValueError(f"the tokenizer has {tokens} tokens but the model's vocab_size is {shapes.vocab_size} "
                         "(tokenizer and model do not match)")
    args.padded_vocab_size = shapes.padded_vocab_size
