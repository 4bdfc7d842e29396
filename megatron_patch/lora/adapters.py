"""LoRA adapters on a built megatron-core model: local (`ColumnParallelLinear` / `RowParallelLinear`) and
Transformer Engine (`TELayerNormColumnParallelLinear`, `TEColumnParallelLinear`, `TERowParallelLinear`)
linear layers, exact under tensor and pipeline parallelism.

One (A, B) pair per HF module ("slice"): a fused megatron linear carries one pair for each HF module the
family's weight map fuses into it (Llama's `linear_qkv` -> q_proj, k_proj, v_proj; a gated `linear_fc1` ->
gate_proj, up_proj; a packed HF module such as Falcon's `query_key_value` -> one pair). The adapted function
is therefore exactly PEFT's LoRA on those HF modules, `W_s + (alpha / r) B_s A_s`, and export / import are
exact copies. Forward: `h = dropout(x) @ [A_q; A_k; A_v]^T` (one GEMM), each slice's `B_s` on its rank-r
part of `h`, and the slices' rows placed in the fused layer's local output order. That order comes from the
weight map's own op (`Mapping.to_hf` / `Mapping.shard` applied to row numbers), so QKV's per-group
interleave, GatedMLP's per-rank [gate; up] and every family's fused layout are the converter's, not a copy.

Tensor parallelism (the adapted layer computes the same function at any TP):
- column-parallel: A replicated, B_s split by rows as the weight is (each rank keeps its rows of every
  slice, in HF order); `h` passes `copy_to_tensor_model_parallel_region` so A's gradient (and the input's
  through A) is summed over the TP ranks' rows.
- row-parallel: A split along its input columns as the weight is, `h` summed over TP
  (`reduce_from_tensor_model_parallel_region`), B replicated.
A and B are initialised from a generator seeded by (seed, layer, slice) in HF layout (A: PEFT's Kaiming-
uniform, B: zero), so every layout starts from the same adapter. Kept as parameters in HF layout, every
rank's B_s rows (column) or A columns (row) are a contiguous block of the HF tensor: checkpoints shard them
along that axis and reshard like the base weights.

Not adapted: routed MoE experts and the router (shared experts and dense MLPs are), MLA's q / kv
projections (`linear_proj` is), embeddings and the output layer. Refused: sequence parallelism, kv heads
replicated over TP, and Transformer Engine's fused MLP op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron_patch.lora.layout import LoRAError, Site, Slice, column_layout, row_layout

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ALL_LINEAR = "all-linear"
PREFIX_A, PREFIX_B = "lora_A", "lora_B"


@dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float | None = None  # default: rank (scaling 1)
    dropout: float = 0.0
    targets: tuple[str, ...] = (ALL_LINEAR,)
    seed: int = 0
    # only these HF modules (last names, e.g. q_proj, v_proj: an imported PEFT adapter's); None: every HF
    # module the targeted linears fuse
    modules: frozenset[str] | None = None

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise LoRAError(f"LoRA rank must be a positive integer, got {self.rank}")
        if self.alpha is not None and not (math.isfinite(self.alpha) and self.alpha > 0):
            raise LoRAError(f"LoRA alpha must be a finite number > 0, got {self.alpha}")
        if not (0.0 <= self.dropout < 1.0):
            raise LoRAError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        # all-linear adapts those of the four a family has (MLA has no linear_qkv); named targets must exist
        object.__setattr__(self, "strict_targets", ALL_LINEAR not in (self.targets,) + tuple(self.targets))
        object.__setattr__(self, "targets", expand_targets(self.targets))

    @property
    def scaling(self) -> float:
        return (self.rank if self.alpha is None else self.alpha) / self.rank


def expand_targets(targets) -> tuple[str, ...]:
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if not targets:
        raise LoRAError(f"no LoRA target: name modules of {', '.join(TARGETS)} or {ALL_LINEAR}")
    out: list[str] = []
    for t in targets:
        if t == ALL_LINEAR:
            out += [x for x in TARGETS if x not in out]
        elif t in TARGETS:
            out += [t] if t not in out else []
        else:
            raise LoRAError(f"unknown LoRA target {t!r}: expected module names of {', '.join(TARGETS)} or "
                            f"{ALL_LINEAR}")
    return tuple(out)


def _pg_info() -> tuple[int, int, Any]:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_group())


def _mode(module: nn.Module) -> str | None:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    mode = getattr(module, "parallel_mode", None)  # Transformer Engine's linears
    return mode if mode in ("column", "row") else None


def init_slice(cfg: LoRAConfig, layer: int, slice_no: int, out: int, inp: int) -> tuple[Tensor, Tensor]:
    """(A [r, in], B [out, r]) in HF layout: PEFT's initialisation (A Kaiming-uniform with a = sqrt(5), B
    zero) from a generator seeded by the layer and slice, so every layout starts from the same adapter."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + layer * 101 + slice_no)
    bound = 1.0 / math.sqrt(inp)  # kaiming_uniform_(a=sqrt(5)) on [r, in]
    a = (torch.rand(cfg.rank, inp, generator=g, dtype=torch.float64) * 2 - 1) * bound
    return a.float(), torch.zeros(out, cfg.rank)


