"""Arguments: everything Megatron-LM accepts, plus a few named additions (`--hf-config`, `--load-hf`,
`--save-hf`, `--precision`, `--cpu`). The model architecture comes from the HF `config.json` and is written
into Megatron's own arguments (layers, widths, heads, norms, positions, ...) before megatron validates
them, so its bookkeeping (pipeline split, FLOP counts, checkpoint `args`) sees the real model; the model
itself is built by the family (`megatron_patch.training.model`).

Checked here, before megatron initialises (each a ValueError naming the flag): a machine without a CUDA
GPU (unless `--cpu`), settings `--cpu` cannot run, numeric flags out of range, missing data or
tokenizer, dataset splits that hold no document (megatron's dataset builder would loop forever), and the
export folders (`--save-hf`, `--save-peft`) against `--save` and the inputs.
Kept in one module (over 400 lines) because these steps run in one order before megatron validates the
arguments: machine and --cpu, numbers, architecture, precision, throughput profile, data and splits,
schedule, tokenizer.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from megatron_patch.models import Layout, get_family, load_hf_config
from megatron_patch.models.build import MODEL_CLASSES
from megatron_patch.names import HF_SUBDIR, RELEASE, TRACKER

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
_TRAINING_CHOICES = {"hidden_dropout", "attention_dropout", "init_method_std"}
GROUP_PREFIX = "megatron_patch"  # our argument groups: listed first in --help
DEFAULT_SPLIT = "99,1,0"
DEFAULT_EVAL_INTERVAL = 1000  # Megatron-LM's historical default


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
                        "bf16 rounding (manual GC every 100 iterations, fused cross-entropy, no attention mask "
                        "from the data loader where Transformer Engine's causal kernels ignore it); benchmark: "
                        "also skip the per-step safety checks (NaN/Inf in loss and gradients, rerun validation); "
                        "none: Megatron's own defaults. A flag given on the command line always wins")
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


# What --cpu sets: Megatron's flags for megatron-core on a CPU (its fused kernels are CUDA-only)
CPU_FLAGS = ("--transformer-impl local", "--use-cpu-initialization", "--distributed-backend gloo",
             "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-persist-layer-norm",
             "--no-rope-fusion", "--no-bias-swiglu-fusion", "--no-bias-gelu-fusion")
_CPU_VALUES = dict(transformer_impl="local", use_cpu_initialization=True, distributed_backend="gloo",
                   gradient_accumulation_fusion=False, masked_softmax_fusion=False, no_persist_layer_norm=True,
                   apply_rope_fusion=False, bias_swiglu_fusion=False, bias_gelu_fusion=False)


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


THROUGHPUT_PROFILES = ("none", "default", "benchmark")
# (argument, value, the flag that sets it): settings that leave the numbers as they are (up to bf16 rounding)
_NEUTRAL = (("manual_gc", True, "--manual-gc"), ("manual_gc_interval", 100, "--manual-gc-interval"),
            ("cross_entropy_loss_fusion", True, "--cross-entropy-loss-fusion"),
            ("cross_entropy_fusion_impl", "native", "--cross-entropy-fusion-impl"))
# ... and trade a per-step safety check for speed
_UNCHECKED = (("check_for_nan_in_loss_and_grad", False, "--no-check-for-nan-in-loss-and-grad"),
              ("rerun_mode", "disabled", "--rerun-mode"))


def apply_throughput_profile(args: argparse.Namespace, given: set[str]) -> dict:
    """`--throughput-profile`: the settings of the profile that the command line did not set itself.
    Returns {argument: value} as applied. The data loader's attention mask is dropped only where nothing
    reads it: Transformer Engine's causal kernels ignore it, unless documents are masked apart
    (--reset-attention-mask)."""
    if args.throughput_profile == "none":
        return {}
    settings = list(_NEUTRAL)
    if args.transformer_impl == "transformer_engine" and not args.reset_attention_mask:
        settings.append(("create_attention_mask_in_dataloader", False, "--no-create-attention-mask-in-dataloader"))
    if args.throughput_profile == "benchmark":
        settings += _UNCHECKED
    if "--manual-gc" in given:  # the user's own GC setting, interval included
        settings = [s for s in settings if s[0] != "manual_gc_interval"]
    applied = {}
    for key, value, flag in settings:
        if flag not in given:
            setattr(args, key, value)
            applied[key] = value
    return applied


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


def architecture_args(hf_config: Any) -> dict:
    """Megatron-LM argument values describing the family's model for `hf_config`."""
    family = get_family(hf_config)
    ck, gk = family.config_kwargs(hf_config), family.gpt_kwargs(hf_config)
    heads = ck["num_attention_heads"]
    groups = ck.get("num_query_groups") or heads
    position = gk.get("position_embedding_type", "learned_absolute")
    out = dict(
        num_layers=ck["num_layers"], hidden_size=ck["hidden_size"], ffn_hidden_size=ck["ffn_hidden_size"],
        num_attention_heads=heads, kv_channels=ck["kv_channels"], group_query_attention=groups != heads,
        num_query_groups=groups, normalization=ck["normalization"], norm_epsilon=ck["layernorm_epsilon"],
        swiglu=bool(ck["gated_linear_unit"]) and ck["activation_func"].__name__ == "silu",
        add_bias_linear=ck["add_bias_linear"], add_qkv_bias=ck["add_qkv_bias"], qk_layernorm=ck["qk_layernorm"],
        position_embedding_type=position, add_position_embedding=position != "rope",  # see mcore_io.checkpoint_args
        rotary_base=gk.get("rotary_base", 10000), rotary_percent=gk.get("rotary_percent", 1.0),
        rotary_interleaved=ck.get("rotary_interleaved", False),
        untie_embeddings_and_output_weights=not gk.get("share_embeddings_and_output_weights", False),
        max_position_embeddings=family.max_sequence_length(hf_config),
        hidden_dropout=ck["hidden_dropout"], attention_dropout=ck["attention_dropout"],
        init_method_std=ck["init_method_std"],
    )
    if gk.get("rope_scaling"):
        out.update(use_rope_scaling=True, rope_scaling_factor=gk["rope_scaling_factor"])
    if ck.get("num_moe_experts"):  # mixture of experts: megatron's names are the config fields but one
        out["num_experts"] = ck["num_moe_experts"]
        out.update({k: ck[k] for k in _MOE_FIELDS if k in ck})
    if ck.get("multi_latent_attention"):
        out.update({k: ck[k] for k in _MLA_FIELDS if k in ck})
    return out


