"""ModelFamily: what one HF architecture family contributes, and `build_model`.

A family turns an HF `config.json` into megatron-core's `TransformerConfig` + `GPTModel` kwargs,
names the layer spec for the `local` and `transformer_engine` implementations, declares the weight
map, and writes an HF `config.json` back from Megatron's config. Families are declarative: all
TP/PP arithmetic lives in `megatron_patch.conversion.engine`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from megatron_patch import patches
from megatron_patch.models.mappings import Drop, Mapping, Shapes
from megatron_patch.names import IMPLS

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
    """A parallel layout plus the vocab padding rule that depends on it."""

    tp: int = 1
    pp: int = 1
    make_vocab_size_divisible_by: int = 128
    ep: int = 1  # expert parallel: the experts of a mixture-of-experts layer split over EP ranks
    etp: int | None = None  # expert tensor parallel: how each routed expert is split (default: TP)

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    def check(self, num_layers: int, num_heads: int, num_query_groups: int) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"TP and PP must be >= 1 (got TP={self.tp}, PP={self.pp})")
        if num_heads % self.tp:
            raise ValueError(f"TP={self.tp} does not divide the {num_heads} attention heads")
        query_groups_for(num_query_groups, self.tp)
        if num_layers % self.pp:
            raise ValueError(f"PP={self.pp} does not divide the {num_layers} layers")
        if self.ep < 1:
            raise ValueError(f"EP must be >= 1 (got {self.ep})")


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
        layout.check(ck["num_layers"], ck["num_attention_heads"], groups)
        return Shapes(
            num_heads=ck["num_attention_heads"],
            num_query_groups=query_groups_for(groups, layout.tp),
            head_dim=ck.get("kv_channels") or ck["hidden_size"] // ck["num_attention_heads"],
            vocab_size=vocab,
            padded_vocab_size=padded_vocab_size(vocab, layout.tp, layout.make_vocab_size_divisible_by),
            hf_query_groups=groups,
        )

    def check_layout(self, hf_config: Any, layout: Layout) -> None:
        self.shapes(hf_config, layout)
        arch = self.config_kwargs(hf_config)
        experts = arch.get("num_moe_experts") or 0
        if layout.ep > 1 and not experts:
            raise ValueError(f"EP={layout.ep}: {self.name} has no experts to split (expert parallelism is for "
                             "mixture-of-experts models)")
        if experts and experts % layout.ep:
            raise ValueError(f"EP={layout.ep} does not divide the {experts} experts")
        ffn = arch.get("moe_ffn_hidden_size")
        if experts and ffn and ffn % layout.expert_tp:
            raise ValueError(f"ETP={layout.expert_tp} does not divide the experts' FFN size {ffn}")

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


def transformer_engine_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def runtime_config_kwargs(dtype: torch.dtype = torch.float32) -> dict:
    """Runtime (non-architecture) TransformerConfig fields for models built outside
    `megatron.training` (conversion, verification): parameters are created on the GPU when there is
    one, else on the CPU, and the fused kernels that need CUDA extensions (Apex, megatron's own
    fused softmax) are off, so the same model runs on either."""
    return dict(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
    )


def transformer_config(hf_config: Any, layout: Layout = Layout(), dtype: torch.dtype = torch.float32,
                       family: ModelFamily | None = None, **overrides):
    """`TransformerConfig` for `hf_config` at `layout`; `overrides` win over everything (a checkpoint's
    `num_query_groups`, e.g., when it was made with kv heads replicated for another TP)."""
    from megatron_patch.models.registry import get_family

    family = family or get_family(hf_config)
    shapes = family.shapes(hf_config, layout)
    kwargs = {**family.config_kwargs(hf_config), **runtime_config_kwargs(dtype),
              "num_query_groups": shapes.num_query_groups,
              "tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
              **overrides}
    if kwargs["num_query_groups"] % layout.tp or kwargs["num_query_groups"] % shapes.hf_query_groups:
        raise ValueError(f"num_query_groups={kwargs['num_query_groups']} must be a multiple of TP={layout.tp} "
                         f"and of the {shapes.hf_query_groups} kv heads")
    cls = family.config_class()
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"unknown {cls.__name__} fields: {unknown}")
    return cls(**kwargs)


def build_model(hf_config: Any, tp: int = 1, pp: int = 1, impl: Impl = "local",
                dtype: torch.dtype = torch.float32, make_vocab_size_divisible_by: int = 128,
                padded_vocab_size: int | None = None, pre_process: bool | None = None,
                post_process: bool | None = None, ep: int = 1, etp: int | None = None, **config_overrides):
    """The megatron-core `GPTModel` for this process's rank of a TP x PP (x EP) layout.

    Model parallelism must be initialised for TP x PP (`parallel_state.initialize_model_parallel`);
    for TP=PP=1 with nothing set up, a gloo world of one is created here. The embedding is padded
    per `make_vocab_size_divisible_by` x TP unless `padded_vocab_size` (e.g. a checkpoint's) is given.
    `config_overrides` are TransformerConfig fields (e.g. `perform_initialization=False`, or a
    checkpoint's `num_query_groups`)."""
    from megatron.core import parallel_state as ps

    from megatron_patch.models.registry import get_family

    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "transformer_engine" and not transformer_engine_available():
        raise ValueError("the transformer_engine implementation needs Transformer Engine, which is not installed: "
                         "install it (pip install 'megatron_patch[te]', on a CUDA machine) or run with --impl local")
    family = get_family(hf_config)
    layout = Layout(tp, pp, make_vocab_size_divisible_by, ep, etp)
    family.check_layout(hf_config, layout)
    ensure_model_parallel(tp, pp, ep, etp)
    have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())
    if have != (tp, pp, ep, layout.expert_tp):
        raise ValueError(f"model parallelism is initialised as TP={have[0]}, PP={have[1]}, EP={have[2]}, ETP={have[3]} "
                         f"but TP={tp}, PP={pp}, EP={ep}, ETP={layout.expert_tp} was asked for")
    config = transformer_config(hf_config, layout, dtype, family,
                                **{"transformer_impl": impl, **config_overrides})
    shapes = family.shapes(hf_config, layout)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage()
    if post_process is None:
        post_process = ps.is_pipeline_last_stage()
    with patches.applied("cpu_cuda_calls"):  # MLA builds its rotary embedding on current_device()
        model = gpt_model(hf_config, config, padded_vocab_size or shapes.padded_vocab_size, pre_process,
                          post_process)
    if dtype != torch.float32:
        # torch norms (local spec without Apex) are built in fp32 whatever params_dtype says;
        # megatron.training casts the same way (Float16Module)
        model.to(dtype)
    if not config.use_cpu_initialization:
        # as megatron.training's get_model does: modules built without a device (torch norms) follow
        model.cuda(torch.cuda.current_device())
    return model


def gpt_model(hf_config: Any, config, vocab_size: int, pre_process: bool, post_process: bool, **gpt_kwargs):
    """The family's `GPTModel` for a ready `TransformerConfig` (its `transformer_impl` picks the layer
    spec): the one place a model is assembled, for the tools (`build_model`) and for training (the
    model provider, whose config comes from megatron.training's arguments)."""
    from megatron.core.models.gpt import GPTModel

    from megatron_patch.models.registry import get_family

    family = get_family(hf_config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=family.decoder_spec(hf_config, config, gpt_kwargs.get("vp_stage")),
        vocab_size=vocab_size,
        max_sequence_length=family.max_sequence_length(hf_config),
        pre_process=pre_process,
        post_process=post_process,
        **{**family.gpt_kwargs(hf_config), **gpt_kwargs},
    )
    family.finalize(model, hf_config)
    return model


def current_rank() -> tuple[int, int, int]:
    """This process's (tp_rank, pp_rank, ep_rank): the key of its state dict in the conversion engine."""
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_expert_model_parallel_rank())


def current_etp_rank() -> int:
    """This process's rank among the expert-tensor-parallel shards of its experts."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_parallel_rank()


def ensure_model_parallel(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    """Initialise a gloo world of one and TP=PP=1 model parallelism when nothing is set up yet
    (converter and verification tools; training sets up its own world). The RNG tracker is the
    inference one: these models only run forward passes."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:  # launched by torchrun: join its world (NCCL on GPUs, gloo on CPUs)
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        elif tp * pp * ep != 1:
            raise RuntimeError(f"TP={tp} x PP={pp} x EP={ep} needs at least {tp * pp * ep} processes: run under "
                               f"torchrun --nproc-per-node {tp * pp * ep}")
        else:
            # an in-memory store: no port, nothing inherited by child processes
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        model_parallel_cuda_manual_seed(0, inference_rng_tracker=True, force_reset_rng=True)
