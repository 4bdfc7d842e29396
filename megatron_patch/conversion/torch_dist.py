"""torch_dist checkpoints (megatron-core's `dist_checkpointing`, torch.distributed.checkpoint files):
written streaming, one converted tensor at a time, with exactly megatron-core's keys and file layout; read
one layer at a time at any stored chunking."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import threading
from argparse import Namespace
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_patch import compat
from megatron_patch.conversion.engine import (
    ConversionError,
    Plan,
    _names,
    check_hf_keys,
    extra_state_names,
    megatron_shards,
)
from megatron_patch.conversion.manifest import TensorLog
from megatron_patch.conversion.mcore_io import checkpoint_args, expected_shapes, flat_plan, meta_template, write_tracker
from megatron_patch.names import RELEASE

WRITE_THREADS = 2
STACKED_LAYERS = "decoder.layers."
HYBRID_FINAL_NORM = "decoder.final_norm."  # HybridModel's final norm (GPTModel's: decoder.final_layernorm)


def _with_te_extra_states(plan: Plan, sharded: dict) -> dict:
    """The template plus the `_extra_state` objects a Transformer Engine model has and the local one
    lacks (norms TE does not fuse into a linear: final, MoE pre-MLP, MLA input, q/k). megatron-core
    loads every object a model asks for, so a checkpoint meant for TE must hold them; like the local
    linears' they are empty (no FP8 state yet). Keyed as the template's layers are (stacked or per layer)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    layer = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
    layer_object = {}  # layer number -> one of the template's objects in that layer (its key shows the stacking)
    for name, entry in sharded.items():
        m = layer.match(name)
        if m and isinstance(entry, ShardedObject):
            layer_object.setdefault(m[1], entry)
    out = dict(sharded)
    for name in sorted(extra_state_names(flat_plan(plan, "transformer_engine"), 0) - set(sharded)):
        key, shape, offset = name, (1,), (0,)
        m = layer.match(name)
        if m and not layer_object[m[1]].key.startswith(f"decoder.layers.{m[1]}."):  # layers stacked under one key
            ref = layer_object[m[1]]
            key, shape, offset = f"decoder.layers.{m[2]}", ref.global_shape, ref.global_offset
        out[name] = ShardedObject(key, None, shape, offset, replica_id=0)
    return out