_MOE_FIELDS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_pre_softmax",
               "moe_router_score_function", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
               "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
               "moe_router_topk_scaling_factor", "moe_router_dtype")
_MLA_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
               "v_head_dim", "rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "mscale",
               "mscale_all_dim", "beta_fast", "beta_slow")


def parse_args(argv: list[str] | None = None, extra_args_provider=None, indexed_data: bool = True,
               prog: str | None = None, description: str | None = None,
               adjust: Callable[[argparse.Namespace], None] | None = None) -> tuple[argparse.Namespace, dict]:
    """Megatron's argument parsing with our additions and the HF architecture applied; sets megatron's
    global args (and tokenizer) like `parse_and_validate_args`. `adjust(args)` settles an entry point's own
    arguments before megatron validates them. Returns (args, hf_config)."""
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
    for key, value in architecture_args(hf_config).items():
        flag = "--" + key.replace("_", "-")
        if flag in given and key in _TRAINING_CHOICES:
            continue  # dropout is the user's training choice; the HF value is only the default
        if flag in given and getattr(args, key) != value:
            raise ValueError(f"{flag} {getattr(args, key)} conflicts with the HF config ({value}); the "
                             "architecture comes from --hf-config / --load-hf")
        setattr(args, key, value)
    apply_model_class(args, hf_config)
    apply_precision(args)
    apply_throughput_profile(args, given)  # megatron prints the resulting arguments at start
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
    if args.load_hf and args.virtual_pipeline_model_parallel_size:
        raise ValueError("--load-hf with a virtual pipeline is not supported; convert with "
                         "toolkits.checkpoint_converter and --load instead")
    set_global_variables(args)
    _match_vocab(args, hf_config)
    # resuming a run (a checkpoint in --load) wins over --load-hf
    args.resuming = bool(args.load) and os.path.isfile(os.path.join(args.load, TRACKER))
    return args, hf_config


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
    fail at the end), `--eval-interval` 1000 (megatron-core 0.19 leaves it unset and then divides by it),
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


