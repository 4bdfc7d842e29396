"""Weights between a live, sharded megatron-core model and HF names, in memory: what an RL framework does
every step to refresh its rollout engine, and what a custom trainer does to start from (and end as) an HF
checkpoint, without writing a Megatron checkpoint in between.

- `live_plan(model, hf_config)`: the conversion plan of a model as built, at the layout megatron-core's
  parallel state holds (TP, PP, EP, ETP), in the model's own naming, vocabulary padding and query groups.
- `load_hf_weights(model, hf_config, source)`: this rank's part of an HF folder into its model (only the
  tensors of its pipeline stage, and for experts its EP rank, are read, one at a time), or of HF tensors
  held in memory (a streamed export: refreshing an inference engine's model in place).
- `export_hf_weights(model, hf_config)`: a generator of `(hf_name, tensor)` on every rank of the world, in
  the plan's order: each tensor gathered over its TP (expert: ETP) group, an expert from the EP rank that
  holds it, then sent from its pipeline stage to the others. At most one Megatron tensor is whole at a time
  (with its HF views). `per_stage=True`: each rank yields its own stage's tensors only (no pipeline
  traffic), for engines that load stage-local weights.
- `save_hf(model, hf_config, out)`: the export written by rank 0 as an HF folder, as `mcore-to-hf` writes one.

The tensors come back on the model's device; an HF tensor equals, bit for bit, what the converter makes of a
checkpoint of the same weights (tests/distributed/test_live_weights.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from collections.abc import Mapping as MappingABC
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_patch.conversion.engine import Placement, Plan, load_hf_into_rank, make_plan
from megatron_patch.models.family import Layout
from megatron_patch.models.mappings import Mapping


def chunks(model) -> list:
    """The megatron-core models inside megatron.training's wrappers (DDP, FSDP, Float16Module: megatron-core's
    `unwrap_model`): one, or with virtual pipeline stages megatron.training's list of model chunks, where
    chunk v of pipeline rank p is virtual stage v * PP + p (`Bridge.build` at `Layout(vpp=...)` builds it)."""
    from megatron.core.utils import unwrap_model

    return [unwrap_model(m) for m in (model if isinstance(model, (list, tuple)) else [model])]


def current_layout(make_vocab_size_divisible_by: int = 128) -> Layout:
    """The layout megatron-core's parallel state is initialised with."""
    from megatron.core import parallel_state as ps

    tp, ep = ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_world_size()
    return Layout(tp, ps.get_pipeline_model_parallel_world_size(), make_vocab_size_divisible_by, ep,
                  None if etp == tp else etp, vpp=ps.get_virtual_pipeline_model_parallel_world_size())


def live_plan(model, hf_config: Any) -> Plan:
    """The conversion plan of `model` as built (a GPTModel or HybridModel, wrapped or not, or a virtual
    pipeline's chunks): the current layout, the model's implementation, its padded vocabulary and query
    groups. With V chunks per rank the plan's stages are the PP x V virtual stages (stage v * PP + p: chunk v
    of pipeline rank p)."""
    parts = chunks(model)
    first = parts[0]
    return make_plan(hf_config, current_layout().virtual_stages(len(parts)), first.config.transformer_impl,
                     padded_vocab_size=first.vocab_size, num_query_groups=first.config.num_query_groups)


def _stages(model) -> list[tuple[int, Any]]:
    """(virtual stage, chunk) of this rank's model chunks (`Layout.virtual_stage`)."""
    from megatron.core import parallel_state as ps

    layout, me = current_layout(), ps.get_pipeline_model_parallel_rank()
    return [(layout.virtual_stage(v, me), m) for v, m in enumerate(chunks(model))]


def _gpt_state(model) -> dict[str, Tensor]:
    """A model chunk's weights under the GPT model's names (a HybridModel's renamed), without TE's extra state."""
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    if getattr(model, "hybrid_layer_pattern", None) is not None:
        from megatron_patch.models.hybrid import to_gpt_names

        state = to_gpt_names(state)
    return state


