"""megatron-core `torch_dist` checkpoints, written and read the way `megatron.training` does.

A converted checkpoint folder looks like what `megatron.training --save` writes, plus the HF side
files that make export self-contained:

    OUT/latest_checkpointed_iteration.txt   "release"
    OUT/release/                            torch_dist shards (metadata.json, common.pt, *.distcp)
    OUT/hf/                                 config.json, tokenizer and generation files of the source
    OUT/megatron_patch.json                 family, impl, layout and dtype used by the converter

torch_dist is reshardable: the stored tensors are global (TP/PP independent), keyed like
megatron-core's `sharded_state_dict()`. The layout chosen at conversion decides the vocab padding
and is stored as the checkpoint's `args` so `megatron.training --load` sees the intended TP/PP.
The sharding metadata comes from the model itself: a `GPTModel` is built on the meta device (no
memory) and its `sharded_state_dict()` is filled with the converted tensors.
"""

from __future__ import annotations

import contextlib
import json
import os
from argparse import Namespace
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from megatron_patch import patches
from megatron_patch.conversion.engine import ConversionError, Plan, _names, hf_to_megatron, megatron_to_hf
from megatron_patch.models.family import Layout, build_model, ensure_model_parallel

MANIFEST = "megatron_patch.json"
HF_SUBDIR = "hf"
TRACKER = "latest_checkpointed_iteration.txt"


def _template(plan: Plan, dtype: torch.dtype):
    """The TP=PP=1 model's sharded state dict with the plan's vocab padding: on the meta device for
    the local implementation (no memory); Transformer Engine modules copy data at construction, so
    they are built uninitialised on the CPU."""
    ensure_model_parallel(1, 1)
    with torch.device("meta") if plan.impl == "local" else contextlib.nullcontext():
        model = build_model(
            plan.hf_config, 1, 1, impl=plan.impl, dtype=dtype,
            padded_vocab_size=plan.shapes.padded_vocab_size, perform_initialization=False,
            use_cpu_initialization=True,  # meta / CPU even when a GPU is present
        )
    return model.sharded_state_dict()


def _unsharded_plan(plan: Plan) -> Plan:
    """The same conversion at TP=PP=1 but with the target layout's vocab padding."""
    from megatron_patch.conversion.engine import make_plan

    layout = Layout(1, 1, plan.layout.make_vocab_size_divisible_by * plan.layout.tp)
    return make_plan(plan.hf_config, layout, plan.impl, plan.family)


def _bind(sharded: dict, tensors: dict[str, Tensor]) -> None:
    """Put converted tensors into the template's ShardedTensors, strictly by name and shape."""
    params = {k for k in sharded if not k.endswith("._extra_state")}
    if params != set(tensors):
        raise ConversionError(
            f"converted tensors do not match the model: missing {_names(params - set(tensors)) or 'none'}; "
            f"unexpected {_names(set(tensors) - params) or 'none'}"
        )
    for name in params:
        sh, t = sharded[name], tensors[name]
        if tuple(sh.data.shape) != tuple(t.shape):
            raise ConversionError(f"{name}: shape {tuple(t.shape)} but the model expects {tuple(sh.data.shape)}")
        sh.data = t
        if hasattr(sh, "local_shape"):
            sh.dtype = t.dtype


def save_torch_dist(plan: Plan, get: Callable[[str], Tensor], hf_keys: Iterable[str], out_dir: str,
                    dtype: torch.dtype) -> None:
    """Convert HF tensors (read by name through `get`) and write `out_dir/release` + the tracker."""
    from megatron.core import dist_checkpointing

    flat = _unsharded_plan(plan)
    tensors = hf_to_megatron(flat, get, hf_keys, dtype)[(0, 0)]
    sharded = _template(flat, dtype)
    _bind(sharded, tensors)
    release = os.path.join(out_dir, "release")
    os.makedirs(release)
    state = {
        "model": sharded,
        "checkpoint_version": 3.0,
        "iteration": 0,
        "args": _checkpoint_args(plan),
    }
    with patches.applied("cpu_cuda_calls"):
        dist_checkpointing.save(state, release)
    with open(os.path.join(out_dir, TRACKER), "w") as f:
        f.write("release")


