"""Adapters in HF terms: our canonical adapter tensors (`decoder.layers.7.self_attention.linear_qkv.lora_A.q_proj`,
whole, HF layout) <-> a PEFT LoRA folder (`adapter_config.json`, `adapter_model.safetensors` with
`base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight`), and the merged HF weights
(`W_s + alpha / r * B_s @ A_s`). The HF module of each adapter comes from the family's weight map, the one
the converter uses. Since a fused megatron linear carries one (A, B) pair per HF module (`adapters.py`),
both directions are exact copies.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_patch.lora.adapters import PREFIX_A, PREFIX_B, TARGETS, LoRAError

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(decoder\.layers\.(\d+)\.(.+))\.(lora_A|lora_B)\.([^.]+)$")


@dataclass(frozen=True)
class Adapter:
    """An adapter in HF terms: {HF module path: (A [r, in], B [out, r])}, rank and alpha."""

    modules: dict[str, tuple[Tensor, Tensor]]
    rank: int
    alpha: float
    dropout: float = 0.0
    base_model: str | None = None  # the PEFT config's base_model_name_or_path: the model it was made for

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _weight_mappings(plan) -> dict[str, list]:
    from megatron_patch.models.mappings import Mapping

    out: dict[str, list] = {}
    for m in plan.mappings:
        if isinstance(m, Mapping) and m.expert is None and m.per_layer and m.megatron.endswith(".weight"):
            out.setdefault(m.megatron, []).append(m)
    return out


def hf_modules(plan, canonical: str, layer: int) -> list[str]:
    """The HF modules a megatron linear (`decoder.layers.7.mlp.linear_fc1`) fuses, in weight-map order."""
    template = re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.{layer}.", canonical) + ".weight"
    maps = [m for m in _weight_mappings(plan).get(template, []) if m.layers is None or layer in m.layers]
    if len(maps) != 1:
        raise LoRAError(f"{canonical}: no single entry of the {plan.family.name} weight map")
    return [h[: -len(".weight")] for h in maps[0].names(layer)[1]]


def to_peft(tensors: dict[str, Tensor], plan, rank: int, alpha: float, dropout: float = 0.0) -> Adapter:
    """Canonical adapter tensors -> HF modules."""
    modules: dict[str, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if not m:
            raise LoRAError(f"{key} is not an adapter tensor name")
        canonical, layer, factor, name = m.group(1), int(m.group(2)), m.group(4), m.group(5)
        hf = [h for h in hf_modules(plan, canonical, layer) if h.rsplit(".", 1)[-1] == name]
        if len(hf) != 1:
            raise LoRAError(f"{key}: {name} is not one of the HF modules of {canonical}")
        modules.setdefault(hf[0], {})[factor] = t
    bad = [h for h, f in modules.items() if set(f) != {PREFIX_A, PREFIX_B}]
    if bad:
        raise LoRAError(f"adapter of {bad[0]} lacks its {PREFIX_A if PREFIX_A not in modules[bad[0]] else PREFIX_B}")
    return Adapter({h: (f[PREFIX_A], f[PREFIX_B]) for h, f in modules.items()}, rank, alpha, dropout)


def _megatron_index(plan) -> dict[str, tuple[str, str]]:
    """HF module path -> (canonical megatron linear, slice name), for the targetable linears of every layer."""
    out = {}
    for template, maps in _weight_mappings(plan).items():
        leaf = template[: -len(".weight")].rsplit(".", 1)[-1]
        if leaf not in TARGETS or ".experts." in template:
            continue
        for m in maps:
            for layer in range(plan.num_layers):
                if m.layers is not None and layer not in m.layers:
                    continue
                canonical = m.names(layer)[0][: -len(".weight")]
                for h in m.names(layer)[1]:
                    module = h[: -len(".weight")]
                    out[module] = (canonical, module.rsplit(".", 1)[-1])
    return out


def from_peft(adapter: Adapter, plan) -> dict[str, Tensor]:
    """HF modules -> canonical adapter tensors. A module that is no adapted linear of this model is an error."""
    index = _megatron_index(plan)
    out = {}
    for module, (a, b) in adapter.modules.items():
        if module not in index:
            raise LoRAError(f"the adapter's module {module} is not a linear LoRA can adapt in this {plan.family.name} "
                            "model (an adapter for another base model?)")
        canonical, name = index[module]
        out[f"{canonical}.{PREFIX_A}.{name}"], out[f"{canonical}.{PREFIX_B}.{name}"] = a, b
    return out


def megatron_targets(adapter: Adapter, plan) -> tuple[tuple[str, ...], frozenset[str]]:
    """(megatron targets, HF module names) an imported adapter covers. LoRA adapts an HF module name (q_proj)
    wherever the model has it: an adapter on some of those modules only (PEFT's target_modules as a regex
    naming some layers, or layers_to_transform) is refused, naming an HF module it lacks."""
    index = _megatron_index(plan)
    names = {index[m][1] for m in adapter.modules if m in index}
    lacking = sorted((m for m, (_, name) in index.items() if name in names and m not in adapter.modules),
                     key=_natural)
    if lacking:
        name = index[lacking[0]][1]
        has = sorted((m for m in adapter.modules if m in index and index[m][1] == name), key=_natural)
        raise LoRAError(f"the adapter has {has[0]} but not {lacking[0]}: LoRA here adapts {name} in every layer "
                        f"that has it (an adapter on some layers only, from a target_modules regex or "
                        f"layers_to_transform, is not supported)")
    targets = {index[m][0].rsplit(".", 1)[-1] for m in adapter.modules if m in index}
    return tuple(t for t in TARGETS if t in targets), frozenset(names)


def _natural(name: str) -> list:
    """Sort key: layer numbers as numbers (layers.2 before layers.10)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _peft_selects(targets: list[str], modules) -> set[str]:
    """The modules that a list `target_modules` selects in PEFT: a path equal to a target or ending in `.target`."""
    return {m for m in modules if any(m == t or m.endswith(f".{t}") for t in targets)}