class CountingReader:
    """An HF folder's tensors (an `HFCheckpoint`), whole or in slices, counting what is read: the `reader` of
    `engine.hf_to_megatron`."""

    def __init__(self, ckpt):
        self.ckpt, self.tensors, self.bytes_read = ckpt, 0, 0

    def _count(self, t: Tensor) -> Tensor:
        self.tensors += 1
        self.bytes_read += t.numel() * t.element_size()
        return t

    def get(self, name: str) -> Tensor:
        return self._count(self.ckpt.get(name))

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> Tensor:
        return self._count(self.ckpt.get_slice(name, dim, start, stop))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.ckpt.shape(name)


class _CountingMapping(CountingReader):
    """HF tensors held in memory by name (a streamed export), read whole."""

    def __init__(self, tensors: MappingABC[str, Tensor]):
        super().__init__(tensors)

    def get(self, name: str) -> Tensor:
        return self._count(self.ckpt[name])


def load_hf_weights(model, hf_config: Any, source: str | MappingABC[str, Tensor], *,
                    dtype: torch.dtype | None = None) -> dict:
    """Fill this rank's part of `model` from `source`: an HF folder (only its pipeline stage's and EP rank's
    tensors are read, and of those only this TP rank's slices where the mapping allows, with positioned
    reads), or HF tensors in memory by name (a streamed export: refreshing an inference model from a trained
    one). The weights are copied into the model's own parameters (their storage stays: CUDA graphs captured
    on them stay valid). Returns {"tensors", "bytes_read"} of this rank (tensors: reads, slices counted)."""
    if isinstance(source, (str, os.PathLike)):
        from megatron_patch.conversion.hf_io import HFCheckpoint

        ckpt = HFCheckpoint(os.fspath(source))
        reader, keys = CountingReader(ckpt), ckpt.keys()
        sliced = reader  # a folder is read in slices where the mapping allows
    else:
        reader, keys, sliced = _CountingMapping(source), list(source.keys()), None
    plan = live_plan(model, hf_config)
    for stage, chunk in _stages(model):
        load_hf_into_rank(chunk, plan, reader.get, keys, dtype or next(chunk.parameters()).dtype, reader=sliced,
                          stage=stage)
    return {"tensors": reader.tensors, "bytes_read": reader.bytes_read}


def _whole(plan: Plan, pl: Placement, local: Tensor) -> Tensor:
    """The unsharded Megatron tensor of a placement this rank's stage holds: its (E)TP group's shards, or
    this rank's tensor where every rank of the group holds all of it (norms, biases of row-parallel layers,
    TE's whole MLA down projections)."""
    from megatron.core import parallel_state as ps

    m = pl.mapping
    if m.te_replicated and plan.impl == "transformer_engine":
        return local
    expert = m.expert is not None
    n = plan.layout.expert_tp if expert else plan.layout.tp
    if n == 1 or type(m).shard is Mapping.shard:  # the base op's shard: the same tensor on every rank
        return m.unshard([local] * n, plan.shapes)
    group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    local = local.contiguous()
    shards = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(shards, local, group=group)
    return m.unshard(shards, plan.shapes)


def _from_ep_rank(tensors: list[Tensor], owner: int) -> list[Tensor]:
    """An expert's HF tensors from the EP rank that holds it to the other EP ranks of the stage (each of
    which made the same-shaped tensors from its own expert of that local number)."""
    from megatron.core import parallel_state as ps

    group = ps.get_expert_model_parallel_group()
    src = dist.get_global_rank(group, owner)
    out = []
    for t in tensors:
        t = t.contiguous()
        dist.broadcast(t, src, group=group)
        out.append(t)
    return out


