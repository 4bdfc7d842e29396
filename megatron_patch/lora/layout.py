"""Where a LoRA adapter's rows and columns live: for a megatron linear and its weight-map entry, each HF
module's rows (column-parallel) or input columns (row-parallel) on every TP rank, found by sending row
numbers through the entry's own op (`Mapping.to_hf`, `Mapping.shard`), so any fused layout the converter
knows is followed exactly."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


class LoRAError(ValueError):
    """A LoRA setting or adapter that does not fit the model."""


@dataclass
class Slice:
    """One HF module's adapter on a megatron linear, as seen from this TP rank."""

    name: str  # key in lora_A / lora_B: the HF module's last name (q_proj)
    hf_module: str  # full HF module path (model.layers.3.self_attn.q_proj)
    out: int  # HF output features
    inp: int  # HF input features
    index: Tensor | None = None  # column: this rank's HF rows; row: this rank's HF input columns (ascending)
    positions: Tensor | None = None  # column: where those rows sit in the layer's local output


@dataclass
class Site:
    """An adapted megatron linear: where it is and which HF modules it fuses."""

    path: str  # module path in the stage's model (decoder.layers.0.self_attention.linear_qkv)
    canonical: str  # global local-impl name without `.weight` (decoder.layers.7.self_attention.linear_qkv)
    layer: int  # global layer index
    mode: str  # column | row
    slices: list[Slice] = field(default_factory=list)


def _leaf(hf_weight: str) -> tuple[str, str]:
    if not hf_weight.endswith(".weight"):
        raise LoRAError(f"HF tensor {hf_weight} is not a linear weight")
    module = hf_weight[: -len(".weight")]
    return module.rsplit(".", 1)[-1], module


def column_layout(mapping, layer: int, shapes, tp: int, out_full: int) -> list[list[Slice]]:
    """Per TP rank, the slices of a column-parallel linear: each HF module's rows on that rank (ascending)
    and their positions in the rank's output, found by sending row numbers through the weight map's op."""
    rows = torch.arange(out_full).unsqueeze(1)
    try:
        hf_rows = mapping.to_hf(rows, shapes)
    except ValueError as e:
        raise LoRAError(f"{mapping.megatron}: LoRA cannot follow this layout ({e}); kv heads replicated over TP "
                        "(fewer kv heads than TP) are not supported: use a smaller TP") from None
    owner, hf_row = torch.full((out_full,), -1), torch.full((out_full,), -1)
    for s, part in enumerate(hf_rows):
        owner[part[:, 0]] = s
        hf_row[part[:, 0]] = torch.arange(part.shape[0])
    if (owner < 0).any() or sum(p.shape[0] for p in hf_rows) != out_full:
        raise LoRAError(f"{mapping.megatron}: the weight map's rows are not a permutation; LoRA cannot adapt it")
    names = mapping.names(layer)[1]
    layouts = []
    for t, shard in enumerate(mapping.shard(rows, tp, shapes)):
        local = shard[:, 0]
        slices = []
        for s, hf_weight in enumerate(names):
            leaf, module = _leaf(hf_weight)
            pos = torch.nonzero(owner[local] == s)[:, 0]
            order = torch.argsort(hf_row[local[pos]])
            index, pos = hf_row[local[pos]][order], pos[order]
            n = index.numel()
            if not torch.equal(index, torch.arange(t * n, (t + 1) * n)):
                raise LoRAError(f"{hf_weight}: its rows on TP rank {t} are not a contiguous block; LoRA on this "
                                f"packed layout needs TP=1")
            slices.append(Slice(leaf, module, hf_rows[s].shape[0], 0, index, pos))
        layouts.append(slices)
    return layouts


def row_layout(mapping, layer: int, shapes, tp: int, in_full: int) -> list[Slice]:
    """Per TP rank, the one slice of a row-parallel linear: the HF input columns the rank holds."""
    from megatron_patch.models.mappings import Split

    names = mapping.names(layer)[1]
    if not (isinstance(mapping, Split) and mapping.dim == 1 and len(names) == 1):
        raise LoRAError(f"{mapping.megatron}: LoRA expects a row-parallel weight map (one HF tensor split by columns)")
    leaf, module = _leaf(names[0])
    out = []
    for t, shard in enumerate(mapping.shard(torch.arange(in_full).unsqueeze(0), tp, shapes)):
        cols = shard[0]
        if not torch.equal(cols, torch.arange(t * cols.numel(), (t + 1) * cols.numel())):
            raise LoRAError(f"{names[0]}: TP rank {t}'s columns are not a contiguous block")
        out.append(Slice(leaf, module, 0, in_full, cols, None))
    return out