def _checkpoint_args(plan: Plan) -> Namespace:
    """The `args` megatron.training stores and checks on `--load` (check_checkpoint_args): model
    shape, layout and vocab padding, in Megatron-LM's argument names."""
    arch = {k: v for k, v in plan.family.config_kwargs(plan.hf_config).items()
            if isinstance(v, (bool, int, float, str))}
    gpt = plan.family.gpt_kwargs(plan.hf_config)
    position = gpt.get("position_embedding_type", "learned_absolute")
    return Namespace(
        **arch,
        position_embedding_type=position,
        add_position_embedding=position == "learned_absolute",
        untie_embeddings_and_output_weights=not gpt.get("share_embeddings_and_output_weights", False),
        max_position_embeddings=int(plan.hf_config.get("max_position_embeddings", 4096)),
        tensor_model_parallel_size=plan.layout.tp,
        pipeline_model_parallel_size=plan.layout.pp,
        make_vocab_size_divisible_by=plan.layout.make_vocab_size_divisible_by,
        padded_vocab_size=plan.shapes.padded_vocab_size,
        transformer_impl=plan.impl,
        ckpt_format="torch_dist",
    )


def load_torch_dist(plan: Plan, ckpt_dir: str, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Read a torch_dist checkpoint (converted or written by `megatron.training`) -> HF state dict.

    Only model weights are read; optimizer and RNG state are ignored."""
    from megatron.core import dist_checkpointing

    step_dir = checkpoint_step_dir(ckpt_dir)
    flat = _unsharded_plan(plan)
    stored_dtype = _stored_dtype(step_dir)
    sharded = _template(flat, stored_dtype)
    for name, sh in sharded.items():
        if not name.endswith("._extra_state"):
            sh.data = torch.empty(sh.data.shape, dtype=stored_dtype)
    loaded = dist_checkpointing.load({"model": sharded}, step_dir)["model"]
    tensors = {k: v for k, v in loaded.items() if not k.endswith("._extra_state")}
    return megatron_to_hf(flat, {(0, 0): tensors}, dtype)


def checkpoint_step_dir(ckpt_dir: str) -> str:
    """The folder holding the newest checkpoint: `release/` or `iter_XXXXXXX/` per the tracker file."""
    tracker = os.path.join(ckpt_dir, TRACKER)
    if not os.path.isfile(tracker):
        raise FileNotFoundError(f"{ckpt_dir} is not a Megatron checkpoint folder (no {TRACKER})")
    with open(tracker) as f:
        step = f.read().strip()
    sub = "release" if step == "release" else f"iter_{int(step):07d}"
    path = os.path.join(ckpt_dir, sub)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(f"{path} is not a torch_dist checkpoint (no metadata.json)")
    return path


def _stored_dtype(step_dir: str) -> torch.dtype:
    """dtype of the stored weights, read from the DCP metadata (no tensor data is loaded)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(step_dir).read_metadata()
    for key, md in meta.state_dict_metadata.items():
        if key.startswith("embedding.") and hasattr(md, "properties"):
            return md.properties.dtype
    raise ConversionError(f"{step_dir}: no embedding tensor found in the checkpoint metadata")


def write_manifest(out_dir: str, **fields: Any) -> None:
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(fields, f, indent=2, sort_keys=True)


def read_manifest(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{ckpt_dir} has no {MANIFEST}: not written by megatron_patch (pass the HF config explicitly)"
        )
    with open(path) as f:
        return json.load(f)


def load_megatron_model(ckpt_dir: str, tp: int = 1, pp: int = 1, impl: str | None = None,
                        dtype: torch.dtype = torch.float32):
    """Build this rank's `GPTModel` for a converted checkpoint and load its weights the way
    `megatron.training` does (through the model's sharded state dict). Returns (model, hf_config)."""
    from megatron.core import dist_checkpointing

    from megatron_patch.models.registry import load_hf_config

    manifest = read_manifest(ckpt_dir)
    hf_config = load_hf_config(os.path.join(ckpt_dir, HF_SUBDIR))
    step_dir = checkpoint_step_dir(ckpt_dir)
    ensure_model_parallel(tp, pp)
    model = build_model(hf_config, tp, pp, impl=impl or manifest["impl"], dtype=dtype,
                        padded_vocab_size=manifest["padded_vocab_size"], perform_initialization=False)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, step_dir)["model"]
    model.load_state_dict(loaded, strict=True)
    return model.eval(), hf_config
