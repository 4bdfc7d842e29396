"""`--throughput-profile`: Megatron settings that make a training step cheaper. `default` changes the numbers by
no more than bf16 rounding; `benchmark` also skips the per-step safety checks; `none` is Megatron's own defaults.
A flag given on the command line always wins."""

from __future__ import annotations

import argparse

THROUGHPUT_PROFILES = ("none", "default", "benchmark")
# (argument, value, the flag that sets it): settings that leave the numbers as they are (up to bf16 rounding)
_NEUTRAL = (("manual_gc", True, "--manual-gc"), ("manual_gc_interval", 100, "--manual-gc-interval"),
            ("cross_entropy_loss_fusion", True, "--cross-entropy-loss-fusion"),
            ("cross_entropy_fusion_impl", "native", "--cross-entropy-fusion-impl"))
# ... and trade a per-step safety check for speed
_UNCHECKED = (("check_for_nan_in_loss_and_grad", False, "--no-check-for-nan-in-loss-and-grad"),
              ("rerun_mode", "disabled", "--rerun-mode"))


def apply_throughput_profile(args: argparse.Namespace, given: set[str]) -> dict:
    """`--throughput-profile`: the settings of the profile that the command line did not set itself.
    Returns {argument: value} as applied. The data loader's attention mask is dropped only where nothing
    reads it: Transformer Engine's causal kernels ignore it, unless documents are masked apart
    (--reset-attention-mask)."""
    if args.throughput_profile == "none":
        return {}
    settings = list(_NEUTRAL)
    if args.transformer_impl == "transformer_engine" and not args.reset_attention_mask:
        settings.append(("create_attention_mask_in_dataloader", False, "--no-create-attention-mask-in-dataloader"))
    if args.throughput_profile == "benchmark":
        settings += _UNCHECKED
    if "--manual-gc" in given:  # the user's own GC setting, interval included
        settings = [s for s in settings if s[0] != "manual_gc_interval"]
    applied = {}
    for key, value, flag in settings:
        if flag not in given:
            setattr(args, key, value)
            applied[key] = value
    return applied
