"""ModelFamily: what one HF architecture family contributes, and the facts it is built from (`Layout`,
config helpers).

A family turns an HF `config.json` into megatron-core's `TransformerConfig` + `GPTModel` kwargs,
names the layer spec for the `local` and `transformer_engine` implementations, declares the weight
map, and writes an HF `config.json` back from Megatron's config. Families are declarative: how a tensor
splits over TP is each mapping op's own (`models/mappings.py`), the placement over pipeline stages and
expert ranks lives in `megatron_patch.conversion.engine`; models are built by `models/build.py`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from megatron_patch.models.mappings import Drop, Mapping, Shapes

Impl = Literal["local", "transformer_engine"]


class UnsupportedConfig(ValueError):
    """The HF config uses a feature this family cannot express in megatron-core."""


def cfg_get(hf_config: Any, key: str, default: Any = None) -> Any:
    """Read a field from a transformers config object or a plain dict."""
    if isinstance(hf_config, dict):
        return hf_config.get(key, default)
    return getattr(hf_config, key, default)


def as_dict(hf_config: Any) -> dict:
    return dict(hf_config) if isinstance(hf_config, dict) else hf_config.to_dict()


def rope_parameters(hf_config: Any) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None), from transformers>=5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` keys; a scaling of type "default" counts as none."""
    params = cfg_get(hf_config, "rope_parameters") or {}
    scaling = dict(cfg_get(hf_config, "rope_scaling") or params)
    theta = float(params.get("rope_theta", cfg_get(hf_config, "rope_theta", 10000.0)))
    scaling.pop("rope_theta", None)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    return theta, {**scaling, "rope_type": kind}


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's rule (`--make-vocab-size-divisible-by` x TP)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def query_groups_for(kv_heads: int, tp: int) -> int:
    """megatron-core's `num_query_groups` for a model with `kv_heads` at tensor parallelism `tp`.
    megatron-core splits attention over TP by query groups (num_query_groups % TP == 0); with fewer kv
    heads than TP (one kv head at TP=2), each kv head is replicated TP / kv_heads times, which
    computes the same function (the mapping ops copy the heads; `Shapes.kv_replicas`)."""
    if kv_heads % tp == 0:
        return kv_heads
    if tp % kv_heads == 0:
        return tp
    raise ValueError(f"TP={tp} does not divide the {kv_heads} kv heads (query groups), nor do they divide TP; "
                     "megatron-core needs num_query_groups % TP == 0")


@dataclass(frozen=True)
class Layout:
    """A parallel layout plus the vocab padding rule that depends on it: tensor (`tp`), pipeline (`pp`, with
    `vpp` virtual stages each), expert (`ep`, `etp`) and context (`cp`) parallel sizes, as Megatron-LM's
    arguments name them (`from_megatron_args`). `check` is the one test of a layout against a model."""

    tp: int = 1
    pp: int = 1
    make_vocab_size_divisible_by: int = 128
    ep: int = 1  # expert parallel: the experts of a mixture-of-experts layer split over EP ranks
    etp: int | None = None  # expert tensor parallel: how each routed expert is split (default: TP)
    cp: int = 1  # context parallel: the sequence split over CP ranks (the weights are not)
    vpp: int | None = None  # virtual pipeline: model chunks per pipeline rank (interleaved schedule)

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @classmethod
    def from_megatron_args(cls, args: Any) -> Layout:
        """The layout of Megatron-LM's parsed (and validated) arguments."""
        return cls(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                   args.make_vocab_size_divisible_by, getattr(args, "expert_model_parallel_size", 1) or 1,
                   getattr(args, "expert_tensor_parallel_size", None),
                   getattr(args, "context_parallel_size", 1) or 1,
                   getattr(args, "virtual_pipeline_model_parallel_size", None))

    def virtual_stage(self, chunk: int, pp_rank: int) -> int:
        """The virtual pipeline stage of model chunk `chunk` on pipeline rank `pp_rank`: chunk v of rank p is
        stage v * PP + p (megatron-core's interleaved schedule; chunk 0 of every rank first)."""
        return chunk * self.pp + pp_rank

    def virtual_stages(self, chunks: int | None = None) -> Layout:
        """This layout with each virtual pipeline stage as a stage of its own (PP x VPP stages, no VPP; stage
        `virtual_stage(v, p)` of pipeline rank p's chunk v): the layout a conversion plan for a virtual
        pipeline's model chunks is made at. `chunks`: the chunks per rank when this layout does not say (a
        built model's)."""
        v = chunks or self.vpp or 1
        return dataclasses.replace(self, pp=self.pp * v, vpp=None)

    def check(self, num_layers: int, num_heads: int, num_query_groups: int, num_experts: int = 0,
              expert_ffn: int | None = None, model: str = "the model") -> None:
        """A ValueError naming the size that does not fit the model."""
        sizes = {"TP": self.tp, "PP": self.pp, "EP": self.ep, "CP": self.cp, "ETP": self.expert_tp,
                 "VPP": self.vpp or 1}
        low = [f"{k}={v}" for k, v in sizes.items() if v < 1]
        if low:
            raise ValueError(f"parallel sizes must be >= 1 (got {', '.join(low)})")
        if num_heads % self.tp:
            raise ValueError(f"TP={self.tp} does not divide the {num_heads} attention heads")
        query_groups_for(num_query_groups, self.tp)
        if num_layers % self.pp:
            raise ValueError(f"PP={self.pp} does not divide the {num_layers} layers")
        if self.vpp and (self.pp == 1 or num_layers % (self.pp * self.vpp)):
            raise ValueError(f"VPP={self.vpp}: a virtual pipeline needs PP > 1 and PP x VPP dividing the "
                             f"{num_layers} layers (PP={self.pp})")
        if self.ep > 1 and not num_experts:
            raise ValueError(f"EP={self.ep}: {model} has no experts to split (expert parallelism is for "
                             "mixture-of-experts models)")
        if num_experts and num_experts % self.ep:
            raise ValueError(f"EP={self.ep} does not divide the {num_experts} experts")
        if num_experts and expert_ffn and expert_ffn % self.expert_tp:
            raise ValueError(f"ETP={self.expert_tp} does not divide the experts' FFN size {expert_ffn}")


