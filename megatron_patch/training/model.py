"""The model provider megatron.training calls on every rank: the family's `GPTModel` (or, with
`--model-class hybrid`, its `HybridModel`: models/hybrid.py), with
megatron-core's `TransformerConfig` built from Megatron's arguments (parallelism, precision, fusions,
recompute, ...) and the architecture fields replaced by the family's (activation, norms, rotary
variant, sliding window, ... that Megatron's arguments cannot all express)."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_patch.models import Layout, ModelFamily, get_family
from megatron_patch.models.build import model_class_parts


def transformer_config_from_args(args, hf_config: Any, family: ModelFamily | None = None):
    from megatron.training.argument_utils import core_transformer_config_from_args

    family = family or get_family(hf_config)
    base = core_transformer_config_from_args(args)
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    fields.update(family.config_kwargs(hf_config))
    fields.update(model_class_parts(getattr(args, "model_class", "gpt"))[1](hf_config, family))
    shapes = family.shapes(hf_config, Layout(args.tensor_model_parallel_size, 1, args.make_vocab_size_divisible_by))
    fields["num_query_groups"] = shapes.num_query_groups
    fields["hidden_dropout"], fields["attention_dropout"] = args.hidden_dropout, args.attention_dropout
    # megatron's own (non-TE) linear layers fuse weight-gradient accumulation only through Apex's
    # extension, or ours in its place (`--wgrad-fusion-without-apex`: the `apex_free_wgrad_fusion` patch registers
    # it under Apex's name); without either they accumulate the ordinary way and TE's layers fuse on their own (below)
    fields["gradient_accumulation_fusion"] = args.gradient_accumulation_fusion and _apex_wgrad_available()
    config = family.config_class()(**fields)  # MLA families need MLATransformerConfig
    if _fp8_head(args) == "transformer_engine":
        # after __post_init__, which allows it with MXFP8 only (the `fp8_output_layer` patch lifts that in the build)
        config.fp8_output_proj = True
    return config


def _fp8_head(args) -> str | None:
    """The FP8 output layer's implementation (`--fp8-output-layer-impl`, made definite by the parser), or None."""
    return getattr(args, "fp8_output_layer_impl", "transformer_engine") if getattr(args, "fp8_output_layer", False) \
        else None


def _apex_wgrad_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def fuse_te_wgrad(model, wanted: bool) -> int:
    """`--gradient-accumulation-fusion` (Megatron's default) for Transformer Engine's layers even without
    Apex: TE accumulates weight gradients straight into the optimizer's fp32 `main_grad` buffer itself.
    Megatron ties the switch for all layers to Apex being installed (its output layer needs Apex), which
    would turn TE's fusion off too. Returns the number of TE layers switched on."""
    if not wanted:
        return 0
    n = 0
    for module in model.modules():
        if hasattr(module, "fuse_wgrad_accumulation") and not module.fuse_wgrad_accumulation:
            module.fuse_wgrad_accumulation = True
            n += 1
    return n


def load_hf_weights(model, hf_dir: str, hf_config: Any, args, vp_stage: int | None = None) -> None:
    """Fill this rank's freshly built model (a virtual pipeline's chunk `vp_stage`) from an HF checkpoint:
    only the tensors of its pipeline stage are read (one at a time, positioned reads), and of those only this
    TP rank's slices where the mapping allows (`Mapping.read_plan`; tests/distributed/test_load_hf_slices.py).
    A reward model may start from a causal LM: its backbone is read and the scalar head keeps its
    initialisation."""
    from megatron.core import parallel_state as ps

    from megatron_patch.conversion.engine import load_hf_into_rank, make_plan
    from megatron_patch.conversion.hf_io import HFCheckpoint
    from megatron_patch.models import load_hf_config
    from megatron_patch.models.reward import SCORE, is_reward_config

    layout = Layout.from_megatron_args(args)
    ckpt = HFCheckpoint(hf_dir)
    fresh_head = is_reward_config(hf_config) and SCORE not in ckpt.keys()
    source = load_hf_config(hf_dir) if fresh_head else hf_config
    # a virtual pipeline: each chunk is one stage of a plan at PP x VPP stages
    stage = layout.virtual_stage(vp_stage or 0, ps.get_pipeline_model_parallel_rank()) if layout.vpp else None
    plan = make_plan(source, layout.virtual_stages(), args.transformer_impl, padded_vocab_size=args.padded_vocab_size)
    # a fresh head replaces the causal LM's output layer (and its bias, GPT-J's)
    head = ["output_layer.weight", "output_layer.bias"] if fresh_head else []
    load_hf_into_rank(model, plan, ckpt.get, ckpt.keys(), keep=head, reader=ckpt, stage=stage)  # its slices only


