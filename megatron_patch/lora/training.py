"""LoRA in our training entry points (pretrain, sft, rlhf.dpo): the `--lora-*` options, their checks, the
model provider's step (adapters on the built model, base frozen, a PEFT adapter imported), and adapter-only
checkpoints.

Checkpoints hold the adapters only (and their optimizer state), as Megatron-Bridge's PEFT checkpoints do:
the model's class is narrowed so that `sharded_state_dict` (torch_dist, what `megatron.training` saves and
loads) lists the adapter tensors alone and `load_state_dict` accepts such a dict, leaving the base as
loaded. The base is read from `--load-hf` on every start, a resume included, so a resume is exact as long
as that folder is unchanged. The optimizer only ever sees the adapters (megatron builds its parameter
groups from parameters that require gradients; DDP allocates gradient buffers only for them).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from megatron_patch.lora.adapters import (
    ALL_LINEAR,
    TARGETS,
    LoRAConfig,
    LoRAError,
    apply_lora,
    count_parameters,
    is_adapter_key,
    load_adapter,
)


def add_lora_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("megatron_patch lora")
    g.add_argument("--lora-rank", type=int, metavar="R",
                   help="train LoRA adapters of rank R on a frozen base (from --load-hf); only the adapters train "
                        "and are checkpointed")
    g.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA alpha; the update is scaled by alpha / rank "
                                                                 "(default: the rank, scaling 1; needs --lora-rank)")
    g.add_argument("--lora-dropout", type=float, metavar="P",
                   help="dropout on the adapters' input (default 0; needs --lora-rank)")
    g.add_argument("--lora-target", nargs="+", metavar="NAME",
                   help=f"megatron linears to adapt: {', '.join(TARGETS)} or {ALL_LINEAR} (default; routed MoE "
                        "experts are never adapted; needs --lora-rank)")
    g.add_argument("--lora-import", metavar="DIR", help="start the adapters from a PEFT LoRA folder "
                                                        "(adapter_config.json + adapter_model.safetensors); its rank, "
                                                        "alpha and modules are used")
    g.add_argument("--save-peft", metavar="DIR", help="at the end, export the adapters as a PEFT LoRA folder "
                                                      "(needs --save; --save-hf then writes the merged model; like "
                                                      "--save-hf, checked at start: a new folder, not --save nor an "
                                                      "input)")
    return parser


def check_lora_args(args: argparse.Namespace, hf_config: Any = None) -> None:
    """The LoRA options fit together (ValueError naming the flag) and a --lora-import adapter fits the
    --load-hf base (`hf_config`: its modules and layers; the base it was made for); settles rank, alpha, dropout
    and targets into `args` (stored with the checkpoint, read by the export)."""
    args.lora = args.lora_rank is not None or bool(args.lora_import)
    if not args.lora:
        given = [flag for flag, value in (("--lora-alpha", args.lora_alpha), ("--lora-target", args.lora_target),
                                          ("--lora-dropout", args.lora_dropout)) if value is not None]
        if given:
            raise ValueError(f"{given[0]} needs --lora-rank R (or --lora-import DIR): without it the run trains "
                             "every weight, not LoRA adapters")
        if args.save_peft:
            raise ValueError("--save-peft exports LoRA adapters: it needs --lora-rank or --lora-import")
        return
    if args.lora_import:
        from megatron_patch.lora.peft import check_base, read_peft

        imported = read_peft(args.lora_import)
        if args.lora_rank is not None and args.lora_rank != imported.rank:
            raise ValueError(f"--lora-rank {args.lora_rank} differs from the imported adapter's rank {imported.rank}")
        if args.lora_alpha is not None and args.lora_alpha != imported.alpha:
            raise ValueError(f"--lora-alpha {args.lora_alpha} differs from the imported adapter's {imported.alpha}")
        args.lora_rank, args.lora_alpha = imported.rank, imported.alpha
        if args.load_hf and os.path.isdir(args.load_hf):
            check_base(args.lora_import, imported.base_model, args.load_hf)
        if hf_config is not None:
            from megatron_patch.conversion.engine import make_plan

            _imported_modules(args.lora_import, imported, make_plan(hf_config))
    args.lora_dropout = 0.0 if args.lora_dropout is None else args.lora_dropout
    args.lora_target = args.lora_target or [ALL_LINEAR]
    if args.lora_rank <= 0:
        raise ValueError(f"--lora-rank must be a positive integer, got {args.lora_rank}")
    args.lora_alpha = float(args.lora_rank if args.lora_alpha is None else args.lora_alpha)
    try:
        LoRAConfig(args.lora_rank, args.lora_alpha, args.lora_dropout, tuple(args.lora_target))
    except LoRAError as e:
        raise ValueError(f"--lora-*: {e}") from None
    refused = [
        (not args.load_hf, "LoRA adapts a pretrained base: pass --load-hf DIR (read again on every start; the "
                           "checkpoints hold the adapters only)"),
        (args.sequence_parallel, "--sequence-parallel with LoRA is not supported yet"),
        (bool(args.save) and args.ckpt_format != "torch_dist",
         f"--ckpt-format {args.ckpt_format}: LoRA checkpoints are torch_dist (the default)"),
        (bool(args.save_peft) and not args.save, "--save-peft exports the final checkpoint: it needs --save DIR"),
    ]
    for bad, message in refused:
        if bad:
            raise ValueError(message)


def _imported_modules(folder: str, imported, plan) -> tuple[dict, tuple[str, ...], frozenset[str]]:
    """(canonical tensors, megatron targets, HF module names) of an imported PEFT adapter on the model of
    `plan` (any layout: names only); an adapter that does not fit is an error naming `folder`."""
    from megatron_patch.lora.peft import from_peft, megatron_targets

    try:
        return from_peft(imported, plan), *megatron_targets(imported, plan)
    except LoRAError as e:
        raise LoRAError(f"--lora-import {folder}: {e}") from None


def lora_config(args: argparse.Namespace, plan) -> tuple[LoRAConfig, dict | None]:
    """(config, imported canonical tensors or None) from the settled arguments."""
    modules, tensors, targets = None, None, tuple(args.lora_target)
    if args.lora_import:
        from megatron_patch.lora.peft import read_peft

        tensors, targets, modules = _imported_modules(args.lora_import, read_peft(args.lora_import), plan)
    return LoRAConfig(args.lora_rank, args.lora_alpha, args.lora_dropout, targets, args.seed, modules), tensors


def adapt(model: torch.nn.Module, args: argparse.Namespace, hf_config: Any, family) -> None:
    """The model provider's LoRA step, after the base weights are loaded: adapters on the targeted linears,
    everything else frozen, a PEFT adapter imported (not on a resume: the checkpoint has the adapters), and
    adapter-only checkpoints. Prints the trainable parameter count."""
    from megatron.core import parallel_state as ps

    from megatron_patch.conversion.engine import make_plan
    from megatron_patch.models import Layout
    from megatron_patch.models.reward import is_reward_config

    if getattr(args, "model_class", "gpt") != "gpt":
        raise LoRAError(f"LoRA adapts GPTModel's layers: --model-class {args.model_class} is not supported")
    if is_reward_config(hf_config):
        raise LoRAError("LoRA for the reward model is not supported (its new scalar head must train in full)")
    layout = Layout.from_megatron_args(args)
    plan = make_plan(hf_config, layout, args.transformer_impl, family, padded_vocab_size=args.padded_vocab_size)
    cfg, imported = lora_config(args, plan)
    sites = apply_lora(model, hf_config, cfg, plan)
    if imported is not None and not args.resuming:
        used = load_adapter(model, imported)
        stage = {s.layer for s in sites}
        left = [k for k in imported if int(k.split(".")[2]) in stage and k not in used]
        if left:
            raise LoRAError(f"the imported adapter's {left[0]} has no place in this model")
    adapter_only_checkpoints(model)
    trainable, total = count_parameters(model)
    if ps.get_data_parallel_rank() == 0:
        # the linears adapted on this stage, not the targets asked for: all-linear on Mixtral names linear_fc1,
        # which there exists only in routed experts
        adapted = [t for t in TARGETS if any(s.path.rsplit(".", 1)[-1] == t for s in sites)]
        what = ", ".join(adapted) or "none on this stage"
        if plan.num_experts:
            what += "; routed experts are not adapted"
        print(f"LoRA: {trainable:,} trainable parameters of {total:,} ({100 * trainable / max(total, 1):.3f}%) on "
              f"TP rank {ps.get_tensor_model_parallel_rank()}, PP rank {ps.get_pipeline_model_parallel_rank()}: "
              f"rank {cfg.rank}, alpha {args.lora_alpha}, {len(sites)} adapted linears ({what})", flush=True)


class AdapterCheckpoint:
    """Mixed into the model's class: checkpoints hold the adapters only."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        full = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        return {k: v for k, v in full.items() if is_adapter_key(k)}

    def state_dict_for_save_checkpoint(self, prefix="", keep_vars=False):
        full = super().state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        return {k: v for k, v in full.items() if is_adapter_key(k)}

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        from torch.nn.modules.module import _IncompatibleKeys

        keys = [k for k in state_dict if not k.endswith("_extra_state")]
        if not keys or not all(is_adapter_key(k) for k in keys):
            return super().load_state_dict(state_dict, strict=strict, **kwargs)
        own = {n: p for n, p in self.named_parameters() if is_adapter_key(n)}
        missing, unexpected = sorted(set(own) - set(keys)), sorted(set(keys) - set(own))
        if strict and (missing or unexpected):
            raise RuntimeError(f"adapter checkpoint does not fit the model: missing {missing[:4]}, "
                               f"unexpected {unexpected[:4]}")
        with torch.no_grad():
            for k in set(keys) & set(own):
                own[k].copy_(state_dict[k])
        return _IncompatibleKeys(missing, unexpected)


_CLASSES: dict[type, type] = {}


def adapter_only_checkpoints(model: torch.nn.Module) -> None:
    cls = type(model)
    if issubclass(cls, AdapterCheckpoint):
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (AdapterCheckpoint, cls), {"__module__": __name__})
    model.__class__ = _CLASSES[cls]
