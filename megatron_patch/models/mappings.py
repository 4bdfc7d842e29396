"""Declarative weight-map vocabulary shared by every model family.

A family describes its checkpoint as a list of mapping ops, each tying one Megatron parameter
(canonical `local`-implementation name, `{layer}` standing for the global layer index) to the HF
tensor(s) it is made of. Each op defines both directions and how its Megatron tensor is split over
tensor parallelism, so HF -> Megatron -> HF is bitwise identical by construction. The conversion
engine (`megatron_patch.conversion.engine`) does all layer/stage/rank bookkeeping; ops only see
whole tensors and the TP size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class Shapes:
    """Architecture numbers the ops need (derived from the HF config by the family)."""

    num_heads: int
    num_query_groups: int  # megatron's (kv heads replicated up to TP when TP > the HF kv heads)
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    hf_query_groups: int | None = None  # the checkpoint's kv heads, when megatron replicates them

    @property
    def kv_replicas(self) -> int:
        return self.num_query_groups // (self.hf_query_groups or self.num_query_groups)


Slice = tuple[int, int, int]  # (dim, start, stop) of one HF tensor


def _block(shard: int, tp: int, n: int) -> tuple[int, int]:
    """Rank `shard`'s equal block of `n` rows split `tp` ways."""
    return shard * n // tp, (shard + 1) * n // tp


@dataclass(frozen=True)
class Mapping:
    """One Megatron parameter <- one or more HF tensors. Subclasses override the four transforms."""

    megatron: str
    hf: tuple[str, ...]
    # per-layer mappings: only these global layers (None: all), and the global index of the expert whose
    # tensor this is (its Megatron name has an `{expert}` slot for the index local to an expert-parallel
    # rank; the engine fills it); set with `on_layers`
    layers = None
    expert = None
    # Transformer Engine's name when it is not the rule's (`engine.to_impl_name`), and whether TE keeps the
    # tensor whole on every TP rank where megatron's own layer splits it (MLA's down projections)
    te_name = None
    te_replicated = False

    def to_megatron(self, hf: list[Tensor], s: Shapes) -> Tensor:
        """HF tensor(s) -> the unsharded (TP=1) Megatron tensor."""
        (t,) = hf
        return t

    def to_hf(self, full: Tensor, s: Shapes) -> list[Tensor]:
        return [full]

    def shard(self, full: Tensor, tp: int, s: Shapes) -> list[Tensor]:
        """Unsharded Megatron tensor -> one tensor per TP rank."""
        return [full] * tp

    def unshard(self, shards: list[Tensor], s: Shapes) -> Tensor:
        return shards[0]

    def read_plan(self, shard: int, tp: int, s: Shapes, hf_shapes: list[tuple[int, ...]]) -> list[list[Slice]] | None:
        """What TP rank `shard` of `tp` needs of each HF tensor (shapes `hf_shapes`) to make its tensor alone:
        per HF tensor, slices `(dim, start, stop)` read in that order (`from_parts` assembles them); None: the
        whole tensors are needed (then `shard` of `to_megatron`). Lets a rank read ~1/TP of a checkpoint."""
        return None

    def from_parts(self, parts: list[list[Tensor]], shard: int, tp: int, s: Shapes,
                   hf_shapes: list[tuple[int, ...]]) -> Tensor:
        """TP rank `shard`'s tensor from the slices `read_plan` named; equal to `shard(to_megatron(hf))[shard]`."""
        raise NotImplementedError

    def names(self, layer: int | None) -> tuple[str, tuple[str, ...]]:
        """(Megatron name, HF names) with the global layer (and expert) index."""
        if layer is None:
            return self.megatron, self.hf
        ids = {"layer": layer} if self.expert is None else {"layer": layer, "expert": self.expert}
        return self.megatron.format(**ids), tuple(h.format(layer=layer) for h in self.hf)

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.megatron


def on_layers(m: Mapping, layers=None, expert: int | None = None, te_name: str | None = None,
              te_replicated: bool = False) -> Mapping:
    """`m` with the per-layer attributes above (a frozen mapping: they are set once, here)."""
    object.__setattr__(m, "layers", None if layers is None else frozenset(layers))
    object.__setattr__(m, "expert", expert)
    object.__setattr__(m, "te_name", te_name)
    object.__setattr__(m, "te_replicated", te_replicated)
    return m


