"""HF checkpoint folders: lazy reading (safetensors, single or sharded; legacy `pytorch_model*.bin`)
and sharded safetensors writing with `model.safetensors.index.json`."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterable

import torch
from safetensors.torch import save_file
from torch import Tensor

from megatron_patch.conversion.engine import ConversionError
from megatron_patch.conversion.manifest import TensorLog

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_ST_OTHER = {"I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}

# Side files copied between HF folders and kept beside Megatron checkpoints.
SIDE_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
    "chat_template.jinja", "chat_template.json",
)


class HFCheckpoint:
    """Tensors of an HF folder, opened lazily: `keys()` from the headers, `get(name)` reads one tensor.

    Every safetensors header is read and checked against the file size up front, so a missing or
    truncated shard fails before any output is written. Tensors are read with plain positioned reads
    into a fresh buffer (no memory map: mapped pages would count in RSS next to the copy). Legacy
    `pytorch_model*.bin` files are read with `torch.load(weights_only=True)`; a pickle cannot be read
    lazily, so one such file at a time is held."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"HF folder {path} does not exist")
        self.path = path
        self._where: dict[str, str] = {}
        self._headers: dict[str, tuple[int, dict]] = {}  # file -> (data start, header)
        self._bin: tuple[str, dict[str, Tensor]] | None = None
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        bin_index = os.path.join(path, "pytorch_model.bin.index.json")
        if os.path.isfile(index) or os.path.isfile(bin_index):
            index = index if os.path.isfile(index) else bin_index
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            missing = sorted({v for v in weight_map.values() if not os.path.isfile(os.path.join(path, v))})
            if missing:
                raise FileNotFoundError(f"{index} names {', '.join(missing)}, which is missing")
            self._where = {k: os.path.join(path, v) for k, v in weight_map.items()}
        elif os.path.isfile(single):
            self._where = dict.fromkeys(self._header(single), single)
        else:
            bins = sorted(n for n in os.listdir(path) if n.startswith("pytorch_model") and n.endswith(".bin"))
            if not bins:
                raise FileNotFoundError(f"no model.safetensors, index or pytorch_model*.bin in {path}")
            for name in bins:
                file = os.path.join(path, name)
                self._where.update(dict.fromkeys(self._load_bin(file), file))
        for file in sorted(set(self._where.values())):
            if file.endswith(".safetensors"):
                present = self._header(file)
                absent = [k for k, f in self._where.items() if f == file and k not in present]
                if absent:
                    raise ConversionError(f"{file} lacks tensors its index assigns to it: {', '.join(absent[:5])}")

    def _header(self, file: str) -> dict:
        """The safetensors header (name -> dtype, shape, data_offsets), validated against the file size."""
        if file not in self._headers:
            try:
                size = os.path.getsize(file)
                with open(file, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    if not 0 < n <= min(size - 8, 100 << 20):
                        raise ValueError(f"header length {n} does not fit a file of {size} bytes")
                    header = json.loads(f.read(n))
                header.pop("__metadata__", None)
                end = max((v["data_offsets"][1] for v in header.values()), default=0)
                if 8 + n + end > size:
                    raise ValueError(f"data ends at byte {8 + n + end}, the file has {size}")
            except (OSError, ValueError) as e:
                raise ConversionError(f"cannot read {file} (truncated or corrupt?): {e}") from None
            self._headers[file] = (8 + n, header)
        return self._headers[file][1]

    def _load_bin(self, file: str) -> dict[str, Tensor]:
        if self._bin is None or self._bin[0] != file:
            self._bin = None
            try:
                self._bin = (file, torch.load(file, map_location="cpu", weights_only=True))
            except Exception as e:
                raise ConversionError(f"cannot read {file} (truncated or corrupt?): {e}") from None
        return self._bin[1]

    def keys(self) -> list[str]:
        return list(self._where)

    def _meta(self, name: str) -> tuple[list[int], torch.dtype | None]:
        file = self._where[name]
        if file.endswith(".bin"):
            t = self._load_bin(file)[name]
            return list(t.shape), t.dtype
        entry = self._header(file)[name]
        return entry["shape"], _ST_DTYPES.get(entry["dtype"])

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape (from the header)."""
        return tuple(self._meta(name)[0])

    def _entry(self, name: str) -> tuple[str, int, list[int], torch.dtype, int]:
        """(file, byte offset of the tensor's data, shape, dtype, data bytes) of a safetensors tensor."""
        file = self._where[name]
        self._header(file)
        start, header = self._headers[file]
        entry = header[name]
        dtype = _ST_DTYPES.get(entry["dtype"]) or _ST_OTHER.get(entry["dtype"])
        if dtype is None:
            raise ConversionError(f"{file}: {name} has unsupported dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        return file, start + begin, entry["shape"], dtype, end - begin

    @staticmethod
    def _read(f, name: str, file: str, offset: int, view: memoryview) -> None:
        f.seek(offset)
        done = 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise ConversionError(f"cannot read {name} from {file}: file ends early (truncated?)")
            done += got

    def get(self, name: str) -> Tensor:
        file = self._where[name]
        if file.endswith(".bin"):
            return self._load_bin(file)[name]
        file, offset, shape, dtype, nbytes = self._entry(name)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with open(file, "rb", buffering=0) as f:
            self._read(f, name, file, offset, memoryview(buf.numpy()))
        return buf.view(dtype).reshape(shape)

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> Tensor:
        """`get(name)` narrowed to [start, stop) along `dim`, reading only those bytes: one read along dim 0,
        one per row of the leading dims along another."""
        file = self._where[name]
        if file.endswith(".bin"):
            return self._load_bin(file)[name].narrow(dim, start, stop - start)
        file, offset, shape, dtype, _ = self._entry(name)
        if not 0 <= start <= stop <= shape[dim]:
            raise ConversionError(f"{name}: rows {start}:{stop} of dim {dim} are outside its shape {tuple(shape)}")
        outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:]) * dtype.itemsize
        out = list(shape)
        out[dim] = stop - start
        buf = torch.empty(outer * (stop - start) * inner, dtype=torch.uint8)
        view, segment = memoryview(buf.numpy()), (stop - start) * inner
        if segment:
            with open(file, "rb", buffering=0) as f:
                for o in range(outer):
                    self._read(f, name, file, offset + (o * shape[dim] + start) * inner,
                               view[o * segment:(o + 1) * segment])
        return buf.view(dtype).reshape(out)

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        """Size of all tensors (floating-point ones counted in `dtype` if given), from the headers."""
        total = 0
        for k in self.keys():
            shape, src = self._meta(k)
            itemsize = (dtype if dtype is not None and src is not None else src or torch.uint8).itemsize
            total += math.prod(shape) * itemsize
        return total

    def dtype(self) -> torch.dtype:
        """dtype of the checkpoint's floating-point tensors (the first one found; headers only)."""
        for k in self.keys():
            dtype = self._meta(k)[1]
            if dtype is not None and dtype.is_floating_point:
                return dtype
        raise ConversionError(f"{self.path} has no floating-point tensors")


def read_all(path: str) -> dict[str, Tensor]:
    """Every tensor of an HF folder (small models: demos, tests, checks)."""
    ckpt = HFCheckpoint(path)
    return {k: ckpt.get(k) for k in ckpt.keys()}


# models transformers 5 holds under other names in memory than it writes (GPT-NeoX: `lm_head` / `embed_out`)
RENAMED_ON_SAVE = ("gpt_neox",)


def checkpoint_state_dict(hf) -> dict[str, Tensor]:
    """The tensors of an in-memory transformers model as its checkpoint stores them. transformers 5 holds
    mixture-of-experts weights fused in memory (`experts.gate_up_proj`) and writes the per-expert names of
    released checkpoints, and renames a few tensors on save (`RENAMED_ON_SAVE`), so those models go through
    `save_pretrained` (a temporary folder, read back); the others' state dict is already what it writes."""
    sd = hf.state_dict()
    fused = any(".experts." in k and "." not in k.rsplit(".experts.", 1)[1] for k in sd)
    if not fused and hf.config.model_type not in RENAMED_ON_SAVE:
        return sd
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        return read_all(tmp)


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '1024' -> bytes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    t = text.strip().upper()
    unit = next((u for u in units if t.endswith(u)), "")
    try:
        size = int(float(t[: len(t) - len(unit)]) * units.get(unit, 1))
    except (ValueError, OverflowError):
        size = 0
    if size <= 0:
        raise ValueError(f"size {text!r}: expected a positive size such as 500MB or 5GB")
    return size


class HFShardWriter:
    """Streams tensors into `model-0000i-of-0000n.safetensors` files of at most `max_shard_size` bytes
    (a tensor larger than that gets a shard of its own) and writes `model.safetensors.index.json`.
    Holds at most one shard in memory. Tensors with NaN / Inf are refused unless `log` allows them."""

    def __init__(self, out_dir: str, max_shard_size: int = 5 * 10**9, log: TensorLog | None = None):
        # every tensor is logged (CRC, shape) and checked for NaN / Inf before it is written
        self.out_dir, self.max_shard_size = out_dir, max_shard_size
        self.log = log if log is not None else TensorLog()
        self._pending: dict[str, Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str]]] = []  # (temporary name, tensor names)
        self.total_bytes = 0
        self.count = 0

    def add(self, name: str, tensor: Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + n > self.max_shard_size:
            self._flush()
        self._pending[name] = self.log.add(name, tensor.contiguous())
        self._pending_bytes += n
        self.total_bytes += n
        self.count += 1

    def _flush(self) -> None:
        tmp = f"shard-{len(self._files):05d}.safetensors.partial"
        save_file(self._pending, os.path.join(self.out_dir, tmp), metadata={"format": "pt"})
        self._files.append((tmp, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        if self._pending or not self._files:
            self._flush()
        names, weight_map = [], {}
        for i, (tmp, keys) in enumerate(self._files, 1):
            final = f"model-{i:05d}-of-{len(self._files):05d}.safetensors"
            os.rename(os.path.join(self.out_dir, tmp), os.path.join(self.out_dir, final))
            names.append(final)
            weight_map.update(dict.fromkeys(keys, final))
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        return names


def copy_side_files(src: str, dst: str, names: Iterable[str] = SIDE_FILES) -> list[str]:
    """Copy config/tokenizer/generation files that exist in `src` into `dst`."""
    copied = []
    for name in names:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
            copied.append(name)
    return copied


def set_config_dtype(config_path: str, name: str) -> None:
    """State in an HF config.json the dtype its weights are stored in (`bf16` -> "bfloat16"): under
    `dtype` (transformers >= 4.56) and `torch_dtype` (older readers and serving stacks), which
    `from_pretrained(dtype="auto")` and serving stacks load the weights as."""
    from megatron_patch.names import hf_dtype

    with open(config_path) as f:
        cfg = json.load(f)
    cfg["dtype"] = cfg["torch_dtype"] = hf_dtype(name)
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=2)