def select_device(args: argparse.Namespace, given: set[str]) -> None:
    """A CUDA GPU, or `--cpu`: the `cpu_training` patch and Megatron's CPU flags (`CPU_FLAGS`), refusing
    what cannot run on a CPU. The CPU test harness applies the patch itself (and passes the flags)."""
    import torch

    from megatron_patch import compat, patches

    if args.cpu:
        if torch.cuda.is_available():
            raise ValueError("--cpu: a CUDA GPU is visible to this process (CUDA was initialised before --cpu "
                             "could hide it); run with CUDA_VISIBLE_DEVICES= to train on the CPU")
        if not patches.apply("cpu_training"):
            raise ValueError(f"--cpu supports megatron-core {patches.registry()['cpu_training'].versions}, not "
                             f"{compat.megatron_core_version()}")
    elif not torch.cuda.is_available() and not patches.is_active("cpu_training"):
        raise ValueError("no CUDA GPU found; pass --cpu to run a tiny model on the CPU")
    if not patches.is_active("cpu_training"):
        return
    refused = [
        (f"--transformer-impl {args.transformer_impl}",
         args.transformer_impl != "local" and "--transformer-impl" in given),
        (f"--distributed-backend {args.distributed_backend}",
         args.distributed_backend != "gloo" and "--distributed-backend" in given),
        ("--precision fp8", args.precision == "fp8"),
        (f"--fp8-format {getattr(args, 'fp8', None)}", bool(getattr(args, "fp8", None))),
        ("--sequence-parallel", args.sequence_parallel),
        # it trains, but its checkpoints do not load back without TE's or Apex's Adam
        ("--use-distributed-optimizer", args.use_distributed_optimizer),
    ]
    for shown, bad in refused:
        if bad:
            raise ValueError(f"{shown} cannot run on the CPU (--cpu trains megatron-core's local implementation "
                             "over gloo, in fp32, bf16 or fp16, without Transformer Engine, fp8, sequence "
                             "parallelism or the distributed optimizer)")
    for key, value in _CPU_VALUES.items():
        setattr(args, key, value)
    if "--num-workers" not in given:
        args.num_workers = 0  # data-loader processes would compete with training for the cores


# Numeric flags that must be >= 1 (when set) and >= 0; checked before megatron divides by them
_POSITIVE = ("make_vocab_size_divisible_by", "seq_length", "micro_batch_size", "global_batch_size", "train_iters",
             "train_samples", "tensor_model_parallel_size", "pipeline_model_parallel_size",
             "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size", "save_interval",
             "log_interval", "eval_interval")
_NON_NEGATIVE = ("eval_iters", "num_workers", "lr", "min_lr", "weight_decay", "clip_grad", "lr_warmup_iters",
                 "lr_warmup_fraction", "hidden_dropout", "attention_dropout", "seed")


def check_numbers(args: argparse.Namespace) -> None:
    """Numeric flags in range: a ValueError naming the flag (instead of megatron's bare assertion or a
    division by zero)."""
    for key in _POSITIVE + _NON_NEGATIVE:
        value = getattr(args, key, None)
        if value is None or isinstance(value, bool):
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{flag} must be a finite number, got {value}")
        if key in _POSITIVE and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
        if value < 0:
            raise ValueError(f"{flag} must not be negative, got {value}")
    for key in ("hidden_dropout", "attention_dropout", "lr_warmup_fraction"):
        value = getattr(args, key, None)
        if value is not None and value >= 1:
            raise ValueError(f"--{key.replace('_', '-')} must be below 1, got {value}")
    if args.lr is not None and args.min_lr > args.lr:
        raise ValueError(f"--min-lr {args.min_lr} is above --lr {args.lr}")


def check_exports(args: argparse.Namespace) -> None:
    """--save-hf and --save-peft, written from --save after training, are checked now with the converter's own
    output check (`outputs.check_output`): each must be a new folder (the entry points have no --overwrite), not
    an input (--load-hf, --load, --hf-config, --lora-import, --tokenizer-model) nor holding one, and neither be
    nor hold --save or the other export. Inside --save (e.g. --save OUT --save-hf OUT/hf_final) an export may
    lie, but not where the checkpoints keep their own files (OUT/hf, OUT/iter_*, OUT/release)."""
    from megatron_patch.outputs import check_output

    sources = {"--load-hf": args.load_hf, "--load": args.load, "--hf-config": args.hf_config,
               "--lora-import": getattr(args, "lora_import", None), "--tokenizer-model": args.tokenizer_model}
    exports = {"--save-hf": args.save_hf, "--save-peft": getattr(args, "save_peft", None)}
    for flag, out in exports.items():
        if not out:
            continue
        others = {"--save": args.save, **{f: o for f, o in exports.items() if f != flag}}
        check_output(out, False, sources, flag=flag, overwrite_flag=None, outputs=others, created_first=[args.save])
        if args.save and not os.path.relpath(os.path.abspath(out), os.path.abspath(args.save)).startswith(".."):
            first = os.path.relpath(os.path.abspath(out), os.path.abspath(args.save)).split(os.sep)[0]
            if first in (HF_SUBDIR, TRACKER, RELEASE) or first.startswith("iter_"):
                raise ValueError(f"{flag} {out} is where the --save folder {args.save} keeps its checkpoints' own "
                                 f"files ({first}); choose another {flag}")


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