def _one(hf: str | tuple[str, ...]) -> tuple[str, ...]:
    return (hf,) if isinstance(hf, str) else tuple(hf)


class Replicated(Mapping):
    """Same tensor on every TP rank (norm weights, row-parallel biases)."""

    def __init__(self, hf: str, megatron: str):
        super().__init__(megatron, _one(hf))

    def unshard(self, shards: list[Tensor], s: Shapes) -> Tensor:
        for i, t in enumerate(shards[1:], 1):
            if not torch.equal(t, shards[0]):
                raise ValueError(f"{self.megatron}: replicated tensor differs between TP rank 0 and {i}")
        return shards[0]


@dataclass(frozen=True, init=False)
class Split(Mapping):
    """Split along `dim` over TP: dim 0 for column-parallel weights/biases, dim 1 for row-parallel."""

    dim: int = 0

    def __init__(self, hf: str, megatron: str, dim: int):
        object.__setattr__(self, "megatron", megatron)
        object.__setattr__(self, "hf", _one(hf))
        object.__setattr__(self, "dim", dim)

    def shard(self, full: Tensor, tp: int, s: Shapes) -> list[Tensor]:
        if full.shape[self.dim] % tp:
            raise ValueError(f"{self.megatron}: dim {self.dim} of {tuple(full.shape)} not divisible by TP={tp}")
        return list(torch.chunk(full, tp, dim=self.dim))

    def unshard(self, shards: list[Tensor], s: Shapes) -> Tensor:
        return torch.cat(shards, dim=self.dim)

    def read_plan(self, shard, tp, s, hf_shapes):
        if type(self) is not Split or hf_shapes[0][self.dim] % tp:  # (not divisible: the whole path's error)
            return None
        return [[(self.dim, *_block(shard, tp, hf_shapes[0][self.dim]))]]

    def from_parts(self, parts, shard, tp, s, hf_shapes):
        return parts[0][0]


def ColumnParallel(hf: str, megatron: str) -> Split:
    return Split(hf, megatron, dim=0)


def RowParallel(hf: str, megatron: str) -> Split:
    return Split(hf, megatron, dim=1)


class VocabParallel(Split):
    """Embedding / output rows: padded to `padded_vocab_size` with zero rows, then split over TP."""

    def __init__(self, hf: str, megatron: str):
        super().__init__(hf, megatron, dim=0)

    def to_megatron(self, hf: list[Tensor], s: Shapes) -> Tensor:
        (t,) = hf
        if t.shape[0] != s.vocab_size:
            raise ValueError(f"{self.hf[0]}: {t.shape[0]} rows but the config's vocab_size is {s.vocab_size}")
        pad = s.padded_vocab_size - s.vocab_size
        return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t

    def to_hf(self, full: Tensor, s: Shapes) -> list[Tensor]:
        return [full[: s.vocab_size]]

    def read_plan(self, shard, tp, s, hf_shapes):
        if hf_shapes[0][0] != s.vocab_size or s.padded_vocab_size % tp:
            return None
        start, stop = _block(shard, tp, s.padded_vocab_size)
        start = min(start, s.vocab_size)  # a rank holding padding only reads no row (its dtype and width)
        return [[(0, start, min(stop, s.vocab_size))]]

    def from_parts(self, parts, shard, tp, s, hf_shapes):
        start, stop = _block(shard, tp, s.padded_vocab_size)
        real = parts[0][0]
        pad = max(0, stop - max(start, s.vocab_size))
        return torch.cat([real, real.new_zeros((pad, *real.shape[1:]))]) if pad else real