class LoRALinear:
    """Mixed into the class of an adapted linear (its class is narrowed, so its parameter names, its base
    forward and its checkpoint sharding stay megatron-core's; `lora_A.<hf module>` and `lora_B.<hf module>`
    are added). Megatron's linear forward returns (output, bias); the adapter adds to the output."""

    lora_site: Site

    def forward(self, x, *args, **kwargs):
        if self.lora_norm_fused:  # TE's LayerNormLinear: the adapter reads the normalised input TE returns
            self.return_layernorm_output = True
            res = super().forward(x, *args, **kwargs)
            if self.te_return_bias:
                y, bias, lora_in = res
            else:
                (y, lora_in), bias = res
        else:
            (y, bias), lora_in = super().forward(x, *args, **kwargs), x
        return y + self.lora_delta(lora_in).to(y.dtype), bias

    def lora_delta(self, x: Tensor) -> Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        tp, _, group = _pg_info()
        names = [s.name for s in self.lora_site.slices]
        x = self.lora_dropout(x)
        if self.lora_site.mode == "row":
            h = F.linear(x, self.lora_A[names[0]].to(x.dtype))
            if tp > 1:
                h = reduce_from_tensor_model_parallel_region(h, group=group)
            return F.linear(h, self.lora_B[names[0]].to(x.dtype)) * self.lora_scaling
        a = torch.cat([self.lora_A[n] for n in names]) if len(names) > 1 else self.lora_A[names[0]]
        h = F.linear(x, a.to(x.dtype))
        if tp > 1:
            h = copy_to_tensor_model_parallel_region(h, group=group)
        r = self.lora_rank
        parts = [F.linear(h[..., i * r:(i + 1) * r], self.lora_B[n].to(x.dtype)) for i, n in enumerate(names)]
        d = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        if self.lora_order is not None:
            d = d.index_select(-1, self.lora_order)
        elif self.lora_positions is not None:  # some of the layer's rows have no adapter
            d = d.new_zeros(*d.shape[:-1], self.lora_out).index_copy(-1, self.lora_positions, d)
        return d * self.lora_scaling

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base layer's entries as megatron-core makes them, and the adapter's: B_s rows (column) or A
        columns (row) split over TP along the HF axis, the other factor replicated."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        own = lora_parameters(self)
        for k in own:
            out.pop(f"{prefix}{k}", None)
        axis = {k: (0 if k.startswith(PREFIX_B) else None) if self.lora_site.mode == "column"
                else (1 if k.startswith(PREFIX_A) else None) for k in own}
        _, _, group = _pg_info()
        dp = (metadata or {}).get("dp_cp_group")
        if dp is None:
            from megatron.core import parallel_state as ps

            dp = ps.get_data_parallel_group(with_context_parallel=True)
        out.update(make_sharded_tensors_for_checkpoint(own, prefix, {k: a for k, a in axis.items() if a is not None},
                                                       sharded_offsets, tp_group=group, dp_cp_group=dp))
        return out


