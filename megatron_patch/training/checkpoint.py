"""Checkpoints of training runs: the `--save` folder carries the HF config (and tokenizer files) in
`hf/`, like a converted checkpoint, so `--load` needs no `--hf-config` and `megatron-patch convert
mcore-to-hf` exports it as is; `--save-hf` runs that export at the end of training. A resumed run keeps the
optimizer-state layout its checkpoint was saved with (`match_resumed_optimizer`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch.distributed as dist

from megatron_patch import compat
from megatron_patch.conversion.hf_io import copy_side_files
from megatron_patch.names import HF_SUBDIR, RELEASE, TORCH_DIST_METADATA, TRACKER, step_folder

_AWARE_FLAGS = ("--use-precision-aware-optimizer", "--no-use-precision-aware-optimizer")


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


def resumed_optimizer_args(args) -> tuple[str, argparse.Namespace] | None:
    """The step folder and the saved Megatron arguments of the torch_dist training checkpoint whose optimizer state
    this run loads: `--load` with its tracker's iteration, or `--ckpt-step`; None where no optimizer state is loaded
    (no checkpoint, a converted `release`, --no-load-optim, --finetune, a run saved with --no-save-optim) or the
    checkpoint is no torch_dist one (megatron.training reports a checkpoint it cannot read itself)."""
    from megatron_patch.conversion.mcore_io import checkpoint_step_dir

    if not args.load or getattr(args, "no_load_optim", None) or getattr(args, "finetune", False):
        return None
    step = getattr(args, "ckpt_step", None)
    if not step and not os.path.isfile(os.path.join(args.load, TRACKER)):
        return None  # nothing saved there yet: a fresh start
    try:
        step_dir = os.path.join(args.load, step_folder(step)) if step else checkpoint_step_dir(args.load)
        if os.path.basename(step_dir) == RELEASE or not os.path.isfile(os.path.join(step_dir, TORCH_DIST_METADATA)):
            return None
        saved = compat.load_torch_dist_common(step_dir).get("args")
    except Exception:  # noqa: BLE001 - a tracker, folder or checkpoint megatron.training reports itself, with its reason
        return None
    if saved is None or getattr(saved, "no_save_optim", False):
        return None
    return step_dir, saved


def match_resumed_optimizer(args, given: set[str]) -> None:
    """A resumed run's optimizer state in the layout its checkpoint holds: the distributed optimizer saves the fp32
    master weights as they are, or with `--use-precision-aware-optimizer` as 16-bit remainders of the bf16
    parameters, and megatron-core loads either into the other without a word (plain into precision-aware: the
    fp32 values read as remainders; the other way it stops with a shape error). Where the throughput profile
    chose the setting (`given`: the flags of the command line), the run follows the checkpoint and says so;
    where the command line chose the other one, or the run cannot take the checkpoint's (no distributed optimizer
    or bf16), a one-line error names the checkpoint and the way out (`--no-load-optim`)."""
    found = resumed_optimizer_args(args)
    if found is None:
        return
    step_dir, saved = found
    was = bool(getattr(saved, "use_precision_aware_optimizer", False)
               and getattr(saved, "use_distributed_optimizer", False))
    if was == bool(getattr(args, "use_precision_aware_optimizer", False)):
        return
    held = "16-bit remainders of the master weights" if was else "fp32 master weights"
    chosen = [flag for flag in _AWARE_FLAGS if flag in given]
    if chosen or (was and not (args.use_distributed_optimizer and args.bf16)):
        why = chosen[0] if chosen else "this run (it needs the distributed optimizer and bf16)"
        raise ValueError(f"{step_dir} was saved {'with' if was else 'without'} --use-precision-aware-optimizer "
                         f"(its optimizer state holds {held}), which {why} cannot load; resume with "
                         f"{_AWARE_FLAGS[0] if was else _AWARE_FLAGS[1]}, or pass --no-load-optim to start the "
                         "optimizer afresh")
    args.use_precision_aware_optimizer = was
    if _rank0():
        print(f"note: {step_dir} was saved {'with' if was else 'without'} --use-precision-aware-optimizer (its "
              f"optimizer state holds {held}): this run resumes {'with' if was else 'without'} it", file=sys.stderr,
              flush=True)
