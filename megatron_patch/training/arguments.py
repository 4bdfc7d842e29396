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

from megatron_patch.models import get_family, load_hf_config


_TRAINING_CHOICES = {"hidden_dropout", "attention_dropout", "init_method_std"}


def add_patch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("megatron_patch")
    g.add_argument("--hf-config", help="HF config.json (or its folder): the model architecture and family")
    g.add_argument("--load-hf", help="start from this HF checkpoint folder (no separate conversion step; "
                                     "each rank reads only its own shard); implies --hf-config DIR")
    g.add_argument("--save-hf", help="export the final model to this HF folder (safetensors + config)")
    return parser


def resolve_hf_config(args: argparse.Namespace) -> dict:
    """The HF config from --hf-config, --load-hf, or a converted checkpoint's `hf/` folder (--load)."""
    for source in (args.hf_config, args.load_hf):
        if source:
            return load_hf_config(source)
    if args.load and os.path.isfile(os.path.join(args.load, "hf", "config.json")):
        return load_hf_config(os.path.join(args.load, "hf"))
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
    return out


def parse_args(argv: list[str] | None = None, extra_args_provider=None) -> tuple[argparse.Namespace, dict]:
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
    hf_config = resolve_hf_config(args)
    given = set(sys.argv[1:])
    for key, value in architecture_args(hf_config).items():
        flag = "--" + key.replace("_", "-")
        if flag in given and key in _TRAINING_CHOICES:
            continue  # dropout is the user's training choice; the HF value is only the default
        if flag in given and getattr(args, key) != value:
            raise ValueError(f"{flag} {getattr(args, key)} conflicts with the HF config ({value}); the "
                             "architecture comes from --hf-config / --load-hf")
        setattr(args, key, value)
    validate_args(args, {})
    set_global_variables(args)
    return args, hf_config