def _from_stage(tensors: list[tuple[str, Tensor]] | None, stage: int, device) -> list[tuple[str, Tensor]]:
    """A stage's HF tensors to every rank of the pipeline (names, shapes and dtypes first)."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    src = dist.get_global_rank(group, stage)
    meta = [[(n, tuple(t.shape), t.dtype) for n, t in tensors] if tensors is not None else None]
    dist.broadcast_object_list(meta, src, group=group)
    out = []
    for i, (name, shape, dtype) in enumerate(meta[0]):
        t = tensors[i][1].contiguous() if tensors is not None else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src, group=group)
        out.append((name, t))
    return out


def _whole_adapter(module, s, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """One slice's adapter (A [r, in], B [out, r]) in HF layout from every TP rank's part: a column-parallel
    linear's B rows (this rank's HF rows: `s.index`), a row-parallel one's A columns; the other factor is
    whole on every rank. A kv head replicated over TP ranks takes the first rank's rows."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or s.index is None:
        return a, b
    mine = (s.index.cpu(), (b if module.lora_site.mode == "column" else a).detach().cpu())
    parts = [None] * tp
    dist.all_gather_object(parts, mine, group=ps.get_tensor_model_parallel_group())
    if module.lora_site.mode == "column":
        whole = b.new_zeros((s.out, b.shape[1]), device="cpu")
        for index, rows in reversed(parts):
            whole[index] = rows
        return a, whole.to(b.device)
    whole = a.new_zeros((a.shape[0], s.inp), device="cpu")
    for index, cols in reversed(parts):
        whole[:, index] = cols
    return whole.to(a.device), b


def export_adapter_weights(model) -> Iterator[tuple[str, Tensor]]:
    """A LoRA model's adapters, whole and in HF layout, keyed `<canonical linear>.lora_A.<HF module>` (global
    layer index; `lora.peft.to_peft` names them as PEFT does), float32, on every rank (a collective)."""
    from megatron.core import parallel_state as ps

    from megatron_patch.lora.adapters import PREFIX_A, PREFIX_B, adapted_modules

    mine_by_stage = dict(_stages(model))
    device = next(chunks(model)[0].parameters()).device
    pp = ps.get_pipeline_model_parallel_world_size()
    for stage in range(pp * len(mine_by_stage)):
        mine = None
        if stage in mine_by_stage:
            mine = []
            for m in adapted_modules(mine_by_stage[stage]):
                for s in m.lora_site.slices:
                    a, b = _whole_adapter(m, s, m.lora_A[s.name].detach(), m.lora_B[s.name].detach())
                    mine += [(f"{m.lora_site.canonical}.{PREFIX_A}.{s.name}", a.float().to(device)),
                             (f"{m.lora_site.canonical}.{PREFIX_B}.{s.name}", b.float().to(device))]
        if pp > 1:
            mine = _from_stage(mine, stage % pp, device)
        yield from mine


def lora_adapter(model, hf_config: Any):
    """The model's LoRA adapter as `lora.peft.Adapter` (HF modules, rank, alpha), gathered on every rank;
    None for a model without adapters (on every rank alike)."""
    from megatron_patch.lora.adapters import adapted_modules
    from megatron_patch.lora.peft import to_peft

    tensors = dict(export_adapter_weights(model))
    if not tensors:
        return None
    # rank and scaling are one LoRAConfig's on every module; a stage without adapters asks another
    m = next((m for chunk in chunks(model) for m in adapted_modules(chunk)), None)
    info = (m.lora_rank, m.lora_scaling, getattr(m.lora_dropout, "p", 0.0)) if m is not None else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, info)
        info = next(i for i in gathered if i is not None)
    rank, scaling, dropout = info
    return to_peft(tensors, live_plan(model, hf_config), rank, scaling * rank, dropout)


