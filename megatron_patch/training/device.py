"""The machine a run trains on: a CUDA GPU, or `--cpu` (megatron-core's local implementation over gloo, with the
`cpu_training` patch), and `--precision` (bf16 / fp16 / fp32, or fp8: Transformer Engine on a GPU with FP8),
checked before any GPU work starts. Each refusal is a ValueError naming the flag."""

from __future__ import annotations

import argparse
import os
import sys

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")

# What --cpu sets: Megatron's flags for megatron-core on a CPU (its fused kernels are CUDA-only)
CPU_FLAGS = ("--transformer-impl local", "--use-cpu-initialization", "--distributed-backend gloo",
             "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-persist-layer-norm",
             "--no-rope-fusion", "--no-bias-swiglu-fusion", "--no-bias-gelu-fusion")
_CPU_VALUES = dict(transformer_impl="local", use_cpu_initialization=True, distributed_backend="gloo",
                   gradient_accumulation_fusion=False, masked_softmax_fusion=False, no_persist_layer_norm=True,
                   apply_rope_fusion=False, bias_swiglu_fusion=False, bias_gelu_fusion=False)

# megatron-core fuses SwiGLU, bias-dropout-add, ... through torch.compile (its jit_fuser); under this variable they
# run as unfused torch ops: 11-15% of an 8B bf16 step on an H200 (docs/benchmarks.md, 2026-12-02)
DYNAMO_OFF_WARNING = ("warning: TORCHDYNAMO_DISABLE=1 turns off torch.compile, so megatron-core's fused SwiGLU and "
                      "bias-dropout-add run as unfused ops (about 12% slower at 8B); unset it to train at full speed")


def select_device(args: argparse.Namespace, given: set[str]) -> None:
    """A CUDA GPU, or `--cpu`: the `cpu_training` patch and Megatron's CPU flags (`CPU_FLAGS`), refusing
    what cannot run on a CPU. The CPU test harness applies the patch itself (and passes the flags)."""
    import torch

    from megatron_patch import patches

    if args.cpu:
        if torch.cuda.is_available():
            raise ValueError("--cpu: a CUDA GPU is visible to this process (CUDA was initialised before --cpu "
                             "could hide it); run with CUDA_VISIBLE_DEVICES= to train on the CPU")
        patches.require("cpu_training", "--cpu")
    elif not torch.cuda.is_available() and not patches.is_active("cpu_training"):
        raise ValueError("no CUDA GPU found; pass --cpu to run a tiny model on the CPU")
    elif torch.cuda.is_available() and os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        if os.environ.get("RANK", "0") == "0":
            print(DYNAMO_OFF_WARNING, file=sys.stderr, flush=True)
    if not patches.is_active("cpu_training"):
        return
    refused = [
        (f"--transformer-impl {args.transformer_impl}",
         args.transformer_impl != "local" and "--transformer-impl" in given),
        (f"--distributed-backend {args.distributed_backend}",
         args.distributed_backend != "gloo" and "--distributed-backend" in given),
        ("--precision fp8", args.precision == "fp8"),
        (f"--fp8-format {getattr(args, 'fp8', None)}", bool(getattr(args, "fp8", None))),
        ("--sequence-parallel", args.sequence_parallel),
        ("--use-transformer-engine-op-fuser", getattr(args, "use_transformer_engine_op_fuser", False)),
        ("--use-te-activation-func", getattr(args, "use_te_activation_func", False)),
        # it trains, but its checkpoints do not load back without TE's or Apex's Adam
        ("--use-distributed-optimizer", args.use_distributed_optimizer),
    ]
    for shown, bad in refused:
        if bad:
            raise ValueError(f"{shown} cannot run on the CPU (--cpu trains megatron-core's local implementation "
                             "over gloo, in fp32, bf16 or fp16, without Transformer Engine, fp8, sequence "
                             "parallelism or the distributed optimizer)")
    for key, value in _CPU_VALUES.items():
        if key == "gradient_accumulation_fusion" and getattr(args, "wgrad_fusion_without_apex", False):
            continue  # ours runs on a CPU too (training.wgrad), in place of Apex's CUDA kernel
        setattr(args, key, value)
    if "--num-workers" not in given:
        args.num_workers = 0  # data-loader processes would compete with training for the cores


def apply_precision(args: argparse.Namespace) -> None:
    """`--precision` -> Megatron's flags; fp8 needs Transformer Engine and a GPU that has FP8 (Hopper,
    Ada, Blackwell), checked here, before any GPU work starts."""
    if args.precision is None:
        return
    args.bf16 = args.precision in ("bf16", "fp8")
    args.fp16 = args.precision == "fp16"
    if args.precision != "fp8":
        args.fp8 = None
        return
    import torch

    from megatron_patch.models.build import transformer_engine_available

    if not transformer_engine_available():
        raise ValueError("--precision fp8 needs Transformer Engine; install megatron_patch[te]")

    if not torch.cuda.is_available():
        raise ValueError("--precision fp8 needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise ValueError(f"--precision fp8 needs a GPU with FP8 (compute capability >= 8.9); "
                         f"{torch.cuda.get_device_name()} is {major}.{minor}")
    args.fp8 = args.fp8 or "hybrid"
    args.transformer_impl = "transformer_engine"
