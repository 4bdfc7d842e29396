"""`--throughput-profile`: Megatron settings that make a training step cheaper. `default` changes the numbers by
no more than bf16 rounding, but for FP8 training's output layer in FP8 too (`_FP8_HEAD`, where the convergence study
trained it); `benchmark` also skips the per-step safety checks; `none` is Megatron's own defaults. A flag given on
the command line always wins."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

THROUGHPUT_PROFILES = ("none", "default", "benchmark")
# (argument, value, the flag that sets it): settings that leave the numbers as they are (up to bf16 rounding)
_NEUTRAL = (("manual_gc", True, "--manual-gc"), ("manual_gc_interval", 100, "--manual-gc-interval"),
            ("cross_entropy_loss_fusion", True, "--cross-entropy-loss-fusion"),
            ("cross_entropy_fusion_impl", "native", "--cross-entropy-fusion-impl"))
# the loss's cross-entropy without an fp32 copy of the logits (`training.cross_entropy`): on one H200 at LLaMA-3-8B
# widths (seq 8192, 128k vocabulary) +4.2% tokens/s in bf16 and +5.8% in fp8 over megatron-core's compiled fused
# cross-entropy, 5.9 GB less peak memory, losses within 4.4e-4 / 6.9e-3 of `none` over 20 iterations (the default
# profile's own: 2.8e-4 / 5.7e-3; docs/benchmarks.md, 2026-12-05); unless the command line chose a cross-entropy
_CROSS_ENTROPY_FLAGS = {"--lean-cross-entropy", "--no-lean-cross-entropy", "--cross-entropy-fusion-impl"}
# megatron-core's own linear layers (the output layer, 128,256 x 4,096 at LLaMA-3-8B) accumulate their weight gradients
# into the fp32 main_grad inside the GEMM, and an untied word embedding scatters its rows there, without Apex
# (`--wgrad-fusion-without-apex`, training.wgrad): one bf16 rounding of those gradients fewer. A tied embedding
# keeps F.embedding (megatron-core's zero_out_wgrad path; the output layer's GEMM is still fused). On one H200 at
# LLaMA-3-8B widths +2.5% tokens/s in fp8 (756 -> 775 TFLOP/s), losses within 4.6e-3 of the default profile's
# over 10 iterations (fp8's own distance from `none`: 2.2e-3); in bf16, with TE's fused MLP, +2.3% and 1.0e-4
# (docs/benchmarks.md, 2026-12-05). Only where --gradient-accumulation-fusion is on (a GPU; --cpu turns it off).
_WGRAD = ("wgrad_fusion_without_apex", True, "--wgrad-fusion-without-apex")
# the output layer's three GEMMs in FP8 too (`--fp8-output-layer`), where the convergence study trained it: Transformer
# Engine's output layer (untied embeddings; the `fp8_output_layer` patch's megatron-core versions) under the delayed
# recipe, on a language model's vocabulary head. On one H200 at LLaMA-3-8B widths +11% tokens/s in fp8 (with the
# weight-gradient fusion, 872 TFLOP/s; losses within 0.039 of the default's over 10 iterations, fp8's own distance
# from bf16 0.24, docs/benchmarks.md 2026-12-05); the Mixtral-shape study (20M tokens) ended -0.26% against BF16 in
# held-out loss, +0.42% against FP8 without it (docs/convergence.md, 2026-12-06). Not for tied embeddings
# (megatron-core's own layer with `training.fp8_head`: slower, and not in the study), other recipes, or a reward
# model's one-label head.
_FP8_HEAD = ("fp8_output_layer", True, "--fp8-output-layer")
# Transformer Engine's FusedAdam holding the fp32 master weights as the bf16 parameter and a 16-bit remainder
# (`--use-precision-aware-optimizer`: megatron-core's store_param_remainders): the fp32 master weight to the bit,
# 2 bytes a parameter instead of 4. On one H100 at LLaMA-3-8B widths the same tokens/s (576.9 TFLOP/s both) and
# 5.2 GB less resident memory (docs/benchmarks.md, 2026-12-07). A resumed run keeps the layout its checkpoint
# was saved with (`training.checkpoint.match_resumed_optimizer`; tests/gpu/test_paths.py). Where it was
# measured: bf16 training of every weight (no FP8, no LoRA) with Adam and the distributed optimizer, whose shards
# it keeps (`precision_aware_optimizer_suits`).
_PRECISION_AWARE = ("use_precision_aware_optimizer", True, "--use-precision-aware-optimizer")
# ... and trade a per-step safety check for speed
_UNCHECKED = (("check_for_nan_in_loss_and_grad", False, "--no-check-for-nan-in-loss-and-grad"),
              ("rerun_mode", "disabled", "--rerun-mode"))


# Transformer Engine's FlashAttention backend where it runs FlashAttention-4 (the `te_fa4_causal_window` patch
# makes its causal calls right): on one H200, LLaMA-3-8B widths at seq 8192, +1.6% tokens/s in bf16 and +2.2% in
# fp8 over cuDNN's fused attention (whose backward is 3x its forward), losses within 3e-4 / 3.2e-3 over 20
# iterations (docs/benchmarks.md, 2026-12-03). Where it was measured only: plain causal softmax attention.
FLASH_HEAD_DIMS = (64, 128)
BACKEND_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def flash_attention_suits(args: argparse.Namespace, model: Mapping[str, Any]) -> bool:
    """Whether the profile's attention (`--attention-backend flash`) fits this run: Transformer Engine, causal
    attention over whole sequences (no packed documents: --reset-attention-mask, SFT's packing; no context
    parallelism), no ALiBi (position embedding "none"), no sliding window, no multi-latent attention, no
    attention sink, no attention dropout, no FP8 attention, a head dim of `FLASH_HEAD_DIMS`, and no
    NVTE_*_ATTN variable of the user's. `model`: the family's TransformerConfig arguments."""
    heads = model.get("kv_channels") or args.hidden_size // args.num_attention_heads
    return (args.transformer_impl == "transformer_engine" and not args.reset_attention_mask
            and not getattr(args, "sft_data", None) and args.context_parallel_size == 1
            and args.position_embedding_type in ("rope", "learned_absolute")
            and model.get("window_size") is None and not model.get("multi_latent_attention")
            and model.get("softmax_type", "vanilla") == "vanilla" and not args.attention_dropout
            and not getattr(args, "fp8_dot_product_attention", False) and heads in FLASH_HEAD_DIMS
            and not any(v in os.environ for v in BACKEND_VARIABLES))


def te_runs_fa4_on_hopper() -> bool:
    """Whether this machine's GPU is a Hopper (SM90, where FA4 through TE was measured) and Transformer Engine
    found FlashAttention-4 (`patches.TE_FA4_NAMES` bound in its backends module)."""
    import torch

    from megatron_patch.patches import TE_FA4_NAMES, te_flash_backends

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    backends = te_flash_backends()
    return backends is not None and getattr(backends, TE_FA4_NAMES[0], None) is not None


def fp8_head_impl(args: argparse.Namespace) -> str:
    """`--fp8-output-layer-impl` as it applies: `auto` is Transformer Engine's output layer where megatron-core has
    one to offer (the `fp8_output_layer` patch's versions) and the output layer owns its weight (untied embeddings:
    Transformer Engine's layer takes no weight from the embedding at run time), megatron-core's own with FP8 GEMMs
    otherwise (`training.fp8_head`)."""
    from megatron_patch import patches

    impl = getattr(args, "fp8_output_layer_impl", "auto")
    if impl != "auto":
        return impl
    untied = bool(args.untie_embeddings_and_output_weights)
    return "transformer_engine" if untied and patches.covers("fp8_output_layer") else "torch"


def fp8_head_suits(args: argparse.Namespace, lm_head: bool = True) -> bool:
    """Whether the profile's FP8 output layer (`_FP8_HEAD`) fits this run: FP8 training under the delayed recipe,
    GPTModel, a vocabulary head (`lm_head`: not a reward model's) and Transformer Engine's output layer as
    `fp8_head_impl` resolves it, where megatron-core offers it with untied embeddings."""
    from megatron_patch import patches

    return (lm_head and bool(getattr(args, "fp8", None)) and getattr(args, "fp8_recipe", "delayed") == "delayed"
            and getattr(args, "model_class", "gpt") == "gpt" and fp8_head_impl(args) == "transformer_engine"
            and bool(args.untie_embeddings_and_output_weights) and patches.covers("fp8_output_layer"))


def precision_aware_optimizer_suits(args: argparse.Namespace) -> bool:
    """Whether the profile's precision-aware optimizer (`_PRECISION_AWARE`) fits this run: the distributed optimizer
    with Adam, bf16 parameters and fp32 master weights, no FP8, no LoRA adapters, no CPU offload of the optimizer,
    and Transformer Engine installed (its FusedAdam is the one that keeps the remainders)."""
    from megatron_patch.models.build import transformer_engine_available

    return (bool(getattr(args, "use_distributed_optimizer", False)) and getattr(args, "optimizer", "adam") == "adam"
            and bool(getattr(args, "bf16", False)) and not getattr(args, "fp8", None)
            and getattr(args, "lora_rank", None) is None and not getattr(args, "lora_import", None)
            and not getattr(args, "optimizer_cpu_offload", False) and not getattr(args, "cpu", False)
            and transformer_engine_available())


def apply_throughput_profile(args: argparse.Namespace, given: set[str], model: Mapping[str, Any] | None = None,
                             lm_head: bool = True) -> dict:
    """`--throughput-profile`: the settings of the profile that the command line did not set itself.
    Returns {argument: value} as applied. The data loader's attention mask is dropped only where nothing
    reads it: Transformer Engine's causal kernels ignore it, unless documents are masked apart
    (--reset-attention-mask). Attention runs on FlashAttention-4 where `flash_attention_suits` the run
    (`model`: the family's TransformerConfig arguments) and `te_runs_fa4_on_hopper`; the output layer in FP8
    where `fp8_head_suits` it (`lm_head`: the model's output layer is the vocabulary's); the precision-aware
    optimizer where `precision_aware_optimizer_suits` the run."""
    if args.throughput_profile == "none":
        return {}
    settings = list(_NEUTRAL)
    if args.transformer_impl == "transformer_engine" and not args.reset_attention_mask:
        settings.append(("create_attention_mask_in_dataloader", False, "--no-create-attention-mask-in-dataloader"))
    if (model is not None and "--attention-backend" not in given and flash_attention_suits(args, model)
            and te_runs_fa4_on_hopper()):
        from megatron.core.transformer.enums import AttnBackend

        settings.append(("attention_backend", AttnBackend.flash, "--attention-backend"))
    if not given & _CROSS_ENTROPY_FLAGS:
        settings.append(("lean_cross_entropy", True, "--lean-cross-entropy"))
    settings.append(_WGRAD)
    if fp8_head_suits(args, lm_head):
        settings.append(_FP8_HEAD)
    if precision_aware_optimizer_suits(args):
        settings.append(_PRECISION_AWARE)
    if args.throughput_profile == "benchmark":
        settings += _UNCHECKED
    if "--manual-gc" in given:  # the user's own GC setting, interval included
        settings = [s for s in settings if s[0] != "manual_gc_interval"]
    applied = {}
    for key, value, flag in settings:
        if flag not in given and "--no-" + flag[2:] not in given:  # (--flag or --no-flag: the user's)
            setattr(args, key, value)
            applied[key] = value
    return applied
