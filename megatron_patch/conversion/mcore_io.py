"""megatron-core checkpoints, written and read the way `megatron.training` does, in both formats: what the
formats share (this module: the folder, the tracker, the stored `args`, the manifest, the model template),
`torch_dist.py`, `legacy.py`, and `megatron_checkpoint.py` (reading any such folder, also one written by
megatron.training, and loading a model from it).

A converted checkpoint folder is what `megatron.training --save` writes, plus the HF side files that
make export self-contained:

    OUT/latest_checkpointed_iteration.txt   "release" (or the iteration, for training checkpoints)
    OUT/release/                            torch_dist: metadata.json, .metadata, *.distcp
                                            legacy: mp_rank_TT[_PPP]/model_optim_rng.pt, one per rank
    OUT/hf/                                 config.json, tokenizer and generation files of the source
    OUT/megatron_patch.json                 family, impl, layout, format, dtype and vocab padding

torch_dist is reshardable: tensors are stored whole, keyed like megatron-core's
`sharded_state_dict()`, and both implementations use the same keys (megatron-core names the norms by
their TE names in the local spec too). The layout chosen at conversion decides the vocab padding and is
stored in the checkpoint's `args`. The sharding metadata comes from the model itself: a TP=PP=1
`GPTModel` built on the meta device, its `sharded_state_dict()` filled with the converted tensors.

legacy (Megatron-LM `--ckpt-format torch`) stores one `model_optim_rng.pt` per (TP, PP) rank holding that
rank's `state_dict()` in the implementation's naming, plus `args`; it is written and read one pipeline
stage at a time.
"""

from __future__ import annotations

import json
import os
from argparse import Namespace
from typing import Any

import torch

from megatron_patch.conversion.engine import ConversionError, Plan, make_plan
from megatron_patch.models.build import build_model
from megatron_patch.models.family import Layout
from megatron_patch.models.megatron_args import megatron_lm_args
from megatron_patch.names import MANIFEST, RANK_DIR, RELEASE, TORCH_DIST_METADATA, TRACKER, step_folder
from megatron_patch.runtime.parallel import ensure_model_parallel


def flat_plan(plan: Plan, impl: str = "local") -> Plan:
    """The same conversion at TP=PP=1, keeping the plan's vocab padding (torch_dist is unsharded); in
    the local naming unless `impl` says otherwise."""
    return make_plan(plan.hf_config, Layout(1, 1), impl, plan.family, plan.shapes.padded_vocab_size,
                     plan.shapes.num_query_groups)


def checkpoint_args(plan: Plan, fmt: str) -> Namespace:
    """The `args` megatron.training stores, checks on `--load` (check_checkpoint_args) and reads back with
    `--use-checkpoint-args`: the model in Megatron-LM's argument names (`megatron_lm_args`, the map training
    uses too), the layout and the vocab padding."""
    args = megatron_lm_args(plan.hf_config, plan.family, plan.shapes.num_query_groups)
    args.update(
        tensor_model_parallel_size=plan.layout.tp,
        pipeline_model_parallel_size=plan.layout.pp,
        expert_model_parallel_size=plan.layout.ep,
        num_experts=plan.num_experts or None,
        make_vocab_size_divisible_by=plan.layout.make_vocab_size_divisible_by,
        padded_vocab_size=plan.shapes.padded_vocab_size,
        transformer_impl=plan.impl,
        ckpt_format="torch" if fmt == "legacy" else fmt,
    )
    return Namespace(**args)


def write_tracker(out_dir: str) -> None:
    with open(os.path.join(out_dir, TRACKER), "w") as f:
        f.write(RELEASE)


def checkpoint_step_dir(ckpt_dir: str) -> str:
    """The folder holding the newest checkpoint: `release/` or `iter_XXXXXXX/` per the tracker file."""
    tracker = os.path.join(ckpt_dir, TRACKER)
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"Megatron checkpoint folder {ckpt_dir} does not exist")
    if not os.path.isfile(tracker):
        raise FileNotFoundError(f"{ckpt_dir} is not a Megatron checkpoint folder (no {TRACKER})")
    with open(tracker) as f:
        step = f.read().strip()
    if step != RELEASE and not step.isdigit():
        raise ConversionError(f"{tracker} holds {step!r}, neither '{RELEASE}' nor an iteration number")
    path = os.path.join(ckpt_dir, step_folder(step))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{tracker} points to {path}, which does not exist")
    return path


def detect_format(step_dir: str) -> str:
    if os.path.isfile(os.path.join(step_dir, TORCH_DIST_METADATA)):
        return "torch_dist"
    if any(RANK_DIR.match(n) for n in os.listdir(step_dir)):
        return "legacy"
    raise ConversionError(f"{step_dir} holds neither a torch_dist (metadata.json) nor a legacy (mp_rank_*) checkpoint")


def meta_template(plan: Plan, dtype: torch.dtype) -> dict:
    """A TP=PP=1 model's sharded state dict, on the meta device, with the plan's vocab padding."""
    ensure_model_parallel(1, 1)
    with torch.device("meta"):
        model = build_model(
            plan.hf_config, impl="local", dtype=dtype, family=plan.family,
            padded_vocab_size=plan.shapes.padded_vocab_size, perform_initialization=False,
            num_query_groups=plan.shapes.num_query_groups,
            use_cpu_initialization=True,  # stay on the meta device even when a GPU is present
        )
    return model.sharded_state_dict()


def expected_shapes(plan: Plan, sharded: dict | None = None) -> dict[str, tuple[int, ...]]:
    """Canonical name -> unsharded shape, from a meta TP=PP=1 model of the plan's config (or its
    already-built sharded state dict)."""
    if sharded is None:
        sharded = meta_template(flat_plan(plan), torch.float32)
    return {k: tuple(v.data.shape) for k, v in sharded.items() if not k.endswith("._extra_state")}


def write_manifest(out_dir: str, **fields: Any) -> None:
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(fields, f, indent=2, sort_keys=True)


def read_manifest(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{ckpt_dir} has no {MANIFEST}: not written by megatron_patch")
    with open(path) as f:
        return json.load(f)
