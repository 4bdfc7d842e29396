"""megatron-core checkpoints, written and read the way `megatron.training` does, in both formats.

A converted checkpoint folder is what `megatron.training --save` writes, plus the HF side files that
make export self-contained:

    OUT/latest_checkpointed_iteration.txt   "release" (or the iteration, for training checkpoints)
    OUT/release/                            torch_dist: metadata.json, .metadata, *.distcp
                                            legacy: mp_rank_TT[_PPP]/model_optim_rng.pt, one per rank
    OUT/hf/                                 config.json, tokenizer and generation files of the source
    OUT/megatron_patch.json                 family, impl, layout, format, dtype and vocab padding

torch_dist is reshardable: tensors are stored whole, keyed like megatron-core's
`sharded_state_dict()`, and both implementations use the same keys (megatron-core names the norms by
their TE names in the local spec too). The layout chosen at conversion decides the vocab padding and is
stored in the checkpoint's `args`. The sharding metadata comes from the model itself: a TP=PP=1
`GPTModel` built on the meta device, its `sharded_state_dict()` filled with the converted tensors.

legacy (Megatron-LM `--ckpt-format torch`) stores one `model_optim_rng.pt` per (TP, PP) rank holding that
rank's `state_dict()` in the implementation's naming, plus `args`; it is written and read one pipeline
stage at a time.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import os
import re
import threading
from argparse import Namespace
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
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

from megatron_patch.conversion.engine import (
    ConversionError,
    Placement,
    Plan,
    Rank,
    _names,
    check_hf_keys,
    check_megatron_keys,
    extra_state_names,
    hf_to_megatron,
    load_hf_into_rank,
    make_plan,
    megatron_shards,
    placements_to_hf,
)
from megatron_patch.conversion.manifest import TensorLog
from megatron_patch.models.build import build_model
from megatron_patch.models.family import Layout
from megatron_patch.models.parallel import ensure_model_parallel
from megatron_patch.models.registry import get_family, load_hf_config

WRITE_THREADS = 2
MANIFEST = "megatron_patch.json"
HF_SUBDIR = "hf"
TRACKER = "latest_checkpointed_iteration.txt"
LEGACY_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


# ---------------------------------------------------------------------------------------------
# shared


def _flat_plan(plan: Plan, impl: str = "local") -> Plan:
    """The same conversion at TP=PP=1, keeping the plan's vocab padding (torch_dist is unsharded); in
    the local naming unless `impl` says otherwise."""
    return make_plan(plan.hf_config, Layout(1, 1), impl, plan.family, plan.shapes.padded_vocab_size,
                     plan.shapes.num_query_groups)


def checkpoint_args(plan: Plan, fmt: str) -> Namespace:
    """The `args` megatron.training stores and checks on `--load` (check_checkpoint_args): model
    shape, layout and vocab padding, in Megatron-LM's argument names."""
    arch = {k: v for k, v in plan.family.config_kwargs(plan.hf_config).items()
            if isinstance(v, (bool, int, float, str))}
    gpt = plan.family.gpt_kwargs(plan.hf_config)
    position = gpt.get("position_embedding_type", "learned_absolute")
    arch["num_query_groups"] = plan.shapes.num_query_groups
    return Namespace(
        **arch,
        group_query_attention=plan.shapes.num_query_groups != plan.shapes.num_heads,
        position_embedding_type=position,
        add_position_embedding=position == "learned_absolute",
        untie_embeddings_and_output_weights=not gpt.get("share_embeddings_and_output_weights", False),
        max_position_embeddings=plan.family.max_sequence_length(plan.hf_config),
        tensor_model_parallel_size=plan.layout.tp,
        pipeline_model_parallel_size=plan.layout.pp,
        expert_model_parallel_size=plan.layout.ep,
        num_experts=plan.num_experts or None,
        make_vocab_size_divisible_by=plan.layout.make_vocab_size_divisible_by,
        padded_vocab_size=plan.shapes.padded_vocab_size,
        transformer_impl=plan.impl,
        ckpt_format="torch" if fmt == "legacy" else fmt,
    )