def save_torch_dist(plan: Plan, get: Callable[[str], Tensor], hf_keys: Iterable[str], out_dir: str,
                    dtype: torch.dtype, log: TensorLog | None = None) -> None:
    """Convert HF tensors (read by name through `get`) and write `out_dir/release` + the tracker,
    streaming: one tensor is converted and written at a time.

    The file layout is exactly megatron-core's (`dist_checkpointing.save` with the torch_dist
    strategy): the same ShardedTensor keys, one chunk per layer, `_extra_state` objects and the
    `common_state` object, written by torch.distributed.checkpoint. Only the order differs:
    megatron-core materialises the whole state dict first; here each write item's data is computed
    when the writer asks for it (`_LazySavePlanner.resolve_data`)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    flat = flat_plan(plan)
    check_hf_keys(flat, hf_keys)
    sharded = meta_template(flat, dtype)
    expected = expected_shapes(flat, sharded)
    if plan.impl == "transformer_engine":
        sharded = _with_te_extra_states(flat, sharded)
    placements = {pl.name: pl for pl in flat.placements()}
    if set(placements) != set(expected):
        raise ConversionError(f"weight map and model disagree: {_names(set(placements) ^ set(expected))}")

    def convert(name: str) -> Tensor:
        """The unsharded Megatron tensor `name`, converted from its HF tensors."""
        pl = placements[name]
        return megatron_shards(flat, pl, [get(h) for h in pl.hf_names], dtype, expected)[0]

    def sources(name: str) -> Iterable[tuple[str, Tensor]]:
        return ((h, get(h)) for h in placements[name].hf_names)

    common = {"checkpoint_version": 3.0, "iteration": 0, "args": checkpoint_args(plan, "torch_dist")}
    inline = compat.torch_dist_common_state_inline()
    planner = _LazySavePlanner(sharded, convert, common if inline else None, dtype, log, sources)
    release = os.path.join(out_dir, RELEASE)
    os.makedirs(release)
    if not inline:
        torch.save(common, os.path.join(release, COMMON_STATE_FNAME))
    # two writer threads (two .distcp files): one converts while the other writes
    writer = dcp.FileSystemWriter(release, single_file_per_rank=True, thread_count=WRITE_THREADS)
    try:
        dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    except CheckpointException as e:
        # DCP wraps whatever our on-demand conversion raised (a bad tensor, Ctrl-C, a full disk)
        raise next(iter(e.failures.values()))[0] from None
    # a writer thread that died of a BaseException leaves its items out without failing the save
    stored = dcp.FileSystemReader(release).read_metadata().storage_data
    missing = [item.index.fqn for item in planner.plan.items if item.index not in stored]
    if missing:
        raise ConversionError(f"incomplete torch_dist write, {len(missing)} items missing: {_names(set(missing))}")
    save_config(CheckpointingConfig("torch_dist", 1), release)
    write_tracker(out_dir)


def _as_bytes(obj: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save([obj], buf)  # megatron-core stores a ShardedObject's data as torch.save([data])
    return buf


class _LazySavePlanner(DefaultSavePlanner):
    """A torch.distributed.checkpoint planner over a megatron-core sharded state dict (meta tensors)
    whose data is produced on demand by `convert(state_dict_name)`. A converted tensor is kept only
    until all its pieces (two for a gated linear_fc1) have been handed to the writer threads."""

    def __init__(self, sharded: dict, convert: Callable[[str], Tensor], common: dict | None, dtype: torch.dtype,
                 log: TensorLog | None = None, sources: Callable[[str], Iterable[tuple[str, Tensor]]] | None = None):
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items: list[WriteItem] = []
        self._data: dict[MetadataIndex, Callable[[], Any]] = {}
        self._convert, self._lock, self._log, self._sources = convert, threading.Lock(), log, sources
        self._cache: dict[str, Tensor] = {}
        self._pending: dict[str, int] = {}
        tensor = self._tensor
        for name, entry in sharded.items():
            if isinstance(entry, ShardedObject):
                self._add_object(entry.unique_key, entry.data)
            elif isinstance(entry, ShardedTensorFactory):  # e.g. gated linear_fc1: two pieces
                pieces = entry.build_fn(entry.key, entry.data, entry.replica_id, entry.flattened_range)
                self._pending[name] = len(pieces)
                for i, piece in enumerate(pieces):
                    self._add_tensor(name, piece, dtype, lambda n=name, e=entry, i=i: e.build_fn(
                        e.key, tensor(n), e.replica_id, e.flattened_range)[i].data)
            elif isinstance(entry, ShardedTensor):
                self._pending[name] = 1
                self._add_tensor(name, entry, dtype, lambda n=name: tensor(n))
            else:
                raise ConversionError(f"{name}: unexpected {type(entry).__name__} in the sharded state dict")
        if common is not None:  # (else in common.pt: megatron_patch.compat.torch_dist_common_state_inline)
            self._add_object(ShardedObject("common_state", None, (1,), (0,)).unique_key, common)

    def _tensor(self, name: str) -> Tensor:
        with self._lock:
            t = self._cache.get(name)
            if t is None:
                t = self._cache[name] = self._convert(name)
            self._pending[name] -= 1
            if not self._pending[name]:
                del self._cache[name]
        return t

    def _add_tensor(self, name: str, sh: Any, dtype: torch.dtype, produce: Callable[[], Tensor]) -> None:
        offsets = torch.Size(sh.global_offset)
        sizes = torch.Size((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        index = MetadataIndex(sh.key, offsets)
        self._items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=dtype), size=torch.Size(sh.global_shape))))
        label = f"{sh.key}@{','.join(map(str, offsets))}"

        sources = (lambda: self._sources(name)) if self._sources is not None else None

        def data() -> Tensor:
            t = produce().reshape(sizes)
            return self._log.add(label, t, sources) if self._log is not None else t

        self._data[index] = data

    def _add_object(self, key: str, obj: Any) -> None:
        index = MetadataIndex(key)
        self._items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
        self._data[index] = lambda: _as_bytes(obj)

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Tensor | io.BytesIO:
        return self._data[write_item.index]()


def torch_dist_info(step_dir: str) -> tuple[torch.dtype, int, Namespace | None, int | None]:
    """(stored dtype, embedding rows, stored args, linear_qkv rows) from the checkpoint's metadata,
    no tensor data."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(step_dir).read_metadata()
    md = meta.state_dict_metadata.get("embedding.word_embeddings.weight")
    if md is None or not hasattr(md, "properties"):
        raise ConversionError(f"{step_dir}: no embedding.word_embeddings.weight in the checkpoint")
    common = compat.load_torch_dist_common(step_dir)
    # layers are stacked under one key, except in per-layer specs (mixture-of-experts models)
    qkv = next((meta.state_dict_metadata[k] for k in ("decoder.layers.self_attention.linear_qkv.weight",
                                                      "decoder.layers.0.self_attention.linear_qkv.weight")
                if k in meta.state_dict_metadata), None)
    qkv_rows = int(qkv.size[-2]) if qkv is not None and hasattr(qkv, "size") else None
    return md.properties.dtype, int(md.size[0]), common.get("args"), qkv_rows


