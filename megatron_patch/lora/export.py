"""python -m megatron_patch.lora.export: a LoRA run's adapters -> a PEFT adapter folder and / or the merged HF
model.

    python -m megatron_patch.lora.export --load ckpt_lora --save-peft lora_peft --save-merged lora_merged_hf

The source is a checkpoint of a `--lora-rank` run (torch_dist, any TP / PP: the adapters are stored whole,
in HF layout) or a PEFT folder (`--adapter DIR`, e.g. to merge it). The base model is the run's `--load-hf`
folder unless `--base` names another. The PEFT folder loads with `peft.PeftModel.from_pretrained(base, DIR)`;
the merged folder holds `W + alpha / r * B @ A` for every adapted weight, in the base's dtype.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_patch.lora.adapters import LoRAError


def checkpoint_adapter(ckpt: str):
    """(Adapter, plan, the run's arguments, the HF config folder) of a LoRA run's checkpoint."""
    from megatron_patch import compat
    from megatron_patch.conversion.engine import make_plan
    from megatron_patch.conversion.mcore_io import HF_SUBDIR, checkpoint_step_dir, detect_format
    from megatron_patch.lora.peft import read_checkpoint_adapter, to_peft
    from megatron_patch.models import load_hf_config

    step = checkpoint_step_dir(ckpt)
    if detect_format(step) != "torch_dist":
        raise LoRAError(f"{step}: LoRA checkpoints are torch_dist")
    args = compat.load_torch_dist_common(step).get("args")
    if args is None or not getattr(args, "lora_rank", None):
        raise LoRAError(f"{ckpt} is not a checkpoint of a LoRA run (its arguments have no --lora-rank)")
    hf_dir = os.path.join(ckpt, HF_SUBDIR)
    plan = make_plan(load_hf_config(hf_dir))
    adapter = to_peft(read_checkpoint_adapter(step), plan, args.lora_rank, args.lora_alpha, args.lora_dropout)
    return adapter, plan, args, hf_dir


def export(load: str | None = None, adapter_dir: str | None = None, base: str | None = None,
           peft: str | None = None, merged: str | None = None, overwrite: bool = False) -> dict:
    from megatron_patch.conversion.convert import save_hf_state
    from megatron_patch.conversion.engine import make_plan
    from megatron_patch.conversion.hf_io import HFCheckpoint
    from megatron_patch.lora.peft import read_peft, write_peft
    from megatron_patch.models import load_hf_config

    if bool(load) == bool(adapter_dir):
        raise LoRAError("name one source: --load CKPT (a LoRA run's checkpoint) or --adapter DIR (a PEFT folder)")
    if not (peft or merged):
        raise LoRAError("nothing to write: pass --save-peft DIR and / or --save-merged DIR")
    if load:
        adapter, plan, args, side = checkpoint_adapter(load)
        base = base or args.load_hf
    else:
        if not base:
            raise LoRAError("--adapter needs --base HF_DIR (the model the adapter was trained on)")
        adapter, side = read_peft(adapter_dir), base
        plan = make_plan(load_hf_config(base))
    result = {"modules": len(adapter.modules), "rank": adapter.rank, "alpha": adapter.alpha}
    if peft:
        result.update(write_peft(peft, adapter, plan, base_model=base, overwrite=overwrite))
    if merged:
        from megatron_patch.lora.peft import merge_into

        if not base or not os.path.isdir(base):
            raise LoRAError(f"the base model folder {base} does not exist: pass --base HF_DIR")
        ckpt = HFCheckpoint(base)
        tensors = merge_into(ckpt.get, ckpt.keys(), adapter)
        out = save_hf_state(tensors, plan.hf_config, merged, side_dir=side, overwrite=overwrite)
        result["merged"] = out["out"]
    return result


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.cli import HelpFormatter, run

    p = argparse.ArgumentParser(prog="python -m megatron_patch.lora.export", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--load", help="checkpoint folder of a LoRA run (--save of --lora-rank)")
    p.add_argument("--adapter", help="or a PEFT LoRA folder")
    p.add_argument("--base", help="the base HF folder (default: the run's --load-hf)")
    p.add_argument("--save-peft", help="write the adapters as a PEFT LoRA folder")
    p.add_argument("--save-merged", help="write the base with the adapters merged, as an HF folder")
    p.add_argument("--overwrite", action="store_true", help="replace existing output folders")
    a = p.parse_args(argv)
    return run(lambda: export(a.load, a.adapter, a.base, a.save_peft, a.save_merged, a.overwrite))[0]


if __name__ == "__main__":
    sys.exit(main())
