"""The conversion engine: HF state dict <-> per-rank megatron-core state dicts, any TP x PP x EP.

Family files declare *what* maps to what (`megatron_patch.models.mappings`); everything about
*where* a tensor goes lives here: global -> stage-local layer numbers, which pipeline stage holds
the embedding / final norm / output layer, TP sharding, which expert-parallel rank holds an expert and
its rank-local number, vocab padding, the `local` <-> `transformer_engine` parameter naming, dtype, and
the strict accounting of every key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from megatron_patch.models.family import Impl, Layout, ModelFamily
from megatron_patch.models.mappings import Drop, Mapping, Replicated, Shapes
from megatron_patch.models.registry import get_family
from megatron_patch.names import IMPLS
from megatron_patch.runtime.parallel import Rank


class Placement(NamedTuple):
    """One Megatron tensor of one pipeline stage and the mapping that fills it."""

    mapping: Mapping
    layer: int | None  # global layer index, None for non-layer tensors
    stage: int
    name: str  # stage-local name in the plan's implementation naming
    copy: bool = False  # a duplicate (tied output layer on the last stage), not a source of HF tensors
    ep: int | None = None  # the expert-parallel rank that holds it (an expert's tensor); None: every EP rank

    @property
    def hf_names(self) -> tuple[str, ...]:
        return self.mapping.names(self.layer)[1]

    @property
    def canonical(self) -> str:
        """Unsharded `local` name with the global layer index (a TP=PP=1 model's state-dict key)."""
        return self.mapping.names(self.layer)[0]

# Transformer Engine fuses the pre-attention / pre-MLP norms into the following linear layer. Tensors
# named otherwise under TE (a sparse layer's own pre-MLP norm, grouped-GEMM experts, MLA) state their TE
# name in their mapping (`Mapping.te_name`).
_TE_RENAMES = (
    (".input_layernorm.", ".self_attention.linear_qkv.layer_norm_"),
    (".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_"),
)


class ConversionError(ValueError):
    """A checkpoint does not match the weight map (missing, unexpected or inconsistent tensors)."""


def to_impl_name(name: str, impl: Impl) -> str:
    """Canonical (`local`) Megatron parameter name -> the name in `impl`."""
    if impl == "transformer_engine":
        for a, b in _TE_RENAMES:
            name = name.replace(a, b)
    return name


def _names(keys: Iterable[str], limit: int = 12) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _own(t: Tensor) -> Tensor:
    """A tensor that owns exactly its bytes (a view would make torch.save write the whole base)."""
    t = t.contiguous()
    return t.clone() if t.untyped_storage().nbytes() != t.nbytes else t


@dataclass
class Plan:
    """Everything the engine needs for one conversion."""

    family: ModelFamily
    hf_config: Any
    layout: Layout
    impl: Impl
    shapes: Shapes
    num_layers: int
    tied: bool
    mappings: list[Mapping]
    drops: list[Drop]

    num_experts: int = 0

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.layout.pp

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.layout.ep if self.num_experts else 0

    def placements(self, stages: Iterable[int] | None = None,
                   ep_ranks: Iterable[int] | None = None) -> Iterator[Placement]:
        """Where every Megatron tensor goes, for the given pipeline stages and expert-parallel ranks
        (default: all)."""
        wanted = set(range(self.layout.pp)) if stages is None else set(stages)
        experts_on = set(range(self.layout.ep)) if ep_ranks is None else set(ep_ranks)
        last = self.layout.pp - 1
        for m in self.mappings:
            if m.per_layer:
                ids, ep = {}, None
                if m.expert is not None:  # global expert -> (EP rank, number on that rank)
                    ep, ids["expert"] = divmod(m.expert, self.experts_per_rank)
                    if ep not in experts_on:
                        continue
                for layer in range(self.num_layers):
                    if m.layers is not None and layer not in m.layers:
                        continue  # e.g. expert tensors exist in mixture-of-experts layers only
                    stage, local = divmod(layer, self.layers_per_stage)
                    if stage in wanted:
                        if self.impl == "transformer_engine" and m.te_name:
                            name = m.te_name.format(layer=local, **ids)
                        else:
                            name = to_impl_name(m.megatron.format(layer=local, **ids), self.impl)
                        yield Placement(m, layer, stage, name, ep=ep)
                continue
            stage = 0 if m.megatron.startswith("embedding.") else last
            if stage in wanted:
                yield Placement(m, None, stage, to_impl_name(m.megatron, self.impl))
            if self.tied and last > 0 and last in wanted and m.megatron == "embedding.word_embeddings.weight":
                # tied embeddings with PP > 1: the last stage holds its own copy as the output layer
                yield Placement(m, None, last, "output_layer.weight", copy=True)

    def hf_names(self) -> set[str]:
        return {h for pl in self.placements() for h in pl.hf_names}

    def megatron_names(self, pp_rank: int, ep_rank: int = 0) -> set[str]:
        return {pl.name for pl in self.placements([pp_rank], [ep_rank])}

    def is_dropped(self, hf_name: str) -> bool:
        for d in self.drops:
            if "{layer}" not in d.hf:
                if d.hf == hf_name or (d.hf.endswith(".") and hf_name.startswith(d.hf)):
                    return True
            else:
                head, tail = d.hf.split("{layer}")
                mid = hf_name[len(head): len(hf_name) - len(tail)]
                if hf_name.startswith(head) and hf_name.endswith(tail) and mid.isdigit():
                    return True
        return False


def make_plan(hf_config: Any, layout: Layout = Layout(), impl: Impl = "local",
              family: ModelFamily | None = None, padded_vocab_size: int | None = None,
              num_query_groups: int | None = None) -> Plan:
    """The conversion plan for `hf_config` at `layout`. `padded_vocab_size` overrides the padding
    rule (a checkpoint's own embedding size wins over the rule it may have been made with), and
    `num_query_groups` the kv-head replication rule (a checkpoint made for a larger TP keeps its
    replicated heads)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    family = family or get_family(hf_config)
    shapes = family.shapes(hf_config, layout)  # checks the layout against the model (`Layout.check`)
    entries = family.weight_map(hf_config)
    arch = family.config_kwargs(hf_config)
    return Plan(
        family=family,
        hf_config=hf_config,
        layout=layout,
        impl=impl,
        shapes=_with_groups(_with_padding(shapes, padded_vocab_size), num_query_groups, layout),
        num_layers=int(arch["num_layers"]),
        num_experts=int(arch.get("num_moe_experts") or 0),
        tied=family.tied_embeddings(hf_config),
        mappings=[e for e in entries if isinstance(e, Mapping)],
        drops=[e for e in entries if isinstance(e, Drop)],
    )


def _with_padding(shapes: Shapes, padded_vocab_size: int | None) -> Shapes:
    if padded_vocab_size is None:
        return shapes
    if padded_vocab_size < shapes.vocab_size:
        raise ConversionError(f"embedding has {padded_vocab_size} rows, fewer than vocab_size {shapes.vocab_size}")
    return dataclasses.replace(shapes, padded_vocab_size=padded_vocab_size)


def _with_groups(shapes: Shapes, num_query_groups: int | None, layout: Layout) -> Shapes:
    if num_query_groups is None or num_query_groups == shapes.num_query_groups:
        return shapes
    if num_query_groups % shapes.hf_query_groups or num_query_groups % layout.tp:
        raise ConversionError(f"{num_query_groups} query groups: not a multiple of the {shapes.hf_query_groups} kv "
                              f"heads and of TP={layout.tp}")
    return dataclasses.replace(shapes, num_query_groups=num_query_groups)


def check_hf_keys(plan: Plan, hf_keys: Iterable[str]) -> None:
    """Every HF tensor is either mapped or explicitly dropped, and every mapped one exists."""
    hf_keys = set(hf_keys)
    wanted = plan.hf_names()
    missing = wanted - hf_keys
    unexpected = {k for k in hf_keys - wanted if not plan.is_dropped(k)}
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing HF tensors: {_names(missing)}")
        if unexpected:
            parts.append(f"HF tensors the {plan.family.name} weight map does not consume: {_names(unexpected)}")
        raise ConversionError("; ".join(parts))


def hf_to_megatron(plan: Plan, get: Callable[[str], Tensor], hf_keys: Iterable[str],
                   dtype: torch.dtype | None = None, stages: Iterable[int] | None = None,
                   expected: MappingABC[str, tuple[int, ...]] | None = None,
                   tp_ranks: Iterable[int] | None = None,
                   ep_ranks: Iterable[int] | None = None,
                   etp_rank: int | None = None, reader: Any = None) -> dict[Rank, dict[str, Tensor]]:
    """HF tensors (read by name through `get`) -> {(tp_rank, pp_rank, ep_rank): state dict} for
    `stages`, `tp_ranks` and `ep_ranks` (default all; an EP rank holds its own experts, numbered from 0,
    and the same copy of everything else). `expected` (canonical name -> unsharded shape, e.g. a meta
    TP=PP=1 model's) turns a tensor that does not fit the config into an error naming the HF tensor.
    Routed experts are split over ETP (`layout.etp`, default TP): with ETP != TP a process's expert shard
    is its expert-tensor-parallel rank (`etp_rank`), so that conversion is per process only.
    `reader` (with `shape(name)` and `get_slice(name, dim, start, stop)`, e.g. an `HFCheckpoint`), for one TP
    rank: each tensor the mapping can make from slices (`Mapping.read_plan`) is read as those slices only, so
    a rank reads about 1/TP of its stage; the others whole through `get`."""
    check_hf_keys(plan, hf_keys)
    split_experts = plan.layout.expert_tp != plan.layout.tp
    if split_experts and etp_rank is None:
        raise ConversionError(f"ETP={plan.layout.expert_tp} differs from TP={plan.layout.tp}: convert per process "
                              "(pass its etp_rank; --load-hf does) or write torch_dist, which megatron loads at any "
                              "layout")
    stages = list(range(plan.layout.pp)) if stages is None else list(stages)
    tp_ranks = list(range(plan.layout.tp)) if tp_ranks is None else list(tp_ranks)
    ep_ranks = list(range(plan.layout.ep)) if ep_ranks is None else list(ep_ranks)
    out: dict[Rank, dict[str, Tensor]] = {Rank(t, p, e): {} for t in tp_ranks for p in stages for e in ep_ranks}
    for pl in plan.placements(stages, ep_ranks):
        own_etp_shard = split_experts and pl.mapping.expert is not None
        if reader is not None and len(tp_ranks) == 1 and expected is None:
            mine = own_shard(plan, pl, reader, etp_rank if own_etp_shard else tp_ranks[0], dtype)
            if mine is not None:
                for e in ep_ranks if pl.ep is None else [pl.ep]:
                    out[(tp_ranks[0], pl.stage, e)][pl.name] = mine
                continue
        shards = megatron_shards(plan, pl, [get(h) for h in pl.hf_names], dtype, expected)
        for t in tp_ranks:
            shard = _own(shards[etp_rank if own_etp_shard else t])
            for e in ep_ranks if pl.ep is None else [pl.ep]:
                out[(t, pl.stage, e)][pl.name] = shard
    return out


def own_shard(plan: Plan, pl: Placement, reader: Any, shard: int, dtype: torch.dtype | None) -> Tensor | None:
    """One TP rank's tensor of a placement from slices of its HF tensors (`Mapping.read_plan`); None where
    the mapping needs them whole (then `megatron_shards`)."""
    m = pl.mapping
    if m.te_replicated and plan.impl == "transformer_engine":
        return None
    tp = plan.layout.expert_tp if m.expert is not None else plan.layout.tp
    shapes = [tuple(reader.shape(h)) for h in pl.hf_names]
    wanted = m.read_plan(shard, tp, plan.shapes, shapes)
    if wanted is None:
        return None
    parts = [[reader.get_slice(h, *cut) for cut in cuts] for h, cuts in zip(pl.hf_names, wanted)]
    try:
        t = m.from_parts(parts, shard, tp, plan.shapes, shapes)
    except (RuntimeError, ValueError) as e:
        described = ", ".join(f"{h} {s}" for h, s in zip(pl.hf_names, shapes))
        raise ConversionError(f"{described}: does not fit the {plan.family.name} config ({e})") from None
    return _own(t.to(dtype) if dtype is not None else t)


def megatron_shards(plan: Plan, pl: Placement, hf: list[Tensor], dtype: torch.dtype | None,
                    expected: MappingABC[str, tuple[int, ...]] | None = None) -> list[Tensor]:
    """One placement's HF tensors -> its per-TP-rank Megatron tensors (views: callers that keep a
    shard copy it out with `_own`)."""
    m = pl.mapping
    try:
        full = m.to_megatron(hf, plan.shapes)
        want = expected.get(pl.canonical) if expected is not None else None
        if want is not None and tuple(full.shape) != tuple(want):
            raise ValueError(f"gives {pl.name} of shape {tuple(full.shape)}, the config needs {tuple(want)}")
    except (RuntimeError, ValueError) as e:
        shapes = ", ".join(f"{h} {tuple(t.shape)}" for h, t in zip(pl.hf_names, hf))
        raise ConversionError(f"{shapes}: does not fit the {plan.family.name} config ({e})") from None
    if dtype is not None:
        full = full.to(dtype)
    if m.te_replicated and plan.impl == "transformer_engine":
        return [full] * plan.layout.tp
    return m.shard(full, plan.layout.expert_tp if m.expert is not None else plan.layout.tp, plan.shapes)


def check_megatron_keys(plan: Plan, state_dicts: MappingABC[Rank, MappingABC[str, Tensor]]) -> None:
    """Each rank's parameters are exactly the plan's (TE `_extra_state` entries are not weights)."""
    for (t, p, e), sd in state_dicts.items():
        have = {k for k in sd if not k.endswith("._extra_state")}
        want = plan.megatron_names(p, e)
        if have != want:
            parts = [f"rank tp={t} pp={p}" + (f" ep={e}" if plan.layout.ep > 1 else "")]
            if want - have:
                parts.append(f"missing Megatron parameters: {_names(want - have)}")
            if have - want:
                parts.append(f"unexpected Megatron parameters: {_names(have - want)}")
            raise ConversionError("; ".join(parts))


def megatron_to_hf(plan: Plan, state_dicts: MappingABC[Rank, MappingABC[str, Tensor]],
                   dtype: torch.dtype | None = None, stages: Iterable[int] | None = None) -> dict[str, Tensor]:
    """{(tp_rank, pp_rank, ep_rank): state dict} for `stages` (default all) -> those stages' HF tensors.
    Strict: every rank's parameters are used."""
    stages = list(range(plan.layout.pp)) if stages is None else list(stages)
    if plan.layout.expert_tp != plan.layout.tp:
        raise ConversionError("ETP != TP: per-rank state dicts cannot be reassembled here; export a torch_dist "
                              "checkpoint (megatron.training's --ckpt-format torch_dist)")
    absent = [(t, p, e) for p in stages for t in range(plan.layout.tp) for e in range(plan.layout.ep)
              if (t, p, e) not in state_dicts]
    if absent:
        raise ConversionError(f"missing state dicts for (tp_rank, pp_rank, ep_rank) {absent}")
    check_megatron_keys(plan, {r: sd for r, sd in state_dicts.items() if r[1] in stages})
    return placements_to_hf(plan, plan.placements(stages), state_dicts, dtype)


def placements_to_hf(plan: Plan, placements: Iterable[Placement],
                     state_dicts: MappingABC[Rank, MappingABC[str, Tensor]],
                     dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The HF tensors of some placements (no completeness check: callers stream a checkpoint)."""
    out: dict[str, Tensor] = {}
    for pl in placements:
        if pl.copy:
            continue
        m = pl.mapping
        ep = pl.ep or 0  # a tensor every EP rank holds is read from EP rank 0
        shards = [state_dicts[(t, pl.stage, ep)][pl.name] for t in range(plan.layout.tp)]
        if m.te_replicated and plan.impl == "transformer_engine":
            full = Replicated.unshard(m, shards, plan.shapes)
        else:
            full = m.unshard(shards, plan.shapes)
        for h, tensor in zip(pl.hf_names, m.to_hf(full, plan.shapes)):
            out[h] = _own(tensor.to(dtype) if dtype is not None else tensor)
    return out


def extra_state_names(plan: Plan, stage: int) -> set[str]:
    """The `_extra_state` entries a stage's `state_dict()` holds (strict loading wants them): every
    linear layer keeps one (megatron-core's own linears too, for TE compatibility), the last stage's
    output layer included (also when its weight is tied); Transformer Engine adds one per core
    attention and one per norm it does not fuse into a linear (final, q/k and post-sublayer norms).
    Checked against real models in tests/e2e/test_formats.py (local) and tests/gpu/ (TE, on the device)."""
    names = {n.rsplit(".", 1)[0] + "._extra_state" for n in plan.megatron_names(stage)
             if n.startswith("decoder.layers.") and ".linear_" in n}
    if stage == plan.layout.pp - 1:
        names.add("output_layer._extra_state")
    if plan.impl == "transformer_engine":
        for layer in range(plan.layers_per_stage):
            names.add(f"decoder.layers.{layer}.self_attention.core_attention._extra_state")
        # TE norms not fused into a linear: final, q/k (qk_layernorm) and post-sublayer norms
        names |= {n.rsplit(".", 1)[0] + "._extra_state" for n in plan.megatron_names(stage)
                  if n.endswith("layernorm.weight")}
    return names


def load_hf_into_rank(model: torch.nn.Module, plan: Plan, get: Callable[[str], Tensor], hf_keys: Iterable[str],
                      dtype: torch.dtype | None = None, keep: Iterable[str] = (), reader: Any = None,
                      stage: int | None = None) -> None:
    """Fill this process's part of a freshly built model from HF tensors (read by name through `get`):
    only its pipeline stage's tensors are read, and it keeps its TP / EP (expert TP) slice. `keep`: Megatron
    names whose values the model keeps (a reward head that starts fresh on a causal LM's backbone).
    `reader`: read only this TP rank's slices where the mapping allows (`hf_to_megatron`). `stage`: the
    plan's stage the model is (default this rank's pipeline stage; a virtual pipeline's chunk: its virtual
    stage in a plan made at PP x VPP stages)."""
    from megatron_patch.runtime.parallel import current_etp_rank, current_rank

    rank = current_rank()
    if stage is not None:
        rank = rank._replace(pp=stage)
    state = hf_to_megatron(plan, get, hf_keys, dtype, stages=[rank.pp], tp_ranks=[rank.tp], ep_ranks=[rank.ep],
                           etp_rank=current_etp_rank(), reader=reader)[rank]
    if getattr(model, "hybrid_layer_pattern", None) is not None:  # a HybridModel (models/hybrid.py)
        from megatron_patch.models.hybrid import to_hybrid_names

        state = to_hybrid_names(state)
    own = model.state_dict()
    for name in keep:
        state.pop(name, None)
        if name in own:
            state[name] = own[name]
    load_rank_state_dict(model, state)


def load_rank_state_dict(model: torch.nn.Module, state_dict: MappingABC[str, Tensor]) -> None:
    """Load one rank's converted weights into its model. Strict on parameters; only Transformer
    Engine's `_extra_state` (FP8 scaling metadata, not weights) may be absent."""
    result = model.load_state_dict(state_dict, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise ConversionError(
            f"state dict does not fit the model: missing {_names(missing) or 'none'}; "
            f"unexpected {_names(result.unexpected_keys) or 'none'}"
        )
