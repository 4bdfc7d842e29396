"""`Bridge`: the library as a Python API for custom trainers and RL frameworks.

One object for one HF model: its megatron-core `TransformerConfig`, this rank's model at a layout (TP x PP
x EP, local or Transformer Engine layers, GPTModel or HybridModel), HF weights loaded into the live model,
and HF-named weights streamed out of it (every step, to refresh an inference engine) or saved as an HF
folder. docs/python-api.md has a worked example.

    from megatron_patch import Bridge, Layout

    bridge = Bridge.from_hf("Llama-3.1-8B")
    model = bridge.build(layout=Layout(tp=2, pp=2))      # this rank's part; under torchrun, 4 processes
    bridge.load_hf_weights(model)                         # reads only this rank's stage
    for name, tensor in bridge.export_hf_weights(model):  # on every rank, in step
        ...
    bridge.save_hf(model, "out")                          # rank 0 writes

With a virtual pipeline (`Layout(pp=2, vpp=2)`) `build` returns the rank's list of model chunks, which every
method takes as it is.

Model parallelism is set up by `build` when nothing else did (`torch.distributed` from torchrun's
environment; megatron-core's parallel state at the layout); a trainer that set it up itself keeps its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from megatron_patch.models.family import Impl, Layout, ModelFamily


class Bridge:
    """An HF model (its config.json, and its weights when built from a folder) on megatron-core."""

    def __init__(self, hf_config: dict, *, hf_dir: str | None = None):
        from megatron_patch.models.registry import get_family

        self.hf_config = hf_config
        self.hf_dir = hf_dir
        self.family: ModelFamily = get_family(hf_config)

    @classmethod
    def from_hf(cls, hf_dir: str) -> Bridge:
        """From an HF folder (config.json, and the weights `load_hf_weights` reads)."""
        from megatron_patch.models.registry import load_hf_config

        return cls(load_hf_config(hf_dir), hf_dir=hf_dir)

    def transformer_config(self, *, layout: Layout = Layout(), impl: Impl = "local",
                           dtype: torch.dtype = torch.float32, model_class: str = "gpt", **overrides):
        """megatron-core's `TransformerConfig` (MLA families: `MLATransformerConfig`) at `layout`;
        `overrides` are its fields (e.g. `recompute_granularity="full"`)."""
        from megatron_patch.models.build import model_class_parts, transformer_config

        fields = {**model_class_parts(model_class)[1](self.hf_config, self.family), "transformer_impl": impl,
                  **overrides}
        return transformer_config(self.hf_config, layout, dtype, self.family, **fields)

    def build(self, *, layout: Layout = Layout(), impl: Impl = "local", dtype: torch.dtype = torch.float32,
              model_class: str = "gpt", **overrides):
        """This rank's model (megatron-core `GPTModel`, or `HybridModel` with `model_class="hybrid"`) at
        `layout`, with freshly initialised weights (`load_hf_weights` fills them). With `layout.vpp` = V (a
        virtual pipeline, GPTModel): the rank's list of V model chunks, chunk v holding virtual stage
        v * PP + p as megatron.training's `get_model` builds them; every method here takes that list."""
        from megatron_patch.models.build import build_model

        return build_model(self.hf_config, layout=layout, impl=impl, dtype=dtype, family=self.family,
                           model_class=model_class, **overrides)

    def model_provider(self, *, impl: Impl = "local", dtype: torch.dtype = torch.float32,
                       model_class: str = "gpt", **overrides) -> Callable[..., Any]:
        """A model provider for a plain loop or a framework that calls `provider(pre_process, post_process,
        vp_stage=None)` on each rank after setting up model parallelism (megatron.training builds its own
        from its arguments: `python -m megatron_patch.pretrain`)."""
        from megatron_patch.conversion.live import current_layout
        from megatron_patch.models.build import model_class_parts

        build = model_class_parts(model_class)[0]

        def provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
            layout = current_layout()
            config = self.transformer_config(layout=layout, impl=impl, dtype=dtype, model_class=model_class,
                                             **overrides)
            vocab = self.family.shapes(self.hf_config, layout).padded_vocab_size
            kwargs = {"vp_stage": vp_stage} if vp_stage is not None else {}
            return build(self.hf_config, config, vocab, pre_process, post_process, family=self.family, **kwargs)

        return provider

    def load_hf_weights(self, model, source: str | Mapping[str, Tensor] | None = None, *,
                        dtype: torch.dtype | None = None) -> dict:
        """Fill this rank's model from an HF folder (default: the one this bridge was made from; only its
        pipeline stage's tensors are read, experts its EP rank's, and it keeps its TP slice), or from HF
        tensors in memory by name (`dict(bridge.export_hf_weights(trained))`: an inference model refreshed
        in place, its parameters' storage kept, so CUDA graphs captured on them stay valid). Bitwise the
        converter's result. Returns {"tensors", "bytes_read"} of this rank."""
        from megatron_patch.conversion.live import load_hf_weights

        source = source if source is not None else self.hf_dir
        if source is None:
            raise ValueError("no HF weights: pass an HF folder or tensors (this Bridge was made from a config)")
        return load_hf_weights(model, self.hf_config, source, dtype=dtype)

    def export_hf_weights(self, model, *, dtype: torch.dtype | None = None, per_stage: bool = False,
                          merge_lora: bool = True) -> Iterator[tuple[str, Tensor]]:
        """`(hf_name, tensor)` of the live model on every rank (all ranks iterate it, in step), on the
        model's device; `per_stage=True`: each pipeline stage's tensors on that stage only. A LoRA model's
        adapted weights come merged (W + alpha / r * B @ A) unless `merge_lora=False`."""
        from megatron_patch.conversion.live import export_hf_weights

        return export_hf_weights(model, self.hf_config, dtype=dtype, per_stage=per_stage, merge_lora=merge_lora)

    def add_lora(self, model, *, rank: int, alpha: float | None = None, targets: tuple[str, ...] = ("all-linear",),
                 dropout: float = 0.0, seed: int = 0) -> int:
        """LoRA adapters on the model's linears (`targets`: linear_qkv, linear_proj, linear_fc1, linear_fc2 or
        all-linear), PEFT's initialisation (the same adapter at every layout), everything else frozen; after
        the base weights are loaded. Returns the number of adapted linears of this rank."""
        from megatron_patch.conversion.live import chunks, live_plan
        from megatron_patch.lora.adapters import LoRAConfig, apply_lora

        cfg = LoRAConfig(rank=rank, alpha=alpha, dropout=dropout, targets=tuple(targets), seed=seed)
        plan = live_plan(model, self.hf_config)
        return sum(len(apply_lora(chunk, self.hf_config, cfg, plan)) for chunk in chunks(model))

    def lora_adapter(self, model):
        """The model's LoRA adapter gathered whole on every rank (a collective), as `lora.peft.Adapter`:
        `modules` {HF module: (A [r, in], B [out, r])}, `rank`, `alpha`; None without adapters."""
        from megatron_patch.conversion.live import lora_adapter

        return lora_adapter(model, self.hf_config)

    def save_peft(self, model, out: str, *, overwrite: bool = False) -> dict | None:
        """The model's LoRA adapter as a PEFT folder (`peft.PeftModel.from_pretrained(base, out)` loads it),
        written by rank 0; every rank calls it. Rank 0 returns the summary, the others None."""
        import torch.distributed as dist

        from megatron_patch.conversion.live import live_plan
        from megatron_patch.lora.peft import Adapter, write_peft

        adapter = self.lora_adapter(model)
        if adapter is None:
            raise ValueError("the model has no LoRA adapters (add them with add_lora)")
        if dist.is_initialized() and dist.get_rank() != 0:
            return None
        cpu = Adapter({m: (a.cpu(), b.cpu()) for m, (a, b) in adapter.modules.items()}, adapter.rank, adapter.alpha,
                      adapter.dropout)
        return write_peft(out, cpu, live_plan(model, self.hf_config), base_model=self.hf_dir, overwrite=overwrite)

    def logits(self, model, tokens: Tensor) -> Tensor:
        """The model's full-vocabulary logits for `tokens` [batch, seq] (the same on every rank), float32, on
        the tokens' device, without gradient: gathered over TP, from the last pipeline stage, the vocabulary
        padding cut off. A collective: every rank calls it with the same tokens. With virtual pipeline
        stages, `model` is the rank's list of chunks."""
        from megatron_patch.conversion.live import chunks
        from megatron_patch.models.registry import vocab_size
        from megatron_patch.runtime.logits import megatron_logits

        if isinstance(model, (list, tuple)):
            model = chunks(model) if len(model) > 1 else model[0]
        return megatron_logits(model, tokens, vocab_size(self.hf_config))

    def save_hf(self, model, out: str, *, dtype: torch.dtype | None = None, overwrite: bool = False,
                max_shard_size: int = 5 * 10**9) -> dict | None:
        """The live model as an HF folder (rank 0 writes; a collective: every rank calls it, returns once the
        folder is complete and raises what rank 0 refused), with the tokenizer files of the bridge's HF
        folder; as `mcore-to-hf` writes one. Rank 0 returns the summary, the others None."""
        from megatron_patch.conversion.live import save_hf

        side = self.hf_dir if self.hf_dir and os.path.isdir(self.hf_dir) else None
        return save_hf(model, self.hf_config, out, dtype=dtype, side_dir=side, overwrite=overwrite,
                       max_shard_size=max_shard_size)


__all__ = ["Bridge", "Layout"]