def check_built(model, args, post_process: bool) -> None:
    """The modules the options asked for are the ones megatron-core built (a seam that moved between releases
    would otherwise train the plain layers silently): `--fp8-output-layer` Transformer Engine's output layer on the
    last stage (`--fp8-output-layer-impl transformer_engine`) or megatron-core's own that `training.fp8_head` takes
    (`torch`), `--use-transformer-engine-op-fuser` no plain `MLP` left as a layer's MLP, `--use-te-activation-func`
    no MLP (dense, expert or shared expert) left with a plain function as its activation, which megatron-core's MLP
    would apply to fc1's whole output under that option."""
    if _fp8_head(args) == "transformer_engine" and post_process and \
            type(model.output_layer).__name__ != "TELMHeadColumnParallelLinear":
        raise ValueError(f"--fp8-output-layer: megatron-core built {type(model.output_layer).__name__} as the "
                         "output layer, not Transformer Engine's TELMHeadColumnParallelLinear")
    if _fp8_head(args) == "torch" and post_process and \
            type(model.output_layer).__name__ != "ColumnParallelLinear":
        raise ValueError(f"--fp8-output-layer-impl torch: megatron-core built {type(model.output_layer).__name__} "
                         "as the output layer, not its ColumnParallelLinear")
    if getattr(args, "use_transformer_engine_op_fuser", False) and \
            any(type(getattr(m, "mlp", None)).__name__ == "MLP" for m in model.modules()):
        raise ValueError("--use-transformer-engine-op-fuser: megatron-core built its plain MLP, not TEFusedMLP, "
                         "for a dense layer of this model")
    if getattr(args, "use_te_activation_func", False):
        import torch

        plain = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "linear_fc1")
                        and hasattr(m, "activation_func") and not isinstance(m.activation_func, torch.nn.Module)})
        if plain:
            raise ValueError(f"--use-te-activation-func: megatron-core built {', '.join(plain)} with a plain "
                             "activation function, not Transformer Engine's op")


def make_model_provider(hf_config: Any):
    family = get_family(hf_config)  # resolved once for every model chunk megatron asks for

    def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                       config=None, pg_collection=None):
        from megatron.training import get_args

        args = get_args()
        tc = transformer_config_from_args(args, hf_config, family)
        build = model_class_parts(getattr(args, "model_class", "gpt"))[0]
        model = build(hf_config, tc, args.padded_vocab_size, pre_process, post_process, family=family,
                      fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
                      **({"vp_stage": vp_stage} if vp_stage is not None else {}))
        fuse_te_wgrad(model, args.gradient_accumulation_fusion)
        check_built(model, args, post_process)
        if _fp8_head(args) == "torch" and post_process:
            from megatron_patch.training import fp8_head

            fp8_head.install(model.output_layer)
        lora = getattr(args, "lora", False)
        if args.load_hf and (not args.resuming or lora):  # a LoRA checkpoint holds the adapters, not the base
            load_hf_weights(model, args.load_hf, hf_config, args, vp_stage)
        if lora:
            from megatron_patch.lora.training import adapt

            adapt(model, args, hf_config, family)
        return model

    return model_provider