class QKV(Split):
    """q|k|v projections -> Megatron's fused `linear_qkv`, interleaved per query group:
    [q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]. TP takes whole groups.

    When megatron has more query groups than the checkpoint has kv heads (one kv head split over TP=2:
    `Shapes.kv_replicas` > 1), each kv head is repeated for its consecutive groups; back to HF, the
    copies must still be equal (they are unless trained apart) and one is kept."""

    def __init__(self, q: str, k: str, v: str, megatron: str):
        Split.__init__(self, (q, k, v), megatron, dim=0)

    def _from_qkv(self, q: Tensor, k: Tensor, v: Tensor, s: Shapes) -> Tensor:
        g, d, r = s.num_query_groups, s.head_dim, s.kv_replicas
        rest = q.shape[1:]
        kv = [t.reshape(g // r, d, *rest).repeat_interleave(r, dim=0) for t in (k, v)]
        return torch.cat([q.reshape(g, -1, *rest), *kv], dim=1).reshape(-1, *rest)

    def _to_qkv(self, full: Tensor, s: Shapes) -> list[Tensor]:
        g, d, r = s.num_query_groups, s.head_dim, s.kv_replicas
        per_group_q = s.num_heads // g * d
        rest = full.shape[1:]
        grouped = full.reshape(g, per_group_q + 2 * d, *rest)
        q, k, v = torch.split(grouped, [per_group_q, d, d], dim=1)
        if r > 1:
            kept = []
            for t in (k, v):
                copies = t.reshape(g // r, r, d, *rest)
                if not all(torch.equal(copies[:, 0], copies[:, i]) for i in range(1, r)):
                    raise ValueError(
                        f"{self.megatron}: the {r} copies of each kv head (replicated to split "
                        f"{g // r} kv heads over TP) differ, e.g. after training at that TP; the HF "
                        "architecture holds one copy")
                kept.append(copies[:, 0])
            k, v = kept
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]

    def to_megatron(self, hf: list[Tensor], s: Shapes) -> Tensor:
        return self._from_qkv(*hf, s)

    def to_hf(self, full: Tensor, s: Shapes) -> list[Tensor]:
        return self._to_qkv(full, s)

    def _rank_rows(self, shard: int, tp: int, s: Shapes) -> tuple[tuple[int, int], tuple[int, int], Shapes] | None:
        """(q rows, k / v rows, the rank's own Shapes) of TP rank `shard`'s whole query groups."""
        g, d, r = s.num_query_groups, s.head_dim, s.kv_replicas
        if g % tp or s.num_heads % g:
            return None
        first, last = shard * g // tp, (shard + 1) * g // tp - 1
        kv_first, kv_last = first // r, last // r
        groups, kv = g // tp, kv_last - kv_first + 1
        if groups % kv:
            return None
        per_group = s.num_heads // g * d
        local = dataclasses.replace(s, num_heads=s.num_heads // tp, num_query_groups=groups, hf_query_groups=kv)
        return (first * per_group, (last + 1) * per_group), (kv_first * d, (kv_last + 1) * d), local

    def read_plan(self, shard, tp, s, hf_shapes):
        rows = self._rank_rows(shard, tp, s)
        if rows is None:
            return None
        q, kv, _ = rows
        return [[(0, *q)], [(0, *kv)], [(0, *kv)]]

    def from_parts(self, parts, shard, tp, s, hf_shapes):
        return self._from_qkv(parts[0][0], parts[1][0], parts[2][0], self._rank_rows(shard, tp, s)[2])


class PackedQKV(QKV):
    """One HF tensor holding [all q heads; all k heads; all v heads] (Baichuan `W_pack`, Qwen-1
    `c_attn`, ChatGLM `query_key_value`) -> Megatron's per-group interleaved `linear_qkv`."""

    def __init__(self, packed: str, megatron: str):
        Split.__init__(self, packed, megatron, dim=0)

    def _sizes(self, s: Shapes) -> list[int]:
        kv = (s.hf_query_groups or s.num_query_groups) * s.head_dim
        return [s.num_heads * s.head_dim, kv, kv]

    def to_megatron(self, hf: list[Tensor], s: Shapes) -> Tensor:
        (t,) = hf
        if t.shape[0] != sum(self._sizes(s)):
            raise ValueError(f"{self.hf[0]}: {t.shape[0]} rows, expected q|k|v = {self._sizes(s)}")
        return self._from_qkv(*torch.split(t, self._sizes(s), dim=0), s)

    def to_hf(self, full: Tensor, s: Shapes) -> list[Tensor]:
        return [torch.cat(self._to_qkv(full, s), dim=0)]

    def read_plan(self, shard, tp, s, hf_shapes):
        rows = self._rank_rows(shard, tp, s)
        if rows is None or hf_shapes[0][0] != sum(self._sizes(s)):
            return None
        (q0, q1), (k0, k1), _ = rows
        nq, nkv = self._sizes(s)[:2]
        return [[(0, q0, q1), (0, nq + k0, nq + k1), (0, nq + nkv + k0, nq + nkv + k1)]]

    def from_parts(self, parts, shard, tp, s, hf_shapes):
        return self._from_qkv(*parts[0], self._rank_rows(shard, tp, s)[2])


class GroupedQKV(QKV):
    """One HF tensor already in megatron's per-group order, [q heads of group 0, k_0, v_0, ...] (Bloom,
    Falcon, InternLM2 `wqkv`, GPTBigCode MHA): copied, or regrouped when kv heads are replicated."""

    def __init__(self, grouped: str, megatron: str):
        Split.__init__(self, grouped, megatron, dim=0)

    def _hf_shapes(self, s: Shapes) -> Shapes:
        return dataclasses.replace(s, num_query_groups=s.hf_query_groups or s.num_query_groups, hf_query_groups=None)

    def to_megatron(self, hf: list[Tensor], s: Shapes) -> Tensor:
        (t,) = hf
        if s.kv_replicas == 1:
            return t
        return self._from_qkv(*self._to_qkv(t, self._hf_shapes(s)), s)

    def to_hf(self, full: Tensor, s: Shapes) -> list[Tensor]:
        if s.kv_replicas == 1:
            return [full]
        return [self._from_qkv(*self._to_qkv(full, s), self._hf_shapes(s))]

    def read_plan(self, shard, tp, s, hf_shapes):
        if s.kv_replicas != 1 or hf_shapes[0][0] % tp:  # already megatron's order: whole groups per rank
            return None
        return [[(0, *_block(shard, tp, hf_shapes[0][0]))]]

    def from_parts(self, parts, shard, tp, s, hf_shapes):
        return parts[0][0]


class GatedMLP(Mapping):
    """gate|up projections -> `linear_fc1`; each TP rank holds [gate shard; up shard]. With one HF
    name, that tensor already holds [gate; up] (GLM's `gate_up_proj`, ChatGLM's `dense_h_to_4h`)."""

    def __init__(self, gate: str, up: str | None, megatron: str):
        super().__init__(megatron, (gate,) if up is None else (gate, up))

    def to_megatron(self, hf: list[Tensor], s: Shapes) -> Tensor:
        return torch.cat(hf, dim=0)

    def to_hf(self, full: Tensor, s: Shapes) -> list[Tensor]:
        if len(self.hf) == 1:
            return [full]
        return [t.contiguous() for t in torch.chunk(full, 2, dim=0)]

    def shard(self, full: Tensor, tp: int, s: Shapes) -> list[Tensor]:
        gate, up = torch.chunk(full, 2, dim=0)
        if gate.shape[0] % tp:
            raise ValueError(f"{self.megatron}: FFN size {gate.shape[0]} not divisible by TP={tp}")
        return [torch.cat(p, dim=0) for p in zip(torch.chunk(gate, tp), torch.chunk(up, tp))]

    def unshard(self, shards: list[Tensor], s: Shapes) -> Tensor:
        halves = [torch.chunk(t, 2, dim=0) for t in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)

    def read_plan(self, shard, tp, s, hf_shapes):
        ffn = hf_shapes[0][0] // (2 if len(self.hf) == 1 else 1)
        if ffn % tp or (len(self.hf) == 1 and hf_shapes[0][0] % 2) or len(set(hf_shapes)) != 1:
            return None
        start, stop = _block(shard, tp, ffn)
        if len(self.hf) == 1:  # [gate; up] in one tensor
            return [[(0, start, stop), (0, ffn + start, ffn + stop)]]
        return [[(0, start, stop)], [(0, start, stop)]]

    def from_parts(self, parts, shard, tp, s, hf_shapes):
        return torch.cat([t for ts in parts for t in ts], dim=0)


@dataclass(frozen=True)
class Drop:
    """An HF tensor that is deliberately not converted (e.g. rotary caches stored by old exports)."""

    hf: str
    reason: str = field(default="")
