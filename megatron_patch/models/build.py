"""Building megatron-core models for a family: `TransformerConfig` from an HF config and a layout, and the
`GPTModel` itself (`gpt_model`, the one place a model is assembled; `build_model` for the tools, the model
provider for training). Each function takes the family its caller resolved, so a call chain resolves it
once."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch

from megatron_patch import patches
from megatron_patch.models.family import Impl, Layout, ModelFamily
from megatron_patch.models.registry import get_family
from megatron_patch.names import IMPLS
from megatron_patch.runtime.parallel import ensure_model_parallel

MODEL_CLASSES = ("gpt", "hybrid")  # megatron-core's GPTModel, or its HybridModel (models/hybrid.py)


def model_class_parts(model_class: str) -> tuple[Any, Any]:
    """(the function assembling a model of `model_class` from a ready `TransformerConfig`: `gpt_model` or
    `hybrid.hybrid_model`; the `TransformerConfig` fields that class needs, a function of (hf_config, family)):
    what `build_model` and the training model provider both choose by the model class. Before either builds
    a model, Transformer Engine's FlashAttention-4 calls get FA4's causal window (patch `te_fa4_causal_window`;
    TE's own call attends to nothing there, docs/design.md) and TE loads FP8 delayed-scaling checkpoints
    (patch `te_extra_state_safe_load`), left in place for the process."""
    if model_class not in MODEL_CLASSES:
        raise ValueError(f"model_class must be one of {MODEL_CLASSES}, got {model_class!r}")
    patches.apply("te_fa4_causal_window")  # a no-op without TE and FA4
    patches.apply("te_extra_state_safe_load")  # a no-op without TE (or before TE 2.20)
    if model_class == "hybrid":
        from megatron_patch.models.hybrid import config_overrides, hybrid_model

        return hybrid_model, config_overrides
    return gpt_model, lambda hf_config, family=None: {}


def transformer_engine_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def runtime_config_kwargs(dtype: torch.dtype = torch.float32) -> dict:
    """Runtime (non-architecture) TransformerConfig fields for models built outside
    `megatron.training` (conversion, verification): parameters are created on the GPU when there is
    one, else on the CPU, and the fused kernels that need CUDA extensions (Apex, megatron's own
    fused softmax) are off, so the same model runs on either. RoPE is fused (Transformer Engine's kernel)
    where there is a GPU and TE: unfused, it is ~14 small kernels a layer, a sixth of an 8B decode step
    (docs/benchmarks.md); `transformer_config` turns it off where megatron-core refuses it (MLA)."""
    return dict(
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        apply_rope_fusion=torch.cuda.is_available() and transformer_engine_available(),
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
    family = family or get_family(hf_config)
    shapes = family.shapes(hf_config, layout)
    kwargs = {**family.config_kwargs(hf_config), **runtime_config_kwargs(dtype),
              "num_query_groups": shapes.num_query_groups,
              "tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
              **({"virtual_pipeline_model_parallel_size": layout.vpp} if layout.vpp else {}),
              **overrides}
    if kwargs.get("multi_latent_attention") and "apply_rope_fusion" not in overrides:
        kwargs["apply_rope_fusion"] = False  # megatron-core: only with YaRN, and for training only
    if kwargs["num_query_groups"] % layout.tp or kwargs["num_query_groups"] % shapes.hf_query_groups:
        raise ValueError(f"num_query_groups={kwargs['num_query_groups']} must be a multiple of TP={layout.tp} "
                         f"and of the {shapes.hf_query_groups} kv heads")
    cls = family.config_class()
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"unknown {cls.__name__} fields: {unknown}")
    return cls(**kwargs)


# build_model's parameters before `layout` (deprecated: pass layout=Layout(...))
_LAYOUT_PARAMETERS = ("tp", "pp", "make_vocab_size_divisible_by", "ep", "etp")


def _layout_argument(layout: Layout | None, positional: tuple, overrides: dict) -> Layout:
    """`layout`, or the one the deprecated form gives: `build_model(cfg, tp, pp, ...)` / `tp=`, `pp=`, `ep=`,
    `etp=`, `make_vocab_size_divisible_by=` keywords (a DeprecationWarning; both forms at once are an error)."""
    import warnings

    given = {k: overrides.pop(k) for k in _LAYOUT_PARAMETERS if k in overrides}
    if len(positional) > 2:
        raise TypeError("build_model(hf_config, *, layout=Layout(...), impl=..., dtype=..., ...): impl, dtype and "
                        "the rest are keyword-only")
    given.update(zip(("tp", "pp"), positional))
    if not given:
        return layout or Layout()
    if layout is not None:
        raise TypeError(f"build_model: pass the layout once, as layout=Layout(...), not also {', '.join(given)}")
    warnings.warn("build_model(hf_config, tp, pp, ep=..., ...) is deprecated: pass layout=Layout(tp, pp, ep=...)",
                  DeprecationWarning, stacklevel=3)
    return Layout(**given)


def build_model(hf_config: Any, *deprecated_tp_pp: int, layout: Layout | None = None, impl: Impl = "local",
                dtype: torch.dtype = torch.float32, padded_vocab_size: int | None = None,
                pre_process: bool | None = None, post_process: bool | None = None,
                family: ModelFamily | None = None, model_class: str = "gpt", **config_overrides):
    """The megatron-core `GPTModel` (`model_class="hybrid"`: `HybridModel`, models/hybrid.py) for this
    process's rank of `layout` (a `Layout`: TP x PP x EP sizes and the vocab padding rule; default all 1).

    Model parallelism must be initialised for the layout (`parallel_state.initialize_model_parallel`);
    for TP=PP=1 with nothing set up, a gloo world of one is created here. The embedding is padded
    per `layout.make_vocab_size_divisible_by` x TP unless `padded_vocab_size` (e.g. a checkpoint's) is given.
    `config_overrides` are TransformerConfig fields (e.g. `perform_initialization=False`, or a
    checkpoint's `num_query_groups`). `family`: the family of `hf_config` when the caller has resolved it.
    The form `build_model(cfg, tp, pp, ep=...)` still works, with a DeprecationWarning."""
    from megatron.core import parallel_state as ps

    layout = _layout_argument(layout, deprecated_tp_pp, config_overrides)
    tp, pp, ep = layout.tp, layout.pp, layout.ep

    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "transformer_engine" and not transformer_engine_available():
        raise ValueError("the transformer_engine implementation needs Transformer Engine, which is not installed: "
                         "install it (pip install 'megatron_patch[te]', on a CUDA machine) or run with --impl local")
    build, class_fields = model_class_parts(model_class)
    family = family or get_family(hf_config)
    config_overrides = {**class_fields(hf_config, family), **config_overrides}
    shapes = family.shapes(hf_config, layout)  # checks the layout against the model (`Layout.check`)
    ensure_model_parallel(tp, pp, ep, layout.etp, layout.vpp)
    have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())
    if have != (tp, pp, ep, layout.expert_tp):
        raise ValueError(f"model parallelism is initialised as TP={have[0]}, PP={have[1]}, EP={have[2]}, ETP={have[3]} "
                         f"but TP={tp}, PP={pp}, EP={ep}, ETP={layout.expert_tp} was asked for")
    config = transformer_config(hf_config, layout, dtype, family,
                                **{"transformer_impl": impl, **config_overrides})
    vocab = padded_vocab_size or shapes.padded_vocab_size
    if layout.vpp:
        # megatron.training's get_model: chunk v of pipeline rank p is stage layout.virtual_stage(v, p)
        if model_class != "gpt" or pre_process is not None or post_process is not None:
            raise ValueError("virtual pipeline stages (VPP) are built for GPTModel only, each chunk's ends from "
                             "its stage (megatron-core's HybridModel has no VPP)")
        rank, stages = ps.get_pipeline_model_parallel_rank(), pp * layout.vpp
        ends = [(s == 0, s == stages - 1) for s in (layout.virtual_stage(v, rank) for v in range(layout.vpp))]
        with patches.applied("cpu_cuda_calls"):  # MLA builds its rotary embedding on current_device()
            return [_placed(build(hf_config, config, vocab, first, last, family=family, vp_stage=v), dtype, config)
                    for v, (first, last) in enumerate(ends)]
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage()
    if post_process is None:
        post_process = ps.is_pipeline_last_stage()
    with patches.applied("cpu_cuda_calls"):
        model = build(hf_config, config, vocab, pre_process, post_process, family=family)
    return _placed(model, dtype, config)


def _placed(model, dtype: torch.dtype, config):
    """A freshly built model in `dtype` on its device, as megatron.training's get_model leaves one."""
    if dtype != torch.float32:
        # torch norms (local spec without Apex) are built in fp32 whatever params_dtype says;
        # megatron.training casts the same way (Float16Module)
        model.to(dtype)
    if not config.use_cpu_initialization:
        # as megatron.training's get_model does: modules built without a device (torch norms) follow
        model.cuda(torch.cuda.current_device())
    return model


def gpt_model(hf_config: Any, config, vocab_size: int, pre_process: bool, post_process: bool,
              family: ModelFamily | None = None, **gpt_kwargs):
    """The family's `GPTModel` for a ready `TransformerConfig` (its `transformer_impl` picks the layer
    spec): the one place a model is assembled, for the tools (`build_model`) and for training (the
    model provider, whose config comes from megatron.training's arguments)."""
    from megatron.core.models.gpt import GPTModel

    from megatron_patch.models.modules.fused_mlp import with_te_mlp

    family = family or get_family(hf_config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=with_te_mlp(family.decoder_spec(hf_config, config, gpt_kwargs.get("vp_stage")), config),
        vocab_size=vocab_size,
        max_sequence_length=family.max_sequence_length(hf_config),
        pre_process=pre_process,
        post_process=post_process,
        **{**family.gpt_kwargs(hf_config), **gpt_kwargs},
    )
    family.finalize(model, hf_config)
    return model