class ModelFamily:
    """Base class; a family file subclasses it and registers an instance."""

    name: str = ""
    architectures: tuple[str, ...] = ()

    # ---- (a) HF config -> megatron-core config -------------------------------------------
    def config_kwargs(self, hf_config: Any) -> dict:
        """Architecture fields of `TransformerConfig` (no parallelism or runtime choices)."""
        raise NotImplementedError

    def gpt_kwargs(self, hf_config: Any) -> dict:
        """`GPTModel` kwargs other than config/spec/vocab/pre-post process."""
        raise NotImplementedError

    def shapes(self, hf_config: Any, layout: Layout) -> Shapes:
        ck = self.config_kwargs(hf_config)
        vocab = int(cfg_get(hf_config, "vocab_size"))
        groups = ck.get("num_query_groups") or ck["num_attention_heads"]
        layout.check(ck["num_layers"], ck["num_attention_heads"], groups, ck.get("num_moe_experts") or 0,
                     ck.get("moe_ffn_hidden_size"), self.name)
        return Shapes(
            num_heads=ck["num_attention_heads"],
            num_query_groups=query_groups_for(groups, layout.tp),
            head_dim=ck.get("kv_channels") or ck["hidden_size"] // ck["num_attention_heads"],
            vocab_size=vocab,
            padded_vocab_size=padded_vocab_size(vocab, layout.tp, layout.make_vocab_size_divisible_by),
            hf_query_groups=groups,
        )

    def check_layout(self, hf_config: Any, layout: Layout) -> None:
        """`Layout.check` with this family's numbers for `hf_config`."""
        self.shapes(hf_config, layout)

    # ---- (b) layer spec ---------------------------------------------------------------------
    def layer_spec(self, hf_config: Any, impl: Impl):
        raise NotImplementedError

    def config_class(self):
        """megatron-core's config class for this family (MLA families need `MLATransformerConfig`)."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig

    def decoder_spec(self, hf_config: Any, config, vp_stage: int | None = None):
        """What `GPTModel` gets as `transformer_layer_spec`: one layer spec for every layer, or (families
        whose layers differ, e.g. mixture-of-experts) a per-layer block spec built from `config`."""
        return self.layer_spec(hf_config, config.transformer_impl)

    # ---- (c) weight map ---------------------------------------------------------------------
    def weight_map(self, hf_config: Any) -> list[Mapping | Drop]:
        raise NotImplementedError

    def max_sequence_length(self, hf_config: Any) -> int:
        return int(cfg_get(hf_config, "max_position_embeddings", None) or 4096)

    def finalize(self, model, hf_config: Any) -> None:
        """Adjust a built `GPTModel` in place (modules megatron-core builds outside the layer spec)."""

    def tied_embeddings(self, hf_config: Any) -> bool:
        return bool(self.gpt_kwargs(hf_config).get("share_embeddings_and_output_weights", False))

    # ---- (d) Megatron config -> HF config.json ----------------------------------------------
    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        raise NotImplementedError