def is_hybrid_checkpoint(step_dir: str) -> bool:
    """Whether a torch_dist checkpoint was saved by a HybridModel (`--model-class hybrid`: every sublayer
    its own layer, `decoder.final_norm`) rather than a GPTModel (`decoder.final_layernorm`)."""
    from torch.distributed.checkpoint import FileSystemReader

    return any(k.startswith(HYBRID_FINAL_NORM) for k in FileSystemReader(step_dir).read_metadata().state_dict_metadata)


def _hybrid_storage(key: str, offsets: tuple[int, ...], prepend: int) -> tuple[str, tuple[int, ...], int]:
    """Where a GPT model's checkpoint tensor (`key`, its global offsets and number of prepended axes) lies in
    a HybridModel's checkpoint: layers stacked under one key (the dense GPT form) are unstacked (the first
    offset is the GPT layer), then renamed to the hybrid layer holding that sublayer (`hybrid.hybrid_name`)."""
    from megatron_patch.models.hybrid import hybrid_name  # megatron-core >= 0.19, as the checkpoint's writer

    if key.startswith(STACKED_LAYERS) and not re.match(r"decoder\.layers\.\d+\.", key):
        key = f"{STACKED_LAYERS}{offsets[0]}.{key[len(STACKED_LAYERS):]}"
        offsets, prepend = offsets[1:], prepend - 1
    return hybrid_name(key), offsets, prepend


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads chosen chunks of a torch_dist checkpoint into given tensors (one layer at a time).
    megatron-core's own loader wants every fragment of a layer-stacked tensor in one call when the
    world has one process, so partial reads go through torch.distributed.checkpoint directly; any
    stored chunking (one chunk per layer, or TP shards from a training run) is resharded by DCP."""

    def __init__(self, requests: list[tuple[str, tuple[int, ...], Tensor]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._requests = requests
        self._dest: dict[tuple[str, tuple[int, ...]], Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, offsets, dest in self._requests:
            md = self.metadata.state_dict_metadata.get(key)
            if md is None:
                raise ConversionError(f"the checkpoint has no tensor {key}")
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=dest.shape)
            items += create_read_items_for_chunk_list(key, md, [chunk])
            self._dest[(key, tuple(offsets))] = dest
        self.plan = LoadPlan(items)
        return self.plan

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        t = self._dest[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, start, length)
        return t

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        pass  # read in place


class TorchDistReader:
    """Reads chosen Megatron tensors (state-dict names of a TP=PP=1 model) from a torch_dist
    checkpoint, converted or written by `megatron.training`; only model weights are read.
    A tensor missing from the checkpoint is an error."""

    def __init__(self, flat: Plan, step_dir: str):
        self.dtype = torch_dist_info(step_dir)[0]
        self.sharded = meta_template(flat, self.dtype)
        self._reader = dcp.FileSystemReader(step_dir)
        self.hybrid = is_hybrid_checkpoint(step_dir)

    def layer_groups(self) -> list[list[str]]:
        """Parameter names grouped by transformer layer (non-layer tensors alone)."""
        groups: dict[str, list[str]] = {}
        for name in self.sharded:
            if not name.endswith("._extra_state"):
                m = re.match(r"decoder\.layers\.(\d+)\.", name)
                groups.setdefault(m.group(0) if m else name, []).append(name)
        return list(groups.values())

    def read(self, names: list[str]) -> dict[str, Tensor]:
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

        tensors, requests = {}, []
        for n in names:
            entry = self.sharded[n]
            tensors[n] = torch.empty(entry.data.shape, dtype=self.dtype)
            pieces = (entry.build_fn(entry.key, tensors[n], entry.replica_id, entry.flattened_range)
                      if isinstance(entry, ShardedTensorFactory)
                      else [dataclasses.replace(entry, data=tensors[n], dtype=self.dtype)])
            for sh in pieces:  # views of tensors[n]: reading a piece fills its part of the tensor
                key, offsets, prepend = sh.key, tuple(sh.global_offset), sh.prepend_axis_num
                if self.hybrid:
                    key, offsets, prepend = _hybrid_storage(key, offsets, prepend)
                requests.append((key, offsets, sh.data.view((1,) * prepend + tuple(sh.local_shape))))
        dcp.load({}, storage_reader=self._reader, planner=_ChunkLoadPlanner(requests), no_dist=True)
        return tensors
