"""Checkpoints of training runs: the `--save` folder carries the HF config (and tokenizer files) in
`hf/`, like a converted checkpoint, so `--load` needs no `--hf-config` and `megatron-patch convert
mcore-to-hf` exports it as is; `--save-hf` runs that export at the end of training."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from megatron_patch.conversion.hf_io import copy_side_files
from megatron_patch.names import HF_SUBDIR


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def describe_checkpoint(args, hf_config: dict) -> None:
    """Write `SAVE/hf/`: the model's HF config (`hf_config`, what the model is built from) and the
    tokenizer and generation files of the HF source."""
    if not args.save or not _rank0():
        return
    side = os.path.join(args.save, HF_SUBDIR)
    os.makedirs(side, exist_ok=True)
    if os.path.isdir(args.hf_config) and os.path.abspath(side) != os.path.abspath(args.hf_config):
        copy_side_files(args.hf_config, side)
    with open(os.path.join(side, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)


def export_hf(args) -> None:
    """`--save-hf`: the last saved checkpoint -> an HF folder (rank 0, after all ranks finished); a LoRA
    run's: the merged model, and `--save-peft` the adapters as a PEFT folder."""
    lora = getattr(args, "lora", False)
    if not args.save_hf and not (lora and args.save_peft):
        return
    if dist.is_initialized():
        dist.barrier()
    if _rank0() and lora:
        from megatron_patch.lora.export import export

        print(json.dumps(export(args.save, peft=args.save_peft, merged=args.save_hf)), flush=True)
    elif _rank0():
        from megatron_patch.conversion.convert import mcore_to_hf

        print(json.dumps(mcore_to_hf(args.save, args.save_hf)), flush=True)
    if dist.is_initialized():
        dist.barrier()
