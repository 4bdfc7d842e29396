"""The per-tensor manifest every conversion writes beside its output (`tensors.json`): name, shape,
dtype and CRC-32 of each tensor as written, so a copy can be checked without loading a model. Taking the
CRC reads every tensor; the same pass refuses NaN / Inf values."""

from __future__ import annotations

import json
import os
import sys
import threading
import zlib
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

MANIFEST_FILE = "tensors.json"


def crc32(t: Tensor) -> int:
    """CRC-32 of a tensor's bytes in memory order (dtype-agnostic, bf16 included)."""
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


class NonFiniteError(ValueError):
    """A tensor about to be written holds NaN or Inf values."""


def nonfinite_count(t: Tensor) -> int:
    """NaN / Inf values in a floating-point tensor (0 for other dtypes)."""
    if not t.is_floating_point():
        return 0
    return int(t.numel() - torch.isfinite(t).sum())


def _holders(name: str, t: Tensor, bad: int, sources: Callable[[], Iterable[tuple[str, Tensor]]] | None) -> str:
    """Where the non-finite values of tensor `name` are, in the names the user knows: its source tensors that
    hold them, else (the conversion itself made them, e.g. an overflow of the target dtype) the tensor."""
    found = [f"{n} has {k} non-finite values (NaN/Inf) out of {s.numel()}"
             for n, s in (sources() if sources is not None else ()) if (k := nonfinite_count(s))]
    if found:
        return f"{', '.join(found)} (written as {name})"
    return f"{name} has {bad} non-finite values (NaN/Inf) out of {t.numel()}"


class TensorLog:
    """Collects entries from the writer threads; `write(folder)` saves them sorted by name.

    Every tensor is checked for NaN / Inf as its CRC is taken: a non-finite tensor raises
    `NonFiniteError` (nothing is written), unless `allow_nonfinite`, in which case its entry records
    the count and `write` warns on stderr."""

    def __init__(self, allow_nonfinite: bool = False) -> None:
        self._entries: dict[str, dict] = {}
        self._lock = threading.Lock()
        self.allow_nonfinite = allow_nonfinite

    def add(self, name: str, t: Tensor, sources: Callable[[], Iterable[tuple[str, Tensor]]] | None = None) -> Tensor:
        """Record tensor `name` as written. `sources`: the (name, tensor) pairs it was converted from (HF tensors
        becoming a Megatron one), read again only to name the ones that hold NaN / Inf when it is refused."""
        entry = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "crc32": crc32(t)}
        bad = nonfinite_count(t)
        if bad:
            if not self.allow_nonfinite:
                raise NonFiniteError(f"{_holders(name, t, bad, sources)}; nothing was written (pass "
                                     "--allow-nonfinite to write it anyway)")
            entry["nonfinite"] = bad
        with self._lock:
            self._entries[name] = entry
        return t

    def nonfinite(self) -> dict[str, int]:
        """Tensor name -> count of non-finite values, for the tensors that have any."""
        return {k: v["nonfinite"] for k, v in self._entries.items() if "nonfinite" in v}

    def write(self, folder: str) -> None:
        bad = self.nonfinite()
        if bad:
            names = ", ".join(f"{k} ({n})" for k, n in sorted(bad.items())[:5])
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            print(f"warning: {len(bad)} tensors written with non-finite values (--allow-nonfinite): {names}{more}",
                  file=sys.stderr)
        with open(os.path.join(folder, MANIFEST_FILE), "w") as f:
            json.dump({"tensors": dict(sorted(self._entries.items()))}, f, indent=1)


def read(folder: str) -> dict[str, dict]:
    with open(os.path.join(folder, MANIFEST_FILE)) as f:
        return json.load(f)["tensors"]
