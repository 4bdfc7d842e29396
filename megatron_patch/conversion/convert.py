"""Whole-checkpoint conversions used by `python -m toolkits.checkpoint_converter`."""

from __future__ import annotations

import json
import os
import time

import torch
from tqdm import tqdm

from megatron_patch.conversion.atomic import atomic_output_dir
from megatron_patch.conversion.engine import make_plan
from megatron_patch.conversion.hf_io import HFCheckpoint, copy_side_files, save_hf_tensors
from megatron_patch.conversion.mcore_io import (
    HF_SUBDIR,
    load_torch_dist,
    read_manifest,
    save_torch_dist,
    write_manifest,
)
from megatron_patch.models.family import Layout
from megatron_patch.models.registry import get_family, load_hf_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def hf_to_mcore(hf_dir: str, out: str, tp: int = 1, pp: int = 1, impl: str = "local",
                dtype: str | None = None, make_vocab_size_divisible_by: int = 128,
                overwrite: bool = False) -> dict:
    """HF folder -> megatron-core torch_dist checkpoint (+ HF side files, manifest)."""
    start = time.time()
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"HF folder {hf_dir} does not exist")
    hf_config = load_hf_config(hf_dir)
    family = get_family(hf_config)
    plan = make_plan(hf_config, Layout(tp, pp, make_vocab_size_divisible_by), impl, family)
    ckpt = HFCheckpoint(hf_dir)
    target = DTYPES[dtype] if dtype else ckpt.dtype()
    with atomic_output_dir(out, overwrite) as tmp:
        keys = ckpt.keys()
        bar = tqdm(total=len(keys), desc="hf-to-mcore", unit="tensor")

        def get(name: str) -> torch.Tensor:
            bar.update()
            return ckpt.get(name)

        save_torch_dist(plan, get, keys, tmp, target)
        bar.close()
        os.makedirs(os.path.join(tmp, HF_SUBDIR))
        copy_side_files(hf_dir, os.path.join(tmp, HF_SUBDIR))
        summary = dict(family=family.name, impl=impl, tp=tp, pp=pp, dtype=dtype_name(target),
                       make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                       vocab_size=plan.shapes.vocab_size, padded_vocab_size=plan.shapes.padded_vocab_size,
                       format="torch_dist", tensors=len(keys))
        write_manifest(tmp, **summary)
    summary.update(out=os.path.abspath(out), seconds=round(time.time() - start, 2))
    return summary


def mcore_to_hf(mcore_dir: str, out: str, dtype: str | None = None, max_shard_size: int = 5 * 10**9,
                overwrite: bool = False) -> dict:
    """megatron-core torch_dist checkpoint (converted by us) -> HF folder."""
    start = time.time()
    if not os.path.isdir(mcore_dir):
        raise FileNotFoundError(f"Megatron checkpoint folder {mcore_dir} does not exist")
    manifest = read_manifest(mcore_dir)
    hf_side = os.path.join(mcore_dir, HF_SUBDIR)
    hf_config = load_hf_config(hf_side)
    layout = Layout(manifest["tp"], manifest["pp"], manifest["make_vocab_size_divisible_by"])
    plan = make_plan(hf_config, layout, manifest["impl"])
    target = DTYPES[dtype] if dtype else None
    with atomic_output_dir(out, overwrite) as tmp:
        tensors = load_torch_dist(plan, mcore_dir, target)
        files = save_hf_tensors(tensors, tmp, max_shard_size)
        copy_side_files(hf_side, tmp)
        if target is not None:
            _set_config_dtype(os.path.join(tmp, "config.json"), dtype_name(target))
    return dict(family=plan.family.name, out=os.path.abspath(out), tensors=len(tensors), shards=len(files),
                seconds=round(time.time() - start, 2))


def _set_config_dtype(config_path: str, name: str) -> None:
    with open(config_path) as f:
        cfg = json.load(f)
    cfg["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[name]
    cfg.pop("torch_dtype", None)
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=2)
