"""Checkpoints of the online-RL trainers (GRPO, PPO, RLOO: `megatron_patch.rlhf.loop`), written with the
project's atomic writer:

    FOLDER/step_000050/rank_TT[_PPP].pt   each TP x PP rank's models, optimizers and RNG state (torch.save)
    FOLDER/step_000050/state.json          the step, layout and run state (history, e.g. PPO's KL coefficient)
    FOLDER/latest                          the tracker: the last complete step, written last

A step folder the tracker names is complete; a save that fails leaves no partial file. `--load FOLDER` resumes
its latest step exactly (same layout); a `--save` folder holding another run's checkpoint is refused unless
`--load` names it or `--overwrite` starts again (its checkpoints are removed at the first save)."""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch

STATE, TRACKER = "state.json", "latest"


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step_{step:06d}")


def rank_file(folder: str) -> str:
    """This rank's file in a step folder: `rank_TT.pt`, `rank_TT_PPP.pt` at PP > 1 (megatron's naming)."""
    from megatron.core import parallel_state

    from megatron_patch.runtime.parallel import current_rank

    rank = current_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return os.path.join(folder, f"rank_{rank.tp:02d}" + (f"_{rank.pp:03d}" if pp > 1 else "") + ".pt")


def saved_step(folder: str) -> int | None:
    """The step of a checkpoint folder's latest complete checkpoint (its tracker); None when it holds none."""
    tracker = os.path.join(folder, TRACKER)
    return int(open(tracker).read().strip()) if os.path.isfile(tracker) else None


def replaces_saved_run(args, tool: str) -> bool:
    """Whether this run starts again in a --save folder holding another run's checkpoints (--overwrite). Without
    --overwrite, such a rerun (the same command after an interruption, without --load) would start at step 1 and
    replace them: refused, naming the two ways on. Resuming is --load naming the folder (as megatron.training
    resumes when --load is --save)."""
    if not args.save or (args.load and os.path.realpath(args.load) == os.path.realpath(args.save)):
        return False
    step = saved_step(args.save)
    if step is not None and not args.overwrite:
        raise ValueError(f"--save {args.save} already holds a {tool} checkpoint (step {step}): pass --load "
                         f"{args.save} to resume it, or --overwrite to start again and replace it")
    return step is not None


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def remove_saved(folder: str) -> None:
    """Remove a folder's checkpoints (--overwrite), the tracker first: a folder without it holds none."""
    from megatron_patch.cli import is_first_rank

    if is_first_rank():
        os.remove(os.path.join(folder, TRACKER))
        for name in os.listdir(folder):
            if name.startswith("step_"):
                shutil.rmtree(os.path.join(folder, name))
    _barrier()


def save(folder: str, step: int, rank_state: dict, run_state: dict) -> None:
    """Write step `step`: every rank its `rank_state`, then the first rank `state.json` (`run_state` with the
    step) and the tracker. Every rank of the run calls it."""
    from megatron_patch.cli import is_first_rank
    from megatron_patch.outputs import atomic_output_file

    here = step_dir(folder, step)
    os.makedirs(here, exist_ok=True)
    with atomic_output_file(rank_file(here), binary=True) as f:
        torch.save(rank_state, f)
    _barrier()
    if is_first_rank():
        with atomic_output_file(os.path.join(here, STATE)) as f:
            json.dump({"step": step, **run_state}, f)
        with atomic_output_file(os.path.join(folder, TRACKER)) as f:
            f.write(f"{step}\n")
    _barrier()


def load(folder: str, tp: int, pp: int, device, tool: str) -> tuple[int, dict, dict] | None:
    """(step, this rank's state, the run state) of `folder`'s latest complete step; None (with a warning) when
    it holds none. A checkpoint of another TP x PP layout is refused, naming the layout to resume it with."""
    from megatron_patch.cli import is_first_rank

    step = saved_step(folder)
    if step is None:
        if is_first_rank():
            print(f"warning: no {tool} checkpoint in {folder} ({TRACKER} missing): starting from step 1",
                  file=sys.stderr)
        return None
    here = step_dir(folder, step)
    state = json.load(open(os.path.join(here, STATE)))
    saved_at = (state.get("tp", 1), state.get("pp", 1))
    if saved_at != (tp, pp):
        raise ValueError(f"--load {folder} was saved at TP={saved_at[0]} x PP={saved_at[1]}: resume it with "
                         f"--tp {saved_at[0]} --pp {saved_at[1]}")
    return step, torch.load(rank_file(here), map_location=device, weights_only=True), state


def add_checkpoint_args(parser) -> None:
    from megatron_patch.cli import positive_int

    parser.add_argument("--save", help="checkpoint folder (every --save-interval steps and at the end); one holding "
                                       "a checkpoint needs --load naming it (resume) or --overwrite (start again)")
    parser.add_argument("--save-interval", type=positive_int, default=50, help="steps between checkpoints")
    parser.add_argument("--load", help="resume from this checkpoint folder's latest step (usually the --save folder)")
