"""python -m megatron_patch.lora.export: a LoRA run's adapters -> a PEFT adapter folder and / or the merged HF
model.

    python -m megatron_patch.lora.export --load ckpt_lora --save-peft lora_peft --save-merged lora_merged_hf

The source is a checkpoint of a `--lora-rank` run (torch_dist, any TP / PP: the adapters are stored whole,
in HF layout) or a PEFT folder (`--adapter DIR`, e.g. to merge it). The base model is the run's `--load-hf`
folder unless `--base` names another. The PEFT folder loads with `peft.PeftModel.from_pretrained(base, DIR)`;
the merged folder holds `W + alpha / r * B @ A` for every adapted weight, in the base's dtype.

Before anything is written, both outputs are checked as the converter checks its own: refused when one is
or holds an input (or is an existing part of one, e.g. the checkpoint's hf/), when they are, hold or lie in
each other, and when one exists without --overwrite. An adapter recorded as made for another model than
the base is refused when that model's config.json is here and differs, else a warning names both.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_patch.lora.adapters import LoRAError


def run_args(ckpt: str):
    """(newest step folder, the run's arguments) of a LoRA run's checkpoint; only its common state is read."""
    from megatron_patch import compat
    from megatron_patch.conversion.mcore_io import checkpoint_step_dir, detect_format

    step = checkpoint_step_dir(ckpt)
    if detect_format(step) != "torch_dist":
        raise LoRAError(f"{step}: LoRA checkpoints are torch_dist")
    args = compat.load_torch_dist_common(step).get("args")
    if args is None or not getattr(args, "lora_rank", None):
        raise LoRAError(f"{ckpt} is not a checkpoint of a LoRA run (its arguments have no --lora-rank)")
    return step, args


def checkpoint_adapter(ckpt: str):
    """(Adapter, plan, the run's arguments, the HF config folder) of a LoRA run's checkpoint."""
    from megatron_patch.conversion.engine import make_plan
    from megatron_patch.lora.peft import read_checkpoint_adapter, to_peft
    from megatron_patch.models import load_hf_config
    from megatron_patch.names import HF_SUBDIR

    step, args = run_args(ckpt)
    hf_dir = os.path.join(ckpt, HF_SUBDIR)
    plan = make_plan(load_hf_config(hf_dir))
    adapter = to_peft(read_checkpoint_adapter(step), plan, args.lora_rank, args.lora_alpha, args.lora_dropout)
    return adapter, plan, args, hf_dir


def export(load: str | None = None, adapter_dir: str | None = None, base: str | None = None,
           peft: str | None = None, merged: str | None = None, overwrite: bool = False) -> dict:
    """Every output is checked against every input (`--load`, `--adapter`, `--base`) and the other output with
    the converter's own check (`outputs.check_output`), and the adapter against the base, before anything is
    written; the merged tensors are computed before either folder is written."""
    from megatron_patch.conversion.convert import save_hf_state
    from megatron_patch.conversion.engine import make_plan
    from megatron_patch.conversion.hf_io import HFCheckpoint
    from megatron_patch.lora.peft import check_base, merge_into, read_peft, write_peft
    from megatron_patch.models import load_hf_config
    from megatron_patch.outputs import check_output

    if bool(load) == bool(adapter_dir):
        raise LoRAError("name one source: --load CKPT (a LoRA run's checkpoint) or --adapter DIR (a PEFT folder)")
    if not (peft or merged):
        raise LoRAError("nothing to write: pass --save-peft DIR and / or --save-merged DIR")
    if load:
        base = base or run_args(load)[1].load_hf
    elif not base:
        raise LoRAError("--adapter needs --base HF_DIR (the model the adapter was trained on)")
    if (merged or adapter_dir) and not os.path.isdir(base or ""):
        raise LoRAError(f"the base model folder {base} does not exist: pass --base HF_DIR")
    outputs = {"--save-peft": peft, "--save-merged": merged}
    for flag, out in outputs.items():
        if out:
            check_output(out, overwrite, {"--load": load, "--adapter": adapter_dir, "--base": base}, flag=flag,
                         outputs={f: o for f, o in outputs.items() if f != flag})
    if load:
        from megatron_patch.names import HF_SUBDIR

        adapter, plan, args, side = checkpoint_adapter(load)
        if merged:
            check_base(load, args.load_hf, base, made_for_config=load_hf_config(os.path.join(load, HF_SUBDIR)))
    else:
        adapter, side = read_peft(adapter_dir), base
        check_base(adapter_dir, adapter.base_model, base)
        plan = make_plan(load_hf_config(base))
    result = {"modules": len(adapter.modules), "rank": adapter.rank, "alpha": adapter.alpha}
    tensors = None
    if merged:
        ckpt = HFCheckpoint(base)
        tensors = merge_into(ckpt.get, ckpt.keys(), adapter)
    if peft:
        result.update(write_peft(peft, adapter, plan, base_model=base, overwrite=overwrite))
    if merged:
        result["merged"] = save_hf_state(tensors, plan.hf_config, merged, side_dir=side, overwrite=overwrite)["out"]
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
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing output folders (never an input: an output that is or holds --load, "
                        "--adapter or --base, or is an existing part of one, is refused)")
    a = p.parse_args(argv)
    return run(lambda: export(a.load, a.adapter, a.base, a.save_peft, a.save_merged, a.overwrite))[0]


if __name__ == "__main__":
    sys.exit(main())
