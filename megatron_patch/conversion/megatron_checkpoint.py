"""Any Megatron checkpoint folder opened for reading — converted by megatron_patch or written by
megatron.training, torch_dist or legacy, at any stored layout — as HF tensors, and loaded into this rank's
model."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_patch.conversion.engine import (
    ConversionError,
    Placement,
    Plan,
    check_megatron_keys,
    load_hf_into_rank,
    make_plan,
    placements_to_hf,
)
from megatron_patch.conversion.legacy import legacy_layout, legacy_rank_dir, load_legacy_file, load_legacy_stage
from megatron_patch.conversion.mcore_io import checkpoint_step_dir, detect_format, flat_plan, read_manifest
from megatron_patch.conversion.torch_dist import TorchDistReader, is_hybrid_checkpoint, torch_dist_info
from megatron_patch.models.build import build_model
from megatron_patch.models.family import Layout
from megatron_patch.models.registry import get_family, load_hf_config
from megatron_patch.names import HF_SUBDIR, LEGACY_FILE, MANIFEST
from megatron_patch.runtime.parallel import Rank, ensure_model_parallel


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
            refuse_adapter_checkpoint(path, step_dir)
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
            plan = flat_plan(plan)
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
            flat = flat_plan(plan)
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


def refuse_adapter_checkpoint(path: str, step_dir: str) -> None:
    """A LoRA run's checkpoint holds its adapters only (the base stays in the run's --load-hf folder): every tool
    that reads a model from a Megatron checkpoint says so, naming the export that merges the two."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_patch.lora.adapters import is_adapter_key

    keys = FileSystemReader(step_dir).read_metadata().state_dict_metadata
    if "embedding.word_embeddings.weight" not in keys and any(is_adapter_key(k) for k in keys):
        raise ConversionError(f"{path} is a LoRA checkpoint: it holds the adapters, not the model; merge them into "
                              f"their base first: python -m megatron_patch.lora.export --load {path} --save-merged "
                              "DIR, then use the HF folder DIR (--hf-dir DIR)")


def load_megatron_model(ckpt_dir: str, *, layout: Layout = Layout(), impl: str | None = None,
                        dtype: torch.dtype = torch.float32, hf_config: str | None = None):
    """Build this rank's `GPTModel` for a Megatron checkpoint and load its weights: torch_dist the
    way `megatron.training` does (through the model's sharded state dict, any layout); legacy, and
    torch_dist saved by a HybridModel run (`--model-class hybrid`), through the engine (any layout).
    `layout`'s TP / PP / EP are this run's (its vocab padding rule is ignored: the checkpoint's embedding
    size wins). Returns (model, hf_config)."""
    from megatron.core import dist_checkpointing

    ckpt = MegatronCheckpoint.open(ckpt_dir, hf_config)
    impl = impl or ckpt.impl
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    ensure_model_parallel(tp, pp, ep)
    # torch_dist is loaded as stored (its kv-head replication included); legacy and HybridModel checkpoints go
    # through HF tensors (multi-latent attention has no query groups to keep)
    hybrid = ckpt.format == "torch_dist" and is_hybrid_checkpoint(ckpt.step_dir)
    groups = ({"num_query_groups": ckpt.num_query_groups}
              if ckpt.format == "torch_dist" and not hybrid and ckpt.num_query_groups is not None else {})
    model = build_model(ckpt.hf_config, layout=Layout(tp, pp, ep=ep), impl=impl, dtype=dtype,
                        padded_vocab_size=ckpt.padded_vocab_size, perform_initialization=False, **groups)
    if ckpt.format == "torch_dist" and not hybrid:
        # both implementations key their tensors alike; a Transformer Engine model also asks for the
        # `_extra_state` objects of norms it keeps apart, which a checkpoint converted for `local` may lack
        try:
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt.step_dir)["model"]
        except Exception as e:
            if impl == ckpt.impl:
                raise
            raise ValueError(f"{ckpt_dir} was converted for the {ckpt.impl} implementation and does not load as "
                             f"{impl} ({type(e).__name__}); convert it: megatron-patch convert mcore-to-mcore "
                             f"--impl {impl}") from e
        model.load_state_dict(loaded, strict=True)
    else:  # legacy, or saved by a HybridModel run: through the HF tensors (the reader maps hybrid layers)
        hf = {k: v for chunk in ckpt.hf_chunks() for k, v in chunk.items()}
        plan = make_plan(ckpt.hf_config, Layout(tp, pp, ckpt.layout.make_vocab_size_divisible_by, ep), impl,
                         padded_vocab_size=ckpt.padded_vocab_size)
        load_hf_into_rank(model, plan, hf.__getitem__, hf.keys(), dtype)
    return model.eval(), ckpt.hf_config