def lora_parameters(module: nn.Module) -> dict[str, Tensor]:
    """An adapted linear's adapter parameters by state-dict key (lora_A.q_proj, ...)."""
    return {f"{p}.{n}": t for p in (PREFIX_A, PREFIX_B) for n, t in getattr(module, p).items()}


_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRALinear, cls), {"__module__": __name__})
    return _CLASSES[cls]


def is_adapter_key(name: str) -> bool:
    return f".{PREFIX_A}." in name or f".{PREFIX_B}." in name


def find_sites(model: nn.Module, hf_config: Any, cfg: LoRAConfig, plan) -> list[tuple[nn.Module, Site, Any]]:
    """The linears of this stage's model that `cfg.targets` name, each with its weight-map entry. A target
    that names no module of the whole model (all stages) is an error."""
    from megatron_patch.models.mappings import Mapping

    by_name = {}
    for m in plan.mappings:
        if isinstance(m, Mapping) and m.expert is None and m.per_layer and m.megatron.endswith(".weight"):
            by_name.setdefault(m.megatron, []).append(m)
    matched = {t: 0 for t in cfg.targets}
    for m_name in by_name:
        leaf = m_name[: -len(".weight")].rsplit(".", 1)[-1]
        if leaf in matched and ".experts." not in m_name:
            matched[leaf] += 1
    unmatched = [t for t, n in matched.items() if n == 0]
    if unmatched and (cfg.strict_targets or len(unmatched) == len(matched)):
        raise LoRAError(f"LoRA target {', '.join(unmatched)} matches no module of this {plan.family.name} model "
                        "(routed MoE experts and MLA's q/kv projections are not adapted)")
    sites = []
    decoder = getattr(model, "decoder", None)
    for i, layer in enumerate(getattr(decoder, "layers", [])):
        g = layer.layer_number - 1
        if type(getattr(layer, "mlp", None)).__name__ == "TEFusedMLP":
            raise LoRAError("LoRA cannot adapt Transformer Engine's fused MLP op "
                            "(--use-transformer-engine-op-fuser): turn it off")
        for path, module in layer.named_modules():
            leaf = path.rsplit(".", 1)[-1]
            if leaf not in cfg.targets or ".experts." in f".{path}.":
                continue
            mode = _mode(module)
            if mode is None:
                continue
            canonical = f"decoder.layers.{g}.{path}"
            template = f"decoder.layers.{{layer}}.{path}.weight"
            maps = [m for m in by_name.get(template, []) if m.layers is None or g in m.layers]
            if len(maps) != 1:
                raise LoRAError(f"{canonical}: the {plan.family.name} weight map has no single HF tensor for it")
            if getattr(module, "sequence_parallel", False):
                raise LoRAError("LoRA with --sequence-parallel is not supported yet")
            sites.append((module, Site(f"decoder.layers.{i}.{path}", canonical, g, mode), maps[0]))
    return sites


def apply_lora(model: nn.Module, hf_config: Any, cfg: LoRAConfig, plan) -> list[Site]:
    """Add adapters to this stage's model (after its base weights are loaded) and freeze everything else.
    `plan`: the conversion plan of the model's layout (`engine.make_plan`). Returns the adapted sites."""
    tp, tp_rank, _ = _pg_info()
    sites = []
    for module, site, mapping in find_sites(model, hf_config, cfg, plan):
        weight = module.weight
        if site.mode == "column":
            slices = column_layout(mapping, site.layer, plan.shapes, tp, weight.shape[0] * tp)[tp_rank]
            for s in slices:
                s.inp = weight.shape[1]
        else:
            slices = [row_layout(mapping, site.layer, plan.shapes, tp, weight.shape[1] * tp)[tp_rank]]
            slices[0].out = weight.shape[0]
        kept = [j for j, s in enumerate(slices) if cfg.modules is None or s.name in cfg.modules]
        if not kept:
            continue
        site.slices = [slices[j] for j in kept]
        _attach(module, site, cfg, [init_slice(cfg, site.layer, j, slices[j].out, slices[j].inp) for j in kept])
        sites.append(site)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_key(name))
    return sites