def _target_modules(modules: list[str], plan) -> list[str]:
    """PEFT's `target_modules`, always a list (PEFT's suffix match), the first of these that selects exactly these
    modules of the HF model: their last names (`q_proj`); their paths inside a layer (`self_attn.q_proj`,
    `mlp.shared_expert.down_proj`: an MoE model, where last names would also select the routed experts); their
    full paths (an adapter on some layers only).

    Never a regex, nor a last name beside routed experts: loading an adapter on transformers 5, peft 0.22
    (`peft/utils/transformers_weight_conversion.py`, `_convert_peft_config_moe`, for Qwen2-MoE and the models
    transformers converts like it: DeepSeek-V3, Qwen3-MoE, ...) turns a regex into the last names it matches, and
    a target whose suffix, renamed (`gate_proj` / `up_proj` -> `gate_up_proj`), is also a fused expert parameter's
    (`down_proj`: `mlp.experts.down_proj`) into a `target_parameters` entry too: LoRA on the routed experts that
    the adapter does not have. A path inside a layer keeps its parent (`mlp.`, `shared_expert.`), which the
    experts' fused parameters do not end in. (peft 0.21 converts every target ending in gate_proj / up_proj /
    down_proj of DeepSeek-V3, Qwen3-MoE, ... into the experts' parameters, whatever the list says.)"""
    # the modules, and parameters that are no module's weight (experts stored fused: `mlp.experts.down_proj`)
    all_modules = {h[: -len(".weight")] if h.endswith(".weight") else h for h in plan.hf_names()
                   if not h.endswith(".bias")}
    wanted = set(modules)
    leaves = sorted({m.rsplit(".", 1)[-1] for m in modules})
    if _peft_selects(leaves, all_modules) == wanted:
        return leaves
    in_layer = sorted({re.sub(r"^.*?\.\d+\.", "", m) for m in modules})
    if _peft_selects(in_layer, all_modules) == wanted:
        return in_layer
    return sorted(modules, key=_natural)


