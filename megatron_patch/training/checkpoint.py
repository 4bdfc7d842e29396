"""Checkpoints of training runs: the `--save` folder carries the HF config (and tokenizer files) in
`hf/`, like a converted checkpoint, so `--load` needs no `--hf-config` and `toolkits.checkpoint_converter
mcore-to-hf` exports it as is; `--save-hf` runs that export at the end of training."""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist

from megatron_patch.conversion.hf_io import copy_side_files
from megatron_patch.conversion.mcore_io import HF_SUBDIR


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def describe_checkpoint(args) -> None:
    """Write `SAVE/hf/` (config.json, tokenizer and generation files of the HF source) once."""
    if not args.save or not _rank0():
        return
    side = os.path.join(args.save, HF_SUBDIR)
    if os.path.abspath(side) == os.path.abspath(args.hf_config):
        return
    os.makedirs(side, exist_ok=True)
    if os.path.isdir(args.hf_config):
        copy_side_files(args.hf_config, side)
    else:
        shutil.copy2(args.hf_config, os.path.join(side, "config.json"))


def export_hf(args) -> None:
    """`--save-hf`: the last saved checkpoint -> an HF folder (rank 0, after all ranks finished)."""
    if not args.save_hf:
        return
    if dist.is_initialized():
        dist.barrier()
    if _rank0():
        from megatron_patch.conversion.convert import mcore_to_hf

        print(mcore_to_hf(args.save, args.save_hf), flush=True)
    if dist.is_initialized():
        dist.barrier()