def _attach(module: nn.Module, site: Site, cfg: LoRAConfig, hf_pairs: list[tuple[Tensor, Tensor]]) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if isinstance(module, LoRALinear):
        raise LoRAError(f"{site.canonical} already has a LoRA adapter")
    w = module.weight
    module.__class__ = _lora_class(type(module))
    module.lora_site, module.lora_rank, module.lora_scaling = site, cfg.rank, cfg.scaling
    module.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()
    module.lora_norm_fused = hasattr(module, "return_layernorm_output")
    module.lora_A, module.lora_B = nn.ParameterDict(), nn.ParameterDict()
    for s, (a, b) in zip(site.slices, hf_pairs):
        a, b = local_factors(site.mode, s, a, b)
        module.lora_A[s.name] = nn.Parameter(a.to(device=w.device, dtype=w.dtype))
        module.lora_B[s.name] = nn.Parameter(b.to(device=w.device, dtype=w.dtype))
        if site.mode == "column":
            set_tensor_model_parallel_attributes(module.lora_B[s.name], True, 0, 1)
        else:
            set_tensor_model_parallel_attributes(module.lora_A[s.name], True, 1, 1)
    # index buffers (not saved), moved with the module: which output row each adapter row feeds
    order = positions = None
    module.lora_out = w.shape[0]
    if site.mode == "column":
        cat = torch.cat([s.positions for s in site.slices])
        if cat.numel() < w.shape[0]:
            positions = cat.to(w.device)
        elif not torch.equal(cat, torch.arange(w.shape[0])):
            order = torch.argsort(cat).to(w.device)
    module.register_buffer("lora_order", order, persistent=False)
    module.register_buffer("lora_positions", positions, persistent=False)


def local_factors(mode: str, s: Slice, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """This rank's (A, B) from the HF-layout pair."""
    if mode == "column":
        return a.clone(), b[s.index].clone()
    return a[:, s.index].clone(), b.clone()


def adapted_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def load_adapter(model: nn.Module, tensors: dict[str, Tensor]) -> set[str]:
    """Set this rank's adapters from HF-layout tensors keyed `<canonical>.lora_A.<name>` (global layer index,
    whole tensors: `peft.from_peft` or a checkpoint read). Every adapter of this stage must be there; returns
    the keys used (the caller checks that every key was used by some stage)."""
    used = set()
    for m in adapted_modules(model):
        site = m.lora_site
        for s in site.slices:
            ka, kb = f"{site.canonical}.{PREFIX_A}.{s.name}", f"{site.canonical}.{PREFIX_B}.{s.name}"
            if ka not in tensors or kb not in tensors:
                raise LoRAError(f"the adapter has no {ka if ka not in tensors else kb}")
            a, b = tensors[ka], tensors[kb]
            want_a, want_b = (m.lora_rank, s.inp), (s.out, m.lora_rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise LoRAError(f"{s.hf_module}: adapter shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit "
                                f"this model (A {want_a}, B {want_b} at rank {m.lora_rank}): an adapter for "
                                "another base model or rank")
            a, b = local_factors(site.mode, s, a, b)
            with torch.no_grad():
                m.lora_A[s.name].copy_(a)
                m.lora_B[s.name].copy_(b)
            used |= {ka, kb}
    return used


def adapter_tensors(model: nn.Module) -> dict[str, Tensor]:
    """HF-layout adapter tensors keyed `<canonical>.lora_A.<name>` from a TP=1 model (any pipeline stage)."""
    tp, _, _ = _pg_info()
    if tp != 1:
        raise LoRAError("adapter_tensors reads whole tensors from a TP=1 model; at TP > 1 read the checkpoint")
    out = {}
    for m in adapted_modules(model):
        for k, t in lora_parameters(m).items():
            out[f"{m.lora_site.canonical}.{k}"] = t.detach().float().clone()
    return out


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of this rank's model."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
