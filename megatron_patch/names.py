"""The names the tools accept on their command lines (checkpoint formats, model implementations, numeric
formats), in one place and free of heavy imports: a tool's `--help` must not wait for torch."""

from __future__ import annotations

from typing import Any

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
