"""Whole-checkpoint conversions behind `megatron-patch convert`.

Every conversion writes into a temporary folder beside `out` and renames it into place at the end;
each shows a progress bar per phase and returns a summary (tensors, bytes, seconds, GB/s, peak RSS).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import time
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor
from tqdm import tqdm

from megatron_patch.conversion.engine import ConversionError, Plan, make_plan
from megatron_patch.conversion.hf_io import HFCheckpoint, HFShardWriter, copy_side_files, set_config_dtype
from megatron_patch.conversion.legacy import save_legacy
from megatron_patch.conversion.manifest import TensorLog
from megatron_patch.conversion.mcore_io import write_manifest
from megatron_patch.conversion.megatron_checkpoint import MegatronCheckpoint
from megatron_patch.conversion.torch_dist import save_torch_dist
from megatron_patch.models.family import Layout
from megatron_patch.models.registry import get_family, load_hf_config
from megatron_patch.names import FORMATS, HF_SUBDIR, dtype_name, torch_dtype
from megatron_patch.outputs import atomic_output_dir, check_output


class _Meter:
    """Counts tensors/bytes read, for the progress bar and the closing summary."""

    def __init__(self, total: int, desc: str):
        self.start = time.time()
        self.tensors = 0
        self.bytes = 0
        self.bar = tqdm(total=total, desc=desc, unit="tensor")

    def count(self, t: Tensor) -> Tensor:
        self.tensors += 1
        self.bytes += t.numel() * t.element_size()
        self.bar.update()
        return t

    def summary(self, **extra) -> dict:
        self.bar.close()
        seconds = time.time() - self.start
        return dict(extra, tensors=self.tensors, bytes=self.bytes, seconds=round(seconds, 2),
                    gb_per_s=round(self.bytes / seconds / 1e9, 3) if seconds else None,
                    peak_rss_gb=round(peak_rss_bytes() / 1e9, 3))


def peak_rss_bytes() -> int:
    """This process's peak resident set size. Linux's VmHWM belongs to the process image (ru_maxrss
    would report a parent's peak carried across fork+exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
# torch.save reports a failed write as a RuntimeError from its zip writer, not an OSError
_DISK_FULL_TEXT = ("No space left on device", "File too large", "Disk quota exceeded", "unexpected pos",
                   "file write failed")


def _disk_full(e: BaseException) -> bool:
    return (isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS) or any(t in str(e) for t in _DISK_FULL_TEXT)


def _can_still_write(folder: str, size: int = 1 << 20) -> bool:
    """After a failed write whose cause got lost (torch_dist writes in worker processes): can this
    folder take another MiB? If not, the disk (or quota) is full."""
    probe = os.path.join(folder, f".megatron_patch_probe_{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * size)
        return True
    except OSError as e:
        return e.errno not in _DISK_FULL_ERRNOS
    finally:
        if os.path.exists(probe):
            os.remove(probe)


def _disk_errors(fn: Callable[[], dict], out: str) -> dict:
    """Run a conversion; a full disk (or quota) becomes one clear error. The atomic output folder has
    already removed the partial output by then."""
    try:
        return fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        if _disk_full(e) or not _can_still_write(os.path.dirname(os.path.abspath(out))):
            raise OSError(errno.ENOSPC, f"out of disk space writing {out}; nothing was left behind ({e})") from None
        raise


def _check_free_space(out: str, needed: int) -> None:
    """Refuse up front when the output's disk cannot hold the result (a 5% margin for metadata)."""
    parent = os.path.dirname(os.path.abspath(out))
    free = shutil.disk_usage(parent).free
    if free < needed * 1.05:
        raise OSError(errno.ENOSPC, f"not enough disk space for {out}: needs about {needed / 1e9:.2f} GB, "
                                    f"{free / 1e9:.2f} GB free in {parent}")


def _write_megatron(plan: Plan, get: Callable[[str], Tensor], keys: list[str], tmp: str, fmt: str,
                    dtype: torch.dtype | None, allow_nonfinite: bool) -> None:
    """Write the checkpoint and its per-tensor manifest (`tensors.json`; non-finite tensors refused)."""
    log = TensorLog(allow_nonfinite)
    if fmt == "torch_dist":
        save_torch_dist(plan, get, keys, tmp, dtype, log)
    elif fmt == "legacy":
        save_legacy(plan, get, keys, tmp, dtype, log)
    else:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    log.write(tmp)


def _manifest(plan: Plan, fmt: str, dtype: torch.dtype, tmp: str) -> dict:
    fields = dict(family=plan.family.name, impl=plan.impl, tp=plan.layout.tp, pp=plan.layout.pp, ep=plan.layout.ep,
                  format=fmt, dtype=dtype_name(dtype), vocab_size=plan.shapes.vocab_size,
                  padded_vocab_size=plan.shapes.padded_vocab_size,
                  make_vocab_size_divisible_by=plan.layout.make_vocab_size_divisible_by)
    write_manifest(tmp, **fields)
    return fields


def hf_to_mcore(hf_dir: str, out: str, *, layout: Layout = Layout(), impl: str = "local", dtype: str | None = None,
                fmt: str = "torch_dist", overwrite: bool = False, allow_nonfinite: bool = False) -> dict:
    """HF folder -> Megatron checkpoint (torch_dist or legacy) + HF side files + manifest. torch_dist is
    stored whole (megatron loads it at any layout); legacy is written per TP x PP x EP rank of `layout`
    (whose vocab padding rule applies to both)."""
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"HF folder {hf_dir} does not exist")
    check_output(out, overwrite, [hf_dir])
    hf_config = load_hf_config(hf_dir)
    plan = make_plan(hf_config, layout, impl, get_family(hf_config))
    ckpt = HFCheckpoint(hf_dir)
    target = torch_dtype(dtype) if dtype else ckpt.dtype()
    keys = ckpt.keys()
    _check_free_space(out, ckpt.nbytes(target))

    def run() -> dict:
        with atomic_output_dir(out, overwrite, [hf_dir]) as tmp:
            # the legacy writer reads each stage once per TP x EP rank (one rank file in memory)
            meter = _Meter(len(keys) * (layout.tp * layout.ep if fmt == "legacy" else 1), f"hf-to-mcore ({fmt})")
            _write_megatron(plan, lambda k: meter.count(ckpt.get(k)), keys, tmp, fmt, target, allow_nonfinite)
            os.makedirs(os.path.join(tmp, HF_SUBDIR))
            copy_side_files(hf_dir, os.path.join(tmp, HF_SUBDIR))
            fields = _manifest(plan, fmt, target, tmp)
        return meter.summary(**fields, out=os.path.abspath(out))

    return _disk_errors(run, out)


def _hf_chunks(src: MegatronCheckpoint, dtype: torch.dtype | None, meter: _Meter) -> Iterator[dict[str, Tensor]]:
    for chunk in src.hf_chunks(dtype):
        for t in chunk.values():
            meter.count(t)
        yield chunk


def mcore_to_hf(mcore_dir: str, out: str, *, dtype: str | None = None, max_shard_size: int = 5 * 10**9,
                overwrite: bool = False, hf_config: str | None = None, allow_nonfinite: bool = False) -> dict:
    """Megatron checkpoint (either format, ours or written by `megatron.training`) -> HF folder, whose
    config.json states the dtype the tensors are written in."""
    check_output(out, overwrite, [mcore_dir])
    src = MegatronCheckpoint.open(mcore_dir, hf_config)
    target = torch_dtype(dtype) if dtype else None
    plan = src.plan()

    def run() -> dict:
        with atomic_output_dir(out, overwrite, [mcore_dir]) as tmp:
            meter = _Meter(len(plan.hf_names()), f"mcore-to-hf ({src.format})")
            tensors = ((name, chunk[name]) for chunk in _hf_chunks(src, target, meter) for name in sorted(chunk))
            files = _write_hf_tensors(tmp, tensors, max_shard_size, allow_nonfinite)
            _copy_hf_side(src, tmp)
            set_config_dtype(os.path.join(tmp, "config.json"), dtype or dtype_name(src.dtype))
        return meter.summary(family=plan.family.name, format=src.format, shards=len(files),
                             dtype=dtype or dtype_name(src.dtype), out=os.path.abspath(out))

    return _disk_errors(run, out)


def _write_hf_tensors(folder: str, tensors: Iterable[tuple[str, Tensor]], max_shard_size: int,
                      allow_nonfinite: bool) -> list[str]:
    """Sharded safetensors + index + tensors.json (NaN / Inf refused unless allowed); the shard names."""
    log = TensorLog(allow_nonfinite)
    writer = HFShardWriter(folder, max_shard_size, log)
    for name, tensor in tensors:
        writer.add(name, tensor)
    files = writer.close()
    log.write(folder)
    return files


def save_hf_state(hf_tensors: dict[str, Tensor], hf_config: dict, out: str, *, side_dir: str | None = None,
                  overwrite: bool = False, max_shard_size: int = 5 * 10**9) -> dict:
    """A model held in memory (e.g. a policy trained outside megatron.training), as HF tensors, written
    as an HF folder the way `mcore_to_hf` writes one: atomically, NaN / Inf refused, the tokenizer and
    generation files of `side_dir` copied, config.json = `hf_config` stating the weights' dtype."""
    return save_hf_stream(sorted(hf_tensors.items()), hf_config, out, side_dir=side_dir, overwrite=overwrite,
                          max_shard_size=max_shard_size)


def save_hf_stream(tensors: Iterable[tuple[str, Tensor]], hf_config: dict, out: str, *,
                   side_dir: str | None = None, overwrite: bool = False, max_shard_size: int = 5 * 10**9) -> dict:
    """`save_hf_state` for tensors that arrive one at a time (a live model's export: conversion/live.py);
    at most one shard is held. config.json states the dtype of the first floating-point tensor."""
    check_output(out, overwrite)
    seen = {"count": 0, "dtype": None}

    def counted():
        for name, t in tensors:
            seen["count"] += 1
            if seen["dtype"] is None and t.is_floating_point():
                seen["dtype"] = dtype_name(t.dtype)
            yield name, t

    with atomic_output_dir(out, overwrite) as tmp:
        files = _write_hf_tensors(tmp, counted(), max_shard_size, False)
        if side_dir:
            copy_side_files(side_dir, tmp)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        set_config_dtype(os.path.join(tmp, "config.json"), seen["dtype"] or "fp32")
    return {"out": os.path.abspath(out), "shards": len(files), "tensors": seen["count"], "dtype": seen["dtype"]}


def mcore_to_mcore(mcore_dir: str, out: str, *, layout: Layout | Callable[[Layout], Layout] | None = None,
                   impl: str | None = None, fmt: str | None = None, dtype: str | None = None, overwrite: bool = False,
                   hf_config: str | None = None, allow_nonfinite: bool = False) -> dict:
    """Megatron -> Megatron with another layout / naming / format / dtype, without an HF folder.
    Unset options keep the source's value; `layout` is the target layout, or a function of the source's
    (`lambda src: dataclasses.replace(src, tp=2)` changes TP only). Streams: the writer pulls tensors from
    the source one Megatron tensor at a time (a legacy source holds one pipeline stage)."""
    check_output(out, overwrite, [mcore_dir])
    src = MegatronCheckpoint.open(mcore_dir, hf_config)
    if layout is None or callable(layout):
        layout = layout(src.layout) if layout else src.layout
    plan = make_plan(src.hf_config, layout, impl or src.impl)
    fmt = fmt or src.format
    target = torch_dtype(dtype) if dtype else src.dtype

    def run() -> dict:
        with atomic_output_dir(out, overwrite, [mcore_dir]) as tmp:
            meter = _Meter(len(plan.hf_names()), f"mcore-to-mcore ({src.format} -> {fmt})")
            get, keys = src.hf_getter()
            _write_megatron(plan, lambda k: meter.count(get(k)), keys, tmp, fmt, target, allow_nonfinite)
            os.makedirs(os.path.join(tmp, HF_SUBDIR))
            _copy_hf_side(src, os.path.join(tmp, HF_SUBDIR))
            fields = _manifest(plan, fmt, target, tmp)
        return meter.summary(**fields, out=os.path.abspath(out))

    return _disk_errors(run, out)


def _copy_hf_side(src: MegatronCheckpoint, dst: str) -> None:
    """The source's config/tokenizer/generation files, or just its config when it has none."""
    if src.hf_side:
        copy_side_files(src.hf_side, dst)
    else:
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(src.hf_config, f, indent=2)


__all__ = ["ConversionError", "hf_to_mcore", "mcore_to_hf", "mcore_to_mcore", "save_hf_state", "save_hf_stream"]
