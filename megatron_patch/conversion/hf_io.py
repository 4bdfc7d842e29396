"""HF checkpoint folders: lazy reading (safetensors, single or sharded; legacy `pytorch_model*.bin`)
and sharded safetensors writing with `model.safetensors.index.json`."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

# Side files copied between HF folders and kept beside Megatron checkpoints.
SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
    "chat_template.jinja", "chat_template.json",
)


class HFCheckpoint:
    """Tensors of an HF folder, opened lazily: `keys()` from the headers, `get(name)` reads one."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"HF folder {path} does not exist")
        self.path = path
        self._where: dict[str, str] = {}
        self._bin_cache: dict[str, dict[str, Tensor]] = {}
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            for file in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(path, file)):
                    raise FileNotFoundError(f"{index} names {file}, which is missing")
            self._where = {k: os.path.join(path, v) for k, v in weight_map.items()}
        elif os.path.isfile(single):
            with safe_open(single, "pt") as f:
                self._where = {k: single for k in f.keys()}
        else:
            bins = sorted(n for n in os.listdir(path) if n.startswith("pytorch_model") and n.endswith(".bin"))
            if not bins:
                raise FileNotFoundError(f"no model.safetensors, index or pytorch_model*.bin in {path}")
            for name in bins:
                file = os.path.join(path, name)
                self._bin_cache[file] = torch.load(file, map_location="cpu", weights_only=True)
                self._where.update({k: file for k in self._bin_cache[file]})

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> Tensor:
        file = self._where[name]
        if file in self._bin_cache:
            return self._bin_cache[file][name]
        with safe_open(file, "pt") as f:
            return f.get_tensor(name)

    def dtype(self) -> torch.dtype:
        """dtype of the checkpoint's floating-point tensors (the first one found)."""
        for k in self.keys():
            t = self.get(k)
            if t.is_floating_point():
                return t.dtype
        raise ValueError(f"{self.path} has no floating-point tensors")


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '1024' -> bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    t = text.strip().upper()
    for u, mult in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * mult)
    return int(t)


def save_hf_tensors(tensors: dict[str, Tensor], out_dir: str, max_shard_size: int = 5 * 10**9) -> list[str]:
    """Write sharded `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += n
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, file), metadata={"format": "pt"})
        files.append(file)
        weight_map.update({k: file for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files


def copy_side_files(src: str, dst: str, names: Iterable[str] = SIDE_FILES) -> list[str]:
    """Copy config/tokenizer/generation files that exist in `src` into `dst`."""
    copied = []
    for name in names:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
            copied.append(name)
    return copied
