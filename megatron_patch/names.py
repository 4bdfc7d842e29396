"""The names the tools accept on their command lines (checkpoint formats, model implementations, numeric
formats) and the names inside a Megatron checkpoint folder, in one place and free of heavy imports: a tool's
`--help` must not wait for torch."""

from __future__ import annotations

import re
from typing import Any

# A Megatron checkpoint folder (what megatron.training --save writes; the converter adds HF_SUBDIR and MANIFEST):
TRACKER = "latest_checkpointed_iteration.txt"  # "release", or the iteration of a training checkpoint
RELEASE = "release"  # the step folder of a converted checkpoint; training writes iter_XXXXXXX (step_folder)
TORCH_DIST_METADATA = "metadata.json"  # in a torch_dist step folder
LEGACY_FILE = "model_optim_rng.pt"  # in each legacy rank folder
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")  # legacy rank folders: mp_rank_TT[_PPP][_EEE]
HF_SUBDIR = "hf"  # the HF config, tokenizer and generation files kept beside a checkpoint
MANIFEST = "megatron_patch.json"  # family, impl, layout, format, dtype and vocab padding of a converted checkpoint


def step_folder(step: str | int) -> str:
    """The folder of one checkpoint inside a Megatron checkpoint folder: `release`, or `iter_XXXXXXX`."""
    return RELEASE if step == RELEASE else f"iter_{int(step):07d}"


FORMATS: tuple[str, ...] = ("torch_dist", "legacy")
IMPLS: tuple[str, ...] = ("local", "transformer_engine")
# --dtype name -> the torch / HF config name of the same format
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPE_NAMES: tuple[str, ...] = tuple(sorted(_DTYPES))


def torch_dtype(name: str) -> Any:
    """`bf16` -> torch.bfloat16, ..."""
    import torch

    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {name!r}")
    return getattr(torch, _DTYPES[name])


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 -> `bf16`, ..."""
    full = str(dtype).removeprefix("torch.")
    for name, torch_name in _DTYPES.items():
        if torch_name == full:
            return name
    raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPE_NAMES)}")


def hf_dtype(name: str) -> str:
    """`bf16` -> "bfloat16", the value of an HF config.json's `dtype` / `torch_dtype`."""
    return _DTYPES[name]