def write_tracker(out_dir: str) -> None:
    with open(os.path.join(out_dir, TRACKER), "w") as f:
        f.write("release")


def checkpoint_step_dir(ckpt_dir: str) -> str:
    """The folder holding the newest checkpoint: `release/` or `iter_XXXXXXX/` per the tracker file."""
    tracker = os.path.join(ckpt_dir, TRACKER)
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"Megatron checkpoint folder {ckpt_dir} does not exist")
    if not os.path.isfile(tracker):
        raise FileNotFoundError(f"{ckpt_dir} is not a Megatron checkpoint folder (no {TRACKER})")
    with open(tracker) as f:
        step = f.read().strip()
    if step != "release" and not step.isdigit():
        raise ConversionError(f"{tracker} holds {step!r}, neither 'release' nor an iteration number")
    path = os.path.join(ckpt_dir, "release" if step == "release" else f"iter_{int(step):07d}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{tracker} points to {path}, which does not exist")
    return path


def detect_format(step_dir: str) -> str:
    if os.path.isfile(os.path.join(step_dir, "metadata.json")):
        return "torch_dist"
    if any(_RANK_DIR.match(n) for n in os.listdir(step_dir)):
        return "legacy"
    raise ConversionError(f"{step_dir} holds neither a torch_dist (metadata.json) nor a legacy (mp_rank_*) checkpoint")


# ---------------------------------------------------------------------------------------------
# torch_dist


def _template(plan: Plan, dtype: torch.dtype) -> dict:
    """A TP=PP=1 model's sharded state dict, on the meta device, with the plan's vocab padding."""
    ensure_model_parallel(1, 1)
    with torch.device("meta"):
        model = build_model(
            plan.hf_config, 1, 1, impl="local", dtype=dtype, family=plan.family,
            padded_vocab_size=plan.shapes.padded_vocab_size, perform_initialization=False,
            num_query_groups=plan.shapes.num_query_groups,
            use_cpu_initialization=True,  # stay on the meta device even when a GPU is present
        )
    return model.sharded_state_dict()


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
    for name in sorted(extra_state_names(_flat_plan(plan, "transformer_engine"), 0) - set(sharded)):
        key, shape, offset = name, (1,), (0,)
        m = layer.match(name)
        if m and not layer_object[m[1]].key.startswith(f"decoder.layers.{m[1]}."):  # layers stacked under one key
            ref = layer_object[m[1]]
            key, shape, offset = f"decoder.layers.{m[2]}", ref.global_shape, ref.global_offset
        out[name] = ShardedObject(key, None, shape, offset, replica_id=0)
    return out