def check_data_paths(args: argparse.Namespace) -> None:
    """Every dataset prefix in --data-path / --{train,valid,test}-data-path has its .bin and .idx."""
    if getattr(args, "mock_data", False):
        return
    paths = [p for key in ("data_path", "train_data_path", "valid_data_path", "test_data_path")
             for p in (getattr(args, key, None) or [])]
    if not paths and not getattr(args, "data_args_path", None) and not getattr(args, "per_split_data_args_path", None):
        raise ValueError("no training data: pass --data-path PREFIX (an indexed dataset from "
                         "toolkits.preprocess_data), or --mock-data")
    for p in paths:
        try:
            float(p)  # a blend weight
            continue
        except ValueError:
            pass
        missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(p + ext)]
        if missing:
            raise ValueError(f"dataset prefix {p}: no {' or '.join(p + e for e in missing)} "
                             "(make it with python -m toolkits.preprocess_data)")


_SPLITS = ("training", "validation", "test")


def check_splits(args: argparse.Namespace) -> set[str]:
    """Every dataset split that --split (or a per-split data path) creates holds tokens of each dataset:
    megatron's dataset builder loops forever on an empty split, even one it draws no samples from (e.g.
    50 documents at --split 99,1,0 leave validation nothing). Returns the splits that have data."""
    if getattr(args, "mock_data", False):
        return set(_SPLITS)
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.training.utils.common_utils import get_blend_and_blend_per_split

    blend, per_split = get_blend_and_blend_per_split(args)
    if blend is not None:
        try:
            shares = parse_and_normalize_split(args.split)
        except (AssertionError, ValueError, ZeroDivisionError):
            shares = [math.nan]
        if not all(math.isfinite(x) for x in shares):
            raise ValueError(f"--split {args.split!r}: expected up to three shares that are not all 0, e.g. 99,1,0 "
                             "(train, validation, test)")
        matrix = convert_split_vector_to_split_matrix(shares)
        sources = [(prefix, i, matrix[i]) for prefix in blend[0] for i in range(3) if matrix[i] is not None]
    else:
        sources = [(prefix, i, (0.0, 1.0)) for i, b in enumerate(per_split or []) if b for prefix in b[0]]
    for prefix, i, (low, high) in sources:
        index = IndexedDataset(prefix).index
        documents = len(index.document_indices) - 1
        begin, end = int(round(low * documents)), int(round(high * documents))  # as megatron splits
        first, last = (int(index.document_indices[d]) for d in (begin, end))
        if end > begin and int(index.sequence_lengths[first:last].sum()) > 0:
            continue
        if blend is None:
            raise ValueError(f"--{('train', 'valid', 'test')[i]}-data-path {prefix} holds no tokens")
        remedy = ("give it a larger share, or more data",
                  "give it a larger share (e.g. --split 90,10,0), or none (--split 100,0,0: no validation)",
                  "give it a larger share, or none (e.g. --split 99,1,0)")[i]
        raise ValueError(f"the {_SPLITS[i]} split of {prefix} is empty: --split {args.split} gives it documents "
                         f"{begin}..{end} of {documents}, and megatron's dataset builder would wait forever for it; "
                         f"{remedy}")
    return {_SPLITS[i] for _, i, _ in sources}


def apply_precision(args: argparse.Namespace) -> None:
    """`--precision` -> Megatron's flags; fp8 needs Transformer Engine and a GPU that has FP8 (Hopper,
    Ada, Blackwell), checked here, before any GPU work starts."""
    if args.precision is None:
        return
    args.bf16 = args.precision in ("bf16", "fp8")
    args.fp16 = args.precision == "fp16"
    if args.precision != "fp8":
        args.fp8 = None
        return
    import torch

    from megatron_patch.models.build import transformer_engine_available

    if not transformer_engine_available():
        raise ValueError("--precision fp8 needs Transformer Engine; install megatron_patch[te]")

    if not torch.cuda.is_available():
        raise ValueError("--precision fp8 needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise ValueError(f"--precision fp8 needs a GPU with FP8 (compute capability >= 8.9); "
                         f"{torch.cuda.get_device_name()} is {major}.{minor}")
    args.fp8 = args.fp8 or "hybrid"
    args.transformer_impl = "transformer_engine"


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
