"""The conversion engine: HF state dict <-> per-rank megatron-core state dicts, any TP x PP.

Family files declare *what* maps to what (`megatron_patch.models.mappings`); everything about
*where* a tensor goes lives here: global -> stage-local layer numbers, which pipeline stage holds
the embedding / final norm / output layer, TP sharding, vocab padding, the `local` <->
`transformer_engine` parameter naming, dtype, and the strict accounting of every key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping as MappingABC
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatron_patch.models.family import IMPLS, Impl, Layout, ModelFamily
from megatron_patch.models.mappings import Drop, Mapping, Shapes
from megatron_patch.models.registry import get_family

Rank = tuple[int, int]  # (tp_rank, pp_rank)

# Transformer Engine fuses the pre-attention / pre-MLP norms into the following linear layer.
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

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.layout.pp

    def stage_of(self, m: Mapping) -> list[int]:
        """Pipeline stages that hold a non-layer tensor."""
        if m.megatron.startswith("embedding."):
            return [0]
        return [self.layout.pp - 1]

    def placements(self) -> Iterable[tuple[Mapping, int | None, int, str]]:
        """(mapping, global layer or None, pp stage, stage-local Megatron name in `impl` naming)."""
        for m in self.mappings:
            if m.per_layer:
                for layer in range(self.num_layers):
                    stage, local = divmod(layer, self.layers_per_stage)
                    yield m, layer, stage, to_impl_name(m.megatron.format(layer=local), self.impl)
            else:
                for stage in self.stage_of(m):
                    yield m, None, stage, to_impl_name(m.megatron, self.impl)

    def hf_names(self) -> set[str]:
        return {h for m, layer, _, _ in self.placements() for h in m.names(layer)[1]}

    def megatron_names(self, pp_rank: int) -> set[str]:
        names = {name for _, _, stage, name in self.placements() if stage == pp_rank}
        if self.tied_output_on(pp_rank):
            names.add("output_layer.weight")
        return names

    def tied_output_on(self, pp_rank: int) -> bool:
        """With tied embeddings and PP > 1, the last stage keeps its own copy of the embedding."""
        return self.tied and self.layout.pp > 1 and pp_rank == self.layout.pp - 1

    def is_dropped(self, hf_name: str) -> bool:
        for d in self.drops:
            if "{layer}" not in d.hf:
                if d.hf == hf_name:
                    return True
            else:
                head, tail = d.hf.split("{layer}")
                mid = hf_name[len(head): len(hf_name) - len(tail)]
                if hf_name.startswith(head) and hf_name.endswith(tail) and mid.isdigit():
                    return True
        return False


def make_plan(hf_config: Any, layout: Layout = Layout(), impl: Impl = "local",
              family: ModelFamily | None = None) -> Plan:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    family = family or get_family(hf_config)
    family.check_layout(hf_config, layout)
    entries = family.weight_map(hf_config)
    return Plan(
        family=family,
        hf_config=hf_config,
        layout=layout,
        impl=impl,
        shapes=family.shapes(hf_config, layout),
        num_layers=int(family.config_kwargs(hf_config)["num_layers"]),
        tied=family.tied_embeddings(hf_config),
        mappings=[e for e in entries if isinstance(e, Mapping)],
        drops=[e for e in entries if isinstance(e, Drop)],
    )


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
                   dtype: torch.dtype | None = None) -> dict[Rank, dict[str, Tensor]]:
    """HF tensors (read by name through `get`) -> {(tp_rank, pp_rank): state dict}."""
    check_hf_keys(plan, hf_keys)
    tp, pp = plan.layout.tp, plan.layout.pp
    out: dict[Rank, dict[str, Tensor]] = {(t, p): {} for t in range(tp) for p in range(pp)}
    for m, layer, stage, name in plan.placements():
        shards = megatron_shards(plan, m, [get(h) for h in m.names(layer)[1]], dtype)
        for t, shard in enumerate(shards):
            out[(t, stage)][name] = shard
    if plan.tied and pp > 1:
        for t in range(tp):
            out[(t, pp - 1)]["output_layer.weight"] = out[(t, 0)]["embedding.word_embeddings.weight"]
    return out


def megatron_shards(plan: Plan, m: Mapping, hf: list[Tensor], dtype: torch.dtype | None) -> list[Tensor]:
    """One mapping's HF tensors -> its per-TP-rank Megatron tensors."""
    full = m.to_megatron(hf, plan.shapes)
    if dtype is not None:
        full = full.to(dtype)
    return [_own(s) for s in m.shard(full, plan.layout.tp, plan.shapes)]


def megatron_to_hf(plan: Plan, state_dicts: MappingABC[Rank, MappingABC[str, Tensor]],
                   dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """{(tp_rank, pp_rank): state dict} -> HF state dict. Strict: every rank's parameters are used."""
    tp, pp = plan.layout.tp, plan.layout.pp
    absent = [r for r in ((t, p) for t in range(tp) for p in range(pp)) if r not in state_dicts]
    if absent:
        raise ConversionError(f"missing state dicts for (tp_rank, pp_rank) {absent}")
    for (t, p), sd in state_dicts.items():
        have = {k for k in sd if not k.endswith("._extra_state")}
        want = plan.megatron_names(p)
        if have != want:
            parts = [f"rank tp={t} pp={p}"]
            if want - have:
                parts.append(f"missing Megatron parameters: {_names(want - have)}")
            if have - want:
                parts.append(f"unexpected Megatron parameters: {_names(have - want)}")
            raise ConversionError("; ".join(parts))
    out: dict[str, Tensor] = {}
    for m, layer, stage, name in plan.placements():
        full = m.unshard([state_dicts[(t, stage)][name] for t in range(tp)], plan.shapes)
        for h, tensor in zip(m.names(layer)[1], m.to_hf(full, plan.shapes)):
            out[h] = _own(tensor.to(dtype) if dtype is not None else tensor)
    return out


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