def expected_shapes(plan: Plan, sharded: dict | None = None) -> dict[str, tuple[int, ...]]:
    """Canonical name -> unsharded shape, from a meta TP=PP=1 model of the plan's config (or its
    already-built sharded state dict)."""
    if sharded is None:
        sharded = _template(_flat_plan(plan), torch.float32)
    return {k: tuple(v.data.shape) for k, v in sharded.items() if not k.endswith("._extra_state")}


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

    flat = _flat_plan(plan)
    check_hf_keys(flat, hf_keys)
    sharded = _template(flat, dtype)
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

    common = {"checkpoint_version": 3.0, "iteration": 0, "args": checkpoint_args(plan, "torch_dist")}
    planner = _LazySavePlanner(sharded, convert, common, dtype, log)
    release = os.path.join(out_dir, "release")
    os.makedirs(release)
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

    def __init__(self, sharded: dict, convert: Callable[[str], Tensor], common: dict, dtype: torch.dtype,
                 log: TensorLog | None = None):
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items: list[WriteItem] = []
        self._data: dict[MetadataIndex, Callable[[], Any]] = {}
        self._convert, self._lock, self._log = convert, threading.Lock(), log
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
                    self._add_tensor(piece, dtype, lambda n=name, e=entry, i=i: e.build_fn(
                        e.key, tensor(n), e.replica_id, e.flattened_range)[i].data)
            elif isinstance(entry, ShardedTensor):
                self._pending[name] = 1
                self._add_tensor(entry, dtype, lambda n=name: tensor(n))
            else:
                raise ConversionError(f"{name}: unexpected {type(entry).__name__} in the sharded state dict")
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

    def _add_tensor(self, sh: Any, dtype: torch.dtype, produce: Callable[[], Tensor]) -> None:
        offsets = torch.Size(sh.global_offset)
        sizes = torch.Size((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        index = MetadataIndex(sh.key, offsets)
        self._items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=dtype), size=torch.Size(sh.global_shape))))
        label = f"{sh.key}@{','.join(map(str, offsets))}"

        def data() -> Tensor:
            t = produce().reshape(sizes)
            return self._log.add(label, t) if self._log is not None else t

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
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(step_dir).read_metadata()
    md = meta.state_dict_metadata.get("embedding.word_embeddings.weight")
    if md is None or not hasattr(md, "properties"):
        raise ConversionError(f"{step_dir}: no embedding.word_embeddings.weight in the checkpoint")
    common = dist_checkpointing.load_common_state_dict(step_dir)
    # layers are stacked under one key, except in per-layer specs (mixture-of-experts models)
    qkv = next((meta.state_dict_metadata[k] for k in ("decoder.layers.self_attention.linear_qkv.weight",
                                                      "decoder.layers.0.self_attention.linear_qkv.weight")
                if k in meta.state_dict_metadata), None)
    qkv_rows = int(qkv.size[-2]) if qkv is not None and hasattr(qkv, "size") else None
    return md.properties.dtype, int(md.size[0]), common.get("args"), qkv_rows


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
        self.sharded = _template(flat, self.dtype)
        self._reader = dcp.FileSystemReader(step_dir)

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
                view = sh.data.view((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
                requests.append((sh.key, tuple(sh.global_offset), view))
        dcp.load({}, storage_reader=self._reader, planner=_ChunkLoadPlanner(requests), no_dist=True)
        return tensors


# ---------------------------------------------------------------------------------------------
# legacy (Megatron-LM per-rank files)


def legacy_rank_dir(step_dir: str, tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron-LM's folder name: mp_rank_TT, + _PPP with pipeline parallelism, + _EEE with expert parallelism."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(step_dir, name + (f"_{ep_rank:03d}" if ep > 1 else ""))


def save_legacy(plan: Plan, get: Callable[[str], Tensor], hf_keys: Iterable[str], out_dir: str,
                dtype: torch.dtype | None, log: TensorLog | None = None) -> None:
    """Convert and write `out_dir/release/mp_rank_*/model_optim_rng.pt`, one rank file at a time:
    memory holds one rank's tensors, at the price of reading a stage's HF tensors once per TP rank."""
    hf_keys = list(hf_keys)
    step_dir = os.path.join(out_dir, "release")
    args = checkpoint_args(plan, "legacy")
    expected = expected_shapes(plan)
    lay = plan.layout
    for stage in range(lay.pp):
        extra = dict.fromkeys(extra_state_names(plan, stage))
        for tp_rank, ep_rank in itertools.product(range(lay.tp), range(lay.ep)):
            sd = hf_to_megatron(plan, get, hf_keys, dtype, [stage], expected, [tp_rank], [ep_rank])[
                (tp_rank, stage, ep_rank)]
            folder = legacy_rank_dir(step_dir, tp_rank, stage, lay.pp, ep_rank, lay.ep)
            os.makedirs(folder)
            if log is not None:
                for name, tensor in sd.items():
                    log.add(f"{os.path.basename(folder)}/{name}", tensor)
            torch.save({"model": {**sd, **extra}, "args": args, "checkpoint_version": 3.0, "iteration": 0},
                       os.path.join(folder, LEGACY_FILE))
            del sd
    write_tracker(out_dir)


def _safe_globals() -> list:
    """Classes a legacy checkpoint may pickle besides tensors (megatron-core's own allow-list)."""
    from megatron.core.safe_globals import SAFE_GLOBALS

    return [Namespace, *SAFE_GLOBALS]


def load_legacy_file(path: str) -> dict:
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # truncated / corrupt pickle or zip
        raise ConversionError(f"cannot read {path}: {e}") from None


def legacy_layout(step_dir: str) -> tuple[int, int, int]:
    """(TP, PP, EP) from the rank folders (`mp_rank_TT_NNN` is a pipeline or an expert rank: the stored
    args say which); incomplete sets are an error naming the missing folders."""
    ranks = []
    for name in sorted(os.listdir(step_dir)):
        m = _RANK_DIR.match(name)
        if m:
            ranks.append(tuple(int(g) if g is not None else None for g in m.groups()))
    if not ranks:
        raise ConversionError(f"{step_dir} has no mp_rank_* folders")
    if len({sum(g is not None for g in r) for r in ranks}) > 1:
        raise ConversionError(f"{step_dir} mixes mp_rank_TT, mp_rank_TT_NNN and mp_rank_TT_PPP_EEE folders")
    tp, pp, ep = max(r[0] for r in ranks) + 1, 1, 1
    if ranks[0][2] is not None:
        pp, ep = max(r[1] for r in ranks) + 1, max(r[2] for r in ranks) + 1
    elif ranks[0][1] is not None:
        n = max(r[1] for r in ranks) + 1
        args = load_legacy_file(os.path.join(step_dir, "mp_rank_00_000", LEGACY_FILE)).get("args")
        pp, ep = (1, n) if int(getattr(args, "expert_model_parallel_size", 1) or 1) > 1 else (n, 1)
    missing = [os.path.basename(legacy_rank_dir(step_dir, t, p, pp, e, ep))
               for t in range(tp) for p in range(pp) for e in range(ep)
               if not os.path.isfile(os.path.join(legacy_rank_dir(step_dir, t, p, pp, e, ep), LEGACY_FILE))]
    if missing:
        raise ConversionError(f"incomplete legacy checkpoint {step_dir}: no {LEGACY_FILE} in {', '.join(missing)}")
    return tp, pp, ep


def load_legacy_stage(step_dir: str, tp: int, pp: int, stage: int, ep: int = 1) -> dict[Rank, dict[str, Tensor]]:
    return {(t, stage, e): load_legacy_file(os.path.join(legacy_rank_dir(step_dir, t, stage, pp, e, ep),
                                                         LEGACY_FILE))["model"]
            for t in range(tp) for e in range(ep)}


# ---------------------------------------------------------------------------------------------
# reading any Megatron checkpoint folder


def _query_groups(hf_config: dict, qkv_rows: int | None) -> int | None:
    """Query groups of a stored `linear_qkv` with `qkv_rows` rows in all: (heads + 2 groups) x head_dim."""
    if qkv_rows is None:
        return None
    s = get_family(hf_config).shapes(hf_config, Layout())
    return (qkv_rows // s.head_dim - s.num_heads) // 2


@dataclass
class MegatronCheckpoint:
    """A Megatron checkpoint folder opened for reading: format, layout, naming and the HF config."""

    path: str
    step_dir: str
    format: str
    hf_config: dict
    hf_side: str | None  # folder with config/tokenizer files to carry along, if any
    impl: str
    layout: Layout
    padded_vocab_size: int
    dtype: torch.dtype
    num_query_groups: int | None = None  # as stored (kv heads replicated for a larger TP), if known

    @classmethod
    def open(cls, path: str, hf_config: str | None = None) -> MegatronCheckpoint:
        """`hf_config` (a config.json or HF folder) is needed only for checkpoints not written by
        megatron_patch (e.g. by `megatron.training`), which carry no `hf/` side folder."""
        step_dir = checkpoint_step_dir(path)
        fmt = detect_format(step_dir)
        side = os.path.join(path, HF_SUBDIR)
        if hf_config is not None:
            cfg, hf_side = load_hf_config(hf_config), (hf_config if os.path.isdir(hf_config) else None)
        elif os.path.isfile(os.path.join(side, "config.json")):
            cfg, hf_side = load_hf_config(side), side
        else:
            raise ConversionError(f"{path} has no {HF_SUBDIR}/config.json (not converted by megatron_patch): "
                                  "pass --hf-config with the model's HF config.json")
        manifest = read_manifest(path) if os.path.isfile(os.path.join(path, MANIFEST)) else {}
        divisible_by = int(manifest.get("make_vocab_size_divisible_by", 128))
        if fmt == "torch_dist":
            dtype, rows, args, qkv_rows = torch_dist_info(step_dir)
            tp = int(getattr(args, "tensor_model_parallel_size", 1))
            pp = int(getattr(args, "pipeline_model_parallel_size", 1))
            ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
            impl = manifest.get("impl") or getattr(args, "transformer_impl", None) or "local"
        else:
            tp, pp, ep = legacy_layout(step_dir)
            first = load_legacy_file(os.path.join(legacy_rank_dir(step_dir, 0, 0, pp, 0, ep), LEGACY_FILE))["model"]
            emb = first.get("embedding.word_embeddings.weight")
            if emb is None:
                raise ConversionError(f"{legacy_rank_dir(step_dir, 0, 0, pp, 0, ep)}: "
                                      "no embedding.word_embeddings.weight")
            dtype, rows = emb.dtype, emb.shape[0] * tp
            qkv = first.get("decoder.layers.0.self_attention.linear_qkv.weight")
            qkv_rows = None if qkv is None else qkv.shape[0] * tp
            te = any(k.endswith(".layer_norm_weight") for k in first)
            impl = "transformer_engine" if te else "local"
        return cls(path, step_dir, fmt, cfg, hf_side, impl, Layout(tp, pp, divisible_by, ep), rows, dtype,
                   _query_groups(cfg, qkv_rows))

    def plan(self) -> Plan:
        return make_plan(self.hf_config, self.layout, self.impl, padded_vocab_size=self.padded_vocab_size,
                         num_query_groups=self.num_query_groups)

    def hf_getter(self) -> tuple[Callable[[str], Tensor], list[str]]:
        """Random access to the checkpoint as HF tensors: (get(name), names). Reads the Megatron
        tensor behind the requested name (torch_dist: just its chunks; legacy: its stage's rank
        files, one stage held at a time) and keeps that tensor's HF tensors for the next requests
        (q, k and v come from one linear_qkv). Not thread-safe: callers serialise."""
        plan = self.plan()
        if self.format == "torch_dist":
            plan = _flat_plan(plan)
            reader = TorchDistReader(plan, self.step_dir)

            def source(pl: Placement) -> dict[Rank, dict[str, Tensor]]:
                return {(0, 0, 0): reader.read([pl.name])}
        else:
            stage_cache: dict[int, dict[Rank, dict[str, Tensor]]] = {}

            def source(pl: Placement) -> dict[Rank, dict[str, Tensor]]:
                if pl.stage not in stage_cache:
                    stage_cache.clear()
                    ranks = load_legacy_stage(self.step_dir, self.layout.tp, self.layout.pp, pl.stage, self.layout.ep)
                    check_megatron_keys(plan, ranks)
                    stage_cache[pl.stage] = ranks
                return stage_cache[pl.stage]

        index = {h: pl for pl in plan.placements() if not pl.copy for h in pl.hf_names}
        last: dict[str, Tensor] = {}

        def get(name: str) -> Tensor:
            if name not in last:
                pl = index[name]
                last.clear()
                last.update(placements_to_hf(plan, [pl], source(pl)))
            return last[name]

        return get, list(index)

    def hf_chunks(self, dtype: torch.dtype | None = None) -> Iterator[dict[str, Tensor]]:
        """The checkpoint as HF tensors, one layer at a time (legacy: the stage's rank files are held
        while its layers are converted; torch_dist: only the layer is read)."""
        plan = self.plan()
        if self.format == "torch_dist":
            flat = _flat_plan(plan)
            reader = TorchDistReader(flat, self.step_dir)
            placements = {pl.name: pl for pl in flat.placements()}
            for names in reader.layer_groups():
                yield placements_to_hf(flat, [placements[n] for n in names], {(0, 0, 0): reader.read(names)}, dtype)
            return
        for stage in range(self.layout.pp):
            ranks = load_legacy_stage(self.step_dir, self.layout.tp, self.layout.pp, stage, self.layout.ep)
            check_megatron_keys(plan, ranks)
            groups: dict[int | None, list] = {}
            for pl in plan.placements([stage]):
                groups.setdefault(pl.layer, []).append(pl)
            for group in groups.values():  # one layer's HF tensors at a time next to the stage
                yield placements_to_hf(plan, group, ranks, dtype)
            del ranks


# ---------------------------------------------------------------------------------------------
# manifest and loading a model


def write_manifest(out_dir: str, **fields: Any) -> None:
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(fields, f, indent=2, sort_keys=True)


def read_manifest(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{ckpt_dir} has no {MANIFEST}: not written by megatron_patch")
    with open(path) as f:
        return json.load(f)


def load_megatron_model(ckpt_dir: str, tp: int = 1, pp: int = 1, impl: str | None = None,
                        dtype: torch.dtype = torch.float32, hf_config: str | None = None, ep: int = 1):
    """Build this rank's `GPTModel` for a Megatron checkpoint and load its weights: torch_dist the
    way `megatron.training` does (through the model's sharded state dict, any layout); legacy
    through the engine (any layout). Returns (model, hf_config)."""
    from megatron.core import dist_checkpointing

    ckpt = MegatronCheckpoint.open(ckpt_dir, hf_config)
    impl = impl or ckpt.impl
    ensure_model_parallel(tp, pp, ep)
    # torch_dist is loaded as stored (its kv-head replication included); legacy goes through HF tensors
    # (multi-latent attention has no query groups to keep)
    groups = ({"num_query_groups": ckpt.num_query_groups}
              if ckpt.format == "torch_dist" and ckpt.num_query_groups is not None else {})
    model = build_model(ckpt.hf_config, tp, pp, impl=impl, dtype=dtype,
                        padded_vocab_size=ckpt.padded_vocab_size, perform_initialization=False, ep=ep, **groups)
    if ckpt.format == "torch_dist":
        # both implementations key their tensors alike; a Transformer Engine model also asks for the
        # `_extra_state` objects of norms it keeps apart, which a checkpoint converted for `local` may lack
        try:
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt.step_dir)["model"]
        except Exception as e:
            if impl == ckpt.impl:
                raise
            raise ValueError(f"{ckpt_dir} was converted for the {ckpt.impl} implementation and does not load as "
                             f"{impl} ({type(e).__name__}); convert it: toolkits.checkpoint_converter mcore-to-mcore "
                             f"--impl {impl}") from e
        model.load_state_dict(loaded, strict=True)
    else:
        hf = {k: v for chunk in ckpt.hf_chunks() for k, v in chunk.items()}
        plan = make_plan(ckpt.hf_config, Layout(tp, pp, ckpt.layout.make_vocab_size_divisible_by, ep), impl,
                         padded_vocab_size=ckpt.padded_vocab_size)
        load_hf_into_rank(model, plan, hf.__getitem__, hf.keys(), dtype)
    return model.eval(), ckpt.hf_config