def export_hf_weights(model, hf_config: Any, *, dtype: torch.dtype | None = None, per_stage: bool = False,
                      merge_lora: bool = True) -> Iterator[tuple[str, Tensor]]:
    """`(hf_name, tensor)` of the live model, on every rank (a collective: every rank of the world iterates
    it to the end, in step). `dtype` casts each tensor; `per_stage` keeps each stage's tensors on that
    stage. Expert tensor parallelism different from TP is gathered over its own group. A LoRA model's
    adapted weights come merged (W + alpha / r * B @ A, as `lora.export --save-merged` writes them) unless
    `merge_lora=False` (the base weights)."""
    adapter = lora_adapter(model, hf_config) if merge_lora else None
    if adapter is not None:
        from megatron_patch.lora.peft import merged

        for name, t in export_hf_weights(model, hf_config, per_stage=per_stage, merge_lora=False):
            t = merged(name, t, adapter)
            yield name, (t.to(dtype) if dtype is not None else t)
        return
    plan = live_plan(model, hf_config)
    mine_by_stage = dict(_stages(model))
    pp = plan.layout.pp // len(mine_by_stage)  # the plan's stages are the virtual ones
    device = next(chunks(model)[0].parameters()).device
    for stage in range(plan.layout.pp):
        if per_stage and stage not in mine_by_stage:
            continue
        state = _gpt_state(mine_by_stage[stage]) if stage in mine_by_stage else None
        for pl in plan.placements([stage]):
            if pl.copy:
                continue  # the last stage's copy of a tied embedding
            mine = None
            if state is not None:
                # an expert's placement names its rank-local number: every EP rank holds a tensor of that name
                full = _whole(plan, pl, state[pl.name])
                mine = pl.mapping.to_hf(full, plan.shapes)
                if pl.ep is not None and plan.layout.ep > 1:
                    mine = _from_ep_rank(mine, pl.ep)
                mine = list(zip(pl.hf_names, mine))
            if not per_stage and pp > 1:
                mine = _from_stage(mine, stage % pp, device)
            for name, t in mine:
                yield name, (t.to(dtype) if dtype is not None else t)


def save_hf(model, hf_config: dict, out: str, *, dtype: torch.dtype | None = None, side_dir: str | None = None,
            overwrite: bool = False, max_shard_size: int = 5 * 10**9) -> dict | None:
    """The live model as an HF folder, written by rank 0 (atomically, NaN / Inf refused, config.json =
    `hf_config` stating the dtype, tokenizer files of `side_dir`); a collective: every rank calls it and
    returns once the folder is complete, and what rank 0 refuses (the folder exists, a non-finite tensor)
    every rank raises. Rank 0 returns the summary, the others None."""
    from megatron_patch.conversion.convert import save_hf_stream
    from megatron_patch.outputs import check_output

    def stream():
        return ((name, t.cpu()) for name, t in export_hf_weights(model, hf_config, dtype=dtype))

    def save(tensors):
        return save_hf_stream(tensors, hf_config, out, side_dir=side_dir, overwrite=overwrite,
                              max_shard_size=max_shard_size)

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return save(stream())
    rank0 = dist.get_rank() == 0
    # a folder that must not be written is refused on every rank before the export's work
    _on_rank0_raised_everywhere(lambda: check_output(out, overwrite) if rank0 else None)
    tensors = stream()

    def save_on_rank0():
        try:
            return save(tensors) if rank0 else None
        finally:
            for _ in tensors:  # the export's gathers are collectives: every rank goes through all of them
                pass

    return _on_rank0_raised_everywhere(save_on_rank0)


def _on_rank0_raised_everywhere(step):
    """`step()`'s value; what it raised on rank 0 (the only rank it does work on) is raised on every rank: rank 0
    its own exception, the others the same type (a built-in one, else RuntimeError) and message."""
    import builtins

    value, error = None, None
    try:
        value = step()
    except Exception as e:  # noqa: BLE001 - raised below on every rank
        error = e
    outcome = [None if error is None else (type(error).__name__, str(error))]
    dist.broadcast_object_list(outcome, src=0)
    if error is not None:
        raise error
    if outcome[0] is not None:
        name, message = outcome[0]
        kind = getattr(builtins, name, None)
        raise (kind if isinstance(kind, type) and issubclass(kind, Exception) else RuntimeError)(message)
    return value