def write_peft(out: str, adapter: Adapter, plan, base_model: str | None = None, overwrite: bool = False) -> dict:
    """A PEFT LoRA folder that `peft.PeftModel.from_pretrained(base, out)` loads (atomic; every tensor checked for
    NaN / Inf and listed with its CRC in tensors.json, as everything the converter writes)."""
    from safetensors.torch import save_file

    from megatron_patch.conversion.manifest import TensorLog
    from megatron_patch.outputs import atomic_output_dir, check_output

    check_output(out, overwrite)
    modules = sorted(adapter.modules)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": adapter.rank, "lora_alpha": adapter.alpha, "lora_dropout": adapter.dropout,
        "target_modules": _target_modules(modules, plan), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "inference_mode": True,
    }
    tensors, log = {}, TensorLog()
    for m in modules:
        for side, t in zip((PREFIX_A, PREFIX_B), adapter.modules[m]):
            name = f"{PEFT_PREFIX}{m}.{side}.weight"
            tensors[name] = log.add(name, t.detach().contiguous())
    with atomic_output_dir(out, overwrite) as tmp:
        save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        log.write(tmp)
        with open(os.path.join(tmp, CONFIG), "w") as f:
            json.dump(config, f, indent=2)
    return {"peft": os.path.abspath(out), "modules": len(modules), "rank": adapter.rank, "alpha": adapter.alpha}


