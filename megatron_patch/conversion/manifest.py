"""The per-tensor manifest every conversion writes beside its output (`tensors.json`): name, shape,
dtype and CRC-32 of each tensor as written, so a copy can be checked without loading a model."""

from __future__ import annotations

import json
import os
import threading
import zlib

import torch
from torch import Tensor

MANIFEST_FILE = "tensors.json"


def crc32(t: Tensor) -> int:
    """CRC-32 of a tensor's bytes in memory order (dtype-agnostic, bf16 included)."""
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


class TensorLog:
    """Collects entries from the writer threads; `write(folder)` saves them sorted by name."""

    def __init__(self) -> None:
        self._entries: dict[str, dict] = {}
        self._lock = threading.Lock()

    def add(self, name: str, t: Tensor) -> Tensor:
        entry = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "crc32": crc32(t)}
        with self._lock:
            self._entries[name] = entry
        return t

    def write(self, folder: str) -> None:
        with open(os.path.join(folder, MANIFEST_FILE), "w") as f:
            json.dump({"tensors": dict(sorted(self._entries.items()))}, f, indent=1)


def read(folder: str) -> dict[str, dict]:
    with open(os.path.join(folder, MANIFEST_FILE)) as f:
        return json.load(f)["tensors"]
