"""Arguments: everything Megatron-LM accepts, plus a few named additions (`--hf-config`, `--load-hf`,
`--save-hf`). The model architecture comes from the HF `config.json` and is written into Megatron's
own arguments (layers, widths, heads, norms, positions, ...) before megatron validates them, so its
bookkeeping (pipeline split, FLOP counts, checkpoint `args`) sees the real model; the model itself is
built by the family (`megatron_patch.training.model`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from megatron_patch.models import Layout, get_family, load_hf_config


PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
_TRAINING_CHOICES = {"hidden_dropout", "attention_dropout", "init_method_std"}


def add_patch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("megatron_patch")
    g.add_argument("--hf-config", help="HF config.json (or its folder): the model architecture and family")
    g.add_argument("--load-hf", help="start from this HF checkpoint folder (no separate conversion step; "
                                     "each rank reads only its own shard); implies --hf-config DIR")
    g.add_argument("--save-hf", help="export the final model to this HF folder (safetensors + config); "
                                     "needs --save")
    g.add_argument("--precision", choices=PRECISIONS,
                   help="one switch for the numeric format: bf16/fp16 (Megatron's --bf16/--fp16), fp8 (bf16 with "
                        "Transformer Engine FP8 GEMMs: --fp8-format, default hybrid; --fp8-recipe, default delayed) "
                        "or fp32; checked against the machine before any GPU work")
    return parser


def hf_config_source(args: argparse.Namespace) -> str:
    """Where the HF config comes from: --hf-config, --load-hf, or a checkpoint's `hf/` folder (--load;
    converted by megatron_patch, or saved by a run of ours)."""
    for source in (args.hf_config, args.load_hf):
        if source:
            return source
    if args.load and os.path.isfile(os.path.join(args.load, "hf", "config.json")):
        return os.path.join(args.load, "hf")
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
        position_embedding_type=position, add_position_embedding=position == "learned_absolute",
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


def parse_args(argv: list[str] | None = None, extra_args_provider=None,
               indexed_data: bool = True) -> tuple[argparse.Namespace, dict]:
    """Megatron's argument parsing with our additions and the HF architecture applied; sets megatron's
    global args (and tokenizer) like `parse_and_validate_args`. Returns (args, hf_config)."""
    from megatron.training.arguments import parse_args as megatron_parse_args
    from megatron.training.arguments import validate_args
    from megatron.training.global_vars import set_global_variables

    def extra(parser):
        parser = add_patch_args(parser)
        return extra_args_provider(parser) if extra_args_provider else parser

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    args = megatron_parse_args(extra)
    args.hf_config = hf_config_source(args)
    hf_config = load_hf_config(args.hf_config)
    given = set(sys.argv[1:])
    for key, value in architecture_args(hf_config).items():
        flag = "--" + key.replace("_", "-")
        if flag in given and key in _TRAINING_CHOICES:
            continue  # dropout is the user's training choice; the HF value is only the default
        if flag in given and getattr(args, key) != value:
            raise ValueError(f"{flag} {getattr(args, key)} conflicts with the HF config ({value}); the "
                             "architecture comes from --hf-config / --load-hf")
        setattr(args, key, value)
    apply_precision(args)
    if indexed_data:
        check_data_paths(args)
    if args.save_hf and not args.save:
        raise ValueError("--save-hf exports the final checkpoint: it needs --save DIR")
    if args.save_hf and os.path.exists(args.save_hf):
        raise ValueError(f"--save-hf {args.save_hf} already exists")
    if args.tokenizer_type is None and args.load_hf:
        # the HF checkpoint's own tokenizer, unless another is named
        args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", args.load_hf
    validate_args(args, {})
    if args.load_hf and args.virtual_pipeline_model_parallel_size:
        raise ValueError("--load-hf with a virtual pipeline is not supported; convert with "
                         "toolkits.checkpoint_converter and --load instead")
    set_global_variables(args)
    _match_vocab(args, hf_config)
    # resuming a run (a checkpoint in --load) wins over --load-hf
    args.resuming = bool(args.load) and os.path.isfile(os.path.join(args.load, "latest_checkpointed_iteration.txt"))
    return args, hf_config


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
    import importlib.util

    import torch

    if importlib.util.find_spec("transformer_engine") is None:
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