def read_peft(folder: str) -> Adapter:
    """A PEFT LoRA folder -> Adapter. Refused (one clear error each): not LoRA, DoRA, per-module ranks or
    alphas, trained biases or extra full modules, `fan_in_fan_out`, layer selection."""
    from safetensors.torch import load_file

    path = os.path.join(folder, CONFIG)
    if not os.path.isfile(path):
        raise LoRAError(f"{folder} is not a PEFT adapter folder (no {CONFIG})")
    with open(path) as f:
        config = json.load(f)
    r, alpha = config.get("r"), config.get("lora_alpha")
    refusals = [
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')} (only LORA)"),
        (not isinstance(r, int) or r <= 0, f"rank r={r}"),
        (bool(config.get("use_dora")), "DoRA (use_dora)"),
        (bool(config.get("rank_pattern")) or bool(config.get("alpha_pattern")), "per-module ranks or alphas"),
        (config.get("bias", "none") != "none", f"trained biases (bias={config.get('bias')})"),
        (bool(config.get("modules_to_save")), "modules_to_save"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out"),
        (bool(config.get("lora_bias")), "lora_bias=True (a trained bias on lora_B)"),
        (config.get("layers_to_transform") is not None, "layers_to_transform"),
    ]
    for bad, what in refusals:
        if bad:
            raise LoRAError(f"{folder}: {what} is not supported")
    if config.get("use_rslora"):  # scaling alpha / sqrt(r) == alpha' / r
        alpha = alpha * r**0.5
    files = [os.path.join(folder, n) for n in (WEIGHTS, "adapter_model.bin") if os.path.isfile(os.path.join(folder, n))]
    if not files:
        raise LoRAError(f"{folder}: no {WEIGHTS}")
    raw = load_file(files[0]) if files[0].endswith(".safetensors") else torch.load(files[0], weights_only=True)
    modules: dict[str, dict[str, Tensor]] = {}
    for key, t in raw.items():
        m = re.match(r"^(?:base_model\.model\.)?(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight$", key)
        if not m:
            raise LoRAError(f"{folder}: unexpected tensor {key}")
        modules.setdefault(m.group(1), {})[m.group(2)] = t.float()
    for module, f in modules.items():
        if set(f) != {PREFIX_A, PREFIX_B}:
            raise LoRAError(f"{folder}: {module} lacks lora_A or lora_B")
        if f[PREFIX_A].shape[0] != r or f[PREFIX_B].shape[1] != r:
            raise LoRAError(f"{folder}: {module} has rank {f[PREFIX_A].shape[0]}, the config says r={r}")
    return Adapter({m: (f[PREFIX_A], f[PREFIX_B]) for m, f in modules.items()}, r, float(alpha),
                   float(config.get("lora_dropout") or 0.0), config.get("base_model_name_or_path") or None)


# config.json keys that state an architecture's sizes and counts (hidden_size, num_attention_heads, head_dim,
# vocab_size, n_routed_experts, ...): two models that differ in one are different models
_ARCHITECTURE_KEY = re.compile(r"^(model_type|num_\w+|n_\w+|\w+_(size|dim|heads|layers|experts))$")


def _architecture(config: dict) -> dict:
    return {k: v for k, v in config.items()
            if _ARCHITECTURE_KEY.match(k) and isinstance(v, (int, str)) and not isinstance(v, bool)}


def check_base(adapter: str, made_for: str | None, base: str, made_for_config: dict | None = None) -> None:
    """An adapter (`adapter`: its folder or checkpoint, named in messages) made for `made_for` (a PEFT config's
    base_model_name_or_path, a LoRA run's --load-hf), applied to the HF folder `base`. Refused when the model it
    was made for has another architecture than `base` (`made_for_config`, or `made_for`'s config.json when it is
    a folder here; the first differing size or count is named), though every adapted shape may fit; a warning
    on stderr when `made_for` is a name that cannot be read here (a hub id) and not `base`'s folder name."""
    import sys

    from megatron_patch.models import load_hf_config

    if not made_for or os.path.realpath(made_for) == os.path.realpath(base):
        return
    if made_for_config is None and os.path.isfile(os.path.join(made_for, "config.json")):
        made_for_config = load_hf_config(made_for)
    if made_for_config is not None:
        theirs, ours = _architecture(made_for_config), _architecture(load_hf_config(base))
        diff = [k for k in sorted(theirs) if k in ours and theirs[k] != ours[k]]
        if diff:
            k = diff[0]
            raise LoRAError(f"{adapter} was made for {made_for} ({k} {theirs[k]}), not for the base {base} ({k} "
                            f"{ours[k]}): an adapter for another model")
        return
    if os.path.basename(made_for.rstrip("/")) != os.path.basename(os.path.realpath(base)):
        print(f"warning: {adapter} was made for {made_for} (base_model_name_or_path); it is applied to {base}: its "
              "shapes fit, but check that this is the model it was trained on", file=sys.stderr)


def merge_into(hf_get, hf_keys: list[str], adapter: Adapter) -> dict[str, Tensor]:
    """Base HF tensors (read by name) with every adapted weight merged: W + alpha / r * B @ A, computed in
    fp32 and stored in the base's dtype. A shape that does not fit the base is an error."""
    out = {}
    missing = [m for m in adapter.modules if f"{m}.weight" not in hf_keys]
    if missing:
        raise LoRAError(f"the base model has no {missing[0]}.weight (an adapter for another base model?)")
    for name in hf_keys:
        out[name] = merged(name, hf_get(name), adapter)
    return out


def merged(name: str, w: Tensor, adapter: Adapter) -> Tensor:
    """The HF tensor `name` with its adapter merged (W + alpha / r * B @ A in fp32, stored in W's dtype), or as
    it is when the adapter has no module for it."""
    module = name[: -len(".weight")] if name.endswith(".weight") else None
    if module not in adapter.modules:
        return w
    a, b = adapter.modules[module]
    if tuple(w.shape) != (b.shape[0], a.shape[1]):
        raise LoRAError(f"{module}: adapter B @ A is {b.shape[0]}x{a.shape[1]}, the base weight "
                        f"{tuple(w.shape)} (an adapter for another base model?)")
    a, b = a.to(w.device), b.to(w.device)
    return (w.float() + adapter.scaling * (b.float() @ a.float())).to(w.dtype)


def read_checkpoint_adapter(step_dir: str) -> dict[str, Tensor]:
    """The adapter tensors of a torch_dist checkpoint written by a LoRA run, whole and keyed canonically
    (layers stacked under one key are split by their global index)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(step_dir)
    meta = reader.read_metadata().state_dict_metadata
    keys = [k for k in meta if k.startswith("decoder.") and (f".{PREFIX_A}." in k or f".{PREFIX_B}." in k)
            and hasattr(meta[k], "size")]
    if not keys:
        raise LoRAError(f"{step_dir} holds no LoRA adapter (not a checkpoint of a --lora-rank run)")
    state = {k: torch.empty(tuple(meta[k].size), dtype=meta[k].properties.dtype) for k in keys}
    dcp.load(state, storage_reader=reader, no_dist=True)
    out = {}
    for k, t in state.items():
        if re.match(r"^decoder\.layers\.\d+\.", k):
            out[k] = t.float()
        else:  # decoder.layers.<rest>: [num_layers, ...]
            rest = k[len("decoder.layers."):]
            for g in range(t.shape[0]):
                out[f"decoder.layers.{g}.{rest}"] = t[g].float().clone()
    return out

