"""Training throughput on the GPU machine: our pretrain path (`python -m megatron_patch.pretrain`,
Transformer Engine) next to HF `transformers` and torchtitan on the same LLaMA shape, in the same run, as real
training runs: every side takes a global batch of `--micro-batches` micro-batches per optimizer step (HF and
torchtitan accumulate gradients over them too). Prints a table (docs/benchmarks.md) and one JSON line.

    python benchmarks/train_bench.py [--shapes 1b 8b] [--micro-batches 8] [--iters 12] [--runs bf16 fp8 ...]
        [--hf hf hf-liger hf-compile] [--torchtitan torchtitan torchtitan-eager torchtitan-sac torchtitan-fp8]
        [--losses 20] [--results FILE]
    python benchmarks/train_bench.py --shapes 8b-full --gpus 2 --runs "fp8 tp2" "fp8 pp2" "fp8 dp2"   # 2 GPUs

`--results FILE` keeps each measured row in FILE as it is measured; the same command run again on the same
machine and code takes the rows kept there and measures the rest, so a table longer than one time-limited call
(the GPU machine's 10 minutes) comes from one command run in several calls (`benchmarks/results_file.py`).
`--report FILE` prints such a file's table and measures nothing (no GPU needed: a file brought back from the GPU
machine, whose calls were cut before their table).

Runs (`--runs`, names from RUNS): our path with a throughput profile (`none` = Megatron's defaults,
`default`, `benchmark`) plus at most one more setting, so each row shows what one setting costs or buys
(an ablation, all in one run). HF rows (`--hf`): sdpa attention and fused AdamW, optionally with Liger's
Triton kernels (`hf-liger`, when `liger_kernel` is installed) or `torch.compile` (`hf-compile`).
torchtitan rows (`--torchtitan`, `benchmarks/titan_peer.py`): torchtitan 0.2.x's own Llama-3 Trainer in its
own process (bf16 autocast, fused AdamW, per-block `torch.compile`; `-eager` without compile, `-sac` with its
per-op selective activation checkpointing, `-fp8` with torchao's Float8Linear, tensorwise scaling); a row says
"torchtitan not installed / incompatible: ..." when it cannot run.

`+hybrid` trains megatron-core's HybridModel (`--model-class hybrid`) instead of GPTModel; `+lora` trains LoRA
adapters of rank 16 on every linear with the base frozen (Megatron's FLOP formula counts a full backward pass, so
its TFLOP/s overstates the work a LoRA step does: compare tokens/s and memory).

Measured: the median step time over the second half of the iterations (the first half is warm-up),
tokens/s (the headline), TFLOP/s by Megatron's formula (`megatron.training.training.
num_floating_point_operations`: causal attention and the output layer counted) for every side, peak GPU
memory and resident memory (allocated at the end of an optimizer step: weights, gradients, optimizer state;
ours from Megatron's memory report after iteration 2, with the optimizer state in it). `--losses N` also runs N
iterations of each of our runs from the same seed and reports the largest loss difference to its reference run:
the same-precision `none` run (tuned settings must train the same, up to bf16 noise), or the run LOSS_REFERENCE
names (`+hybrid`: GPTModel at the same settings; HybridModel must train as GPTModel does; a lever not yet in the
profiles, e.g. `fp8 +te-swiglu`: the default profile it would join or leave). LoRA runs have none (they train
other weights).
`--trace RUN` records a PyTorch profiler trace of that run's iterations 6-7 and prints where the time goes
(`benchmarks/trace_summary.py`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {  # LLaMA-3 widths; "8b" keeps 8 of its 32 layers so one GPU holds model + Adam state
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, seq=4096, mbs=2),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
               num_key_value_heads=8, seq=8192, mbs=1),
    "8b-full": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, seq=8192, mbs=1),
}
# Llama-3.2-1B as it is: the output layer shares the word embedding's weight (torchtitan's Llama-3 has no tied form)
SHAPES["1b-tied"] = {**SHAPES["1b"], "tied": True}
VOCAB = 128256
GRAPHS = ["--cuda-graph-impl"]

# name -> (precision, profile, extra Megatron flags, extra environment)
RUNS: dict[str, tuple[str, str, list[str], dict[str, str]]] = {
    "bf16 none": ("bf16", "none", [], {}),
    "bf16 +manual-gc": ("bf16", "none", ["--manual-gc", "--manual-gc-interval", "100"], {}),
    "bf16 +ce-fusion": ("bf16", "none", ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"], {}),
    "bf16 +no-mask": ("bf16", "none", ["--no-create-attention-mask-in-dataloader"], {}),
    "bf16": ("bf16", "default", [], {}),
    "bf16 benchmark": ("bf16", "benchmark", [], {}),
    "bf16 +grad-reduce-bf16": ("bf16", "default", ["--grad-reduce-in-bf16"], {}),
    "bf16 +cudnn-norm": ("bf16", "default", [], {"NVTE_NORM_FWD_USE_CUDNN": "1", "NVTE_NORM_BWD_USE_CUDNN": "1"}),
    "bf16 +graph-local": ("bf16", "benchmark", [*GRAPHS, "local"], {}),
    "bf16 +graph-te": ("bf16", "benchmark", [*GRAPHS, "transformer_engine"], {}),
    "bf16 +graph-full": ("bf16", "benchmark", [*GRAPHS, "full_iteration", "--te-rng-tracker"], {}),
    # the profiles' precision-aware optimizer (the fp32 master weights as bf16 parameter + 16-bit remainder, in the
    # profiles with the distributed optimizer in bf16 since 2026-12-08) left out: plain fp32 master weights
    "bf16 -precision-aware-opt": ("bf16", "default", ["--no-use-precision-aware-optimizer"], {}),
    # the profiles' cross-entropy without an fp32 copy of the logits (training.cross_entropy) left out: megatron-core's
    # fused one instead (the rows `+lean-ce` of 2026-12-05 measured it the other way round, before it was a default)
    "bf16 -lean-ce": ("bf16", "default", ["--no-lean-cross-entropy"], {}),
    # the default profile without its weight-gradient fusion (the output layer's weight gradient accumulated into the
    # fp32 main_grad inside its GEMM, the embedding's rows scattered into it: training.wgrad; 2.7% of the fp8 step in
    # bf16 gradients and adds, 2026-12-05, +2.5% tokens/s in fp8 since; in the profiles since then)
    "bf16 -wgrad-fusion": ("bf16", "default", ["--no-wgrad-fusion-without-apex"], {}),
    # megatron-core's TEFusedMLP (Transformer Engine's op fuser: norm, fc1, SwiGLU, fc2 as one te.ops.Sequential) in
    # place of the compiled SwiGLU between two TE layers (6% of the fp8 step, plus TE's cast of its output)
    "bf16 +fused-mlp": ("bf16", "default", ["--use-transformer-engine-op-fuser"], {}),
    # megatron-core's RoPE on the fused QKV output in one Transformer Engine kernel (no split of QKV before it, no
    # concatenation of its gradients: the copies and concatenations in the profile's elementwise group)
    "bf16 +qkv-rope": ("bf16", "default", ["--fused-single-qkv-rope"], {}),
    # megatron's --use-te-activation-func (our layer specs honour it since 2026-12-05: models.modules.fused_mlp):
    # Transformer Engine's SwiGLU op in place of the compiled SwiGLU, whose backward ran at about half the HBM
    # bandwidth in the fp8 profile of 2026-12-05 (70.5 ms of 2 steps)
    "bf16 +te-swiglu": ("bf16", "default", ["--use-te-activation-func"], {}),
    # the levers not yet measured, together: TE's SwiGLU op and the single-kernel QKV RoPE (until 2026-12-05 this
    # row was TE's fused MLP, which with the weight-gradient fusion measured 589.7 TFLOP/s, +2.3%)
    "bf16 +levers": ("bf16", "default", ["--use-te-activation-func", "--fused-single-qkv-rope"], {}),
    "bf16 mbs2": ("bf16", "default", ["@mbs2"], {}),
    # TE's FlashAttention backend (flash-attn v2 / v3, or v4 where TE takes it: `stage_wheels.sh fa4`) instead of
    # cuDNN's fused attention, whose backward is 3x its forward at 8B (docs/benchmarks.md, ninth session); the
    # profiles take it where TE runs FA4 on Hopper (`training.profiles.flash_attention_suits`), and `+fused-attn`
    # is then the row without it
    "bf16 +flash-attn": ("bf16", "default", ["--attention-backend", "flash"], {}),
    "bf16 +fused-attn": ("bf16", "default", ["--attention-backend", "fused"], {}),
    # issue 29: HybridModel against GPTModel, LoRA against full training (same shape, same run)
    "bf16 +hybrid": ("bf16", "default", ["--model-class", "hybrid"], {}),
    "bf16 +lora": ("bf16", "default", ["@hf-base", "--lora-rank", "16", "--lora-alpha", "32"], {}),
    "fp8 +lora": ("fp8", "default", ["@hf-base", "--lora-rank", "16", "--lora-alpha", "32"], {}),
    "fp8 none": ("fp8", "none", [], {}),
    "fp8": ("fp8", "default", [], {}),
    "fp8 benchmark": ("fp8", "benchmark", [], {}),
    "fp8 tensorwise": ("fp8", "default", ["--fp8-recipe", "tensorwise"], {}),
    "fp8 blockwise": ("fp8", "default", ["--fp8-recipe", "blockwise"], {}),
    "fp8 +grad-reduce-bf16": ("fp8", "default", ["--grad-reduce-in-bf16"], {}),
    "fp8 +param-gather": ("fp8", "default", ["--fp8-param-gather"], {}),
    # Transformer Engine's FusedAdam holding the fp32 master weights as the bf16 parameter and a 16-bit remainder
    # (megatron-core's store_param_remainders): 2 bytes a parameter fewer; bf16 at 8B on one H100 (2026-12-07) the
    # same speed, 5.2 GB less resident memory
    "fp8 +precision-aware-opt": ("fp8", "default", ["--use-precision-aware-optimizer"], {}),
    "fp8 -lean-ce": ("fp8", "default", ["--no-lean-cross-entropy"], {}),
    "fp8 -wgrad-fusion": ("fp8", "default", ["--no-wgrad-fusion-without-apex"], {}),
    # the output layer's three GEMMs in FP8 as well (22% of the fp8 step in bf16 in the profile of 2026-12-05): in the
    # profiles where the convergence study trained it (untied embeddings, delayed recipe); `-fp8-head` leaves it out,
    # `+fp8-head` asks for it where the profile does not give it (tied embeddings: the torch implementation)
    "fp8 -fp8-head": ("fp8", "default", ["--no-fp8-output-layer"], {}),
    "fp8 +fp8-head": ("fp8", "default", ["--fp8-output-layer"], {}),
    # the same three GEMMs by torch._scaled_mm on megatron-core's own output layer (`training.fp8_head`): what
    # `--fp8-output-layer` does for tied embeddings (the `1b-tied` shape), here against TE's on an untied one
    "fp8 +fp8-head-torch": ("fp8", "default", ["--fp8-output-layer", "--fp8-output-layer-impl", "torch"], {}),
    "fp8 +fused-mlp": ("fp8", "default", ["--use-transformer-engine-op-fuser"], {}),
    "fp8 +qkv-rope": ("fp8", "default", ["--fused-single-qkv-rope"], {}),
    "fp8 +te-swiglu": ("fp8", "default", ["--use-te-activation-func"], {}),
    # the levers not yet measured (until 2026-12-05: with TE's fused MLP and the fp8 output layer, 872.4 TFLOP/s)
    "fp8 +levers": ("fp8", "default", ["--use-te-activation-func", "--fused-single-qkv-rope"], {}),
    "fp8 +flash-attn": ("fp8", "default", ["--attention-backend", "flash"], {}),
    "fp8 +fused-attn": ("fp8", "default", ["--attention-backend", "fused"], {}),
    "fp8 +cudnn-norm": ("fp8", "default", [], {"NVTE_NORM_FWD_USE_CUDNN": "1", "NVTE_NORM_BWD_USE_CUDNN": "1"}),
    "fp8 +graph-te": ("fp8", "benchmark", [*GRAPHS, "transformer_engine"], {}),
    "fp8 +graph-full": ("fp8", "benchmark", [*GRAPHS, "full_iteration", "--te-rng-tracker"], {}),
    # two GPUs (--gpus 2): the layouts of the full model
    "bf16 tp2": ("bf16", "default", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], {}),
    "bf16 pp2": ("bf16", "default", ["--pipeline-model-parallel-size", "2"], {}),
    "bf16 dp2": ("bf16", "default", ["--overlap-grad-reduce", "--overlap-param-gather"], {}),
    "fp8 tp2": ("fp8", "default", ["--tensor-model-parallel-size", "2", "--sequence-parallel"], {}),
    "fp8 pp2": ("fp8", "default", ["--pipeline-model-parallel-size", "2"], {}),
    "fp8 dp2": ("fp8", "default", ["--overlap-grad-reduce", "--overlap-param-gather"], {}),
}
# `--losses`: the run a run's losses are compared with, where it is not its precision's `none` run (None: no
# comparison; LoRA trains other weights). The levers against the profile they would join or leave.
LOSS_REFERENCE: dict[str, str | None] = {
    "bf16 +hybrid": "bf16", "bf16 +lora": None, "fp8 +lora": None,
    **{f"{p} {lever}": p for p in ("bf16", "fp8")
       for lever in ("-wgrad-fusion", "+fused-mlp", "+qkv-rope", "+te-swiglu", "+levers")},
    "fp8 -fp8-head": "fp8", "fp8 +fp8-head": "fp8", "fp8 +fp8-head-torch": "fp8", "bf16 -precision-aware-opt": "bf16",
    "fp8 +precision-aware-opt": "fp8"}


def loss_reference(run: str) -> str | None:
    """The run `run`'s losses are compared with under `--losses`."""
    return LOSS_REFERENCE[run] if run in LOSS_REFERENCE else f"{RUNS[run][0]} none"


def with_references(runs: list[str]) -> list[str]:
    """`runs` and the loss references they need, each reference before the runs compared with it."""
    order: list[str] = []

    def visit(run: str) -> None:
        reference = loss_reference(run)
        if reference is not None and reference != run:
            visit(reference)
        if run not in order:
            order.append(run)

    for run in runs:
        visit(run)
    return order

HF_RUNS = ("hf", "hf-liger", "hf-compile")


def config(shape: str | dict) -> dict:
    """The HF config.json of a shape (a SHAPES name or a dict like its entries; one with `num_local_experts`
    is a Mixtral, `vocab` overrides VOCAB)."""
    s = SHAPES[shape] if isinstance(shape, str) else shape
    experts = {k: s[k] for k in ("num_local_experts", "num_experts_per_tok") if k in s}
    arch = ("MixtralForCausalLM", "mixtral") if experts else ("LlamaForCausalLM", "llama")
    return {"architectures": [arch[0]], "model_type": arch[1], "vocab_size": s.get("vocab", VOCAB),
            "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
            "num_hidden_layers": s["num_hidden_layers"], "num_attention_heads": s["num_attention_heads"],
            "num_key_value_heads": s["num_key_value_heads"], "max_position_embeddings": s["seq"],
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": bool(s.get("tied")),
            "hidden_act": "silu",
            **experts}


def flops_per_sample(shape: str | dict) -> float:
    """Megatron's count for one sample of `seq` tokens (forward + backward); `shape` as in `config`."""
    from megatron.training.arguments import parse_args
    from megatron.training.training import num_floating_point_operations

    s = SHAPES[shape] if isinstance(shape, str) else shape
    h, heads, groups = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"]
    argv, sys.argv = sys.argv, [sys.argv[0]]
    try:
        args = parse_args()  # megatron's defaults for every field its formula reads
    finally:
        sys.argv = argv
    args.__dict__.update(num_layers=s["num_hidden_layers"], hidden_size=h, ffn_hidden_size=s["intermediate_size"],
                         num_attention_heads=heads, num_query_groups=groups, group_query_attention=True,
                         kv_channels=h // heads, seq_length=s["seq"], padded_vocab_size=s.get("vocab", VOCAB),
                         swiglu=True)
    if "num_local_experts" in s:  # every layer a mixture of experts, each token routed to top-k of them
        args.__dict__.update(num_experts=s["num_local_experts"], moe_router_topk=s["num_experts_per_tok"],
                             moe_ffn_hidden_size=s["intermediate_size"], moe_layer_freq=1)
    return float(num_floating_point_operations(args, 1))


def our_command(shape: str, run: str, iters: int, micro_batches: int, gpus: int, config_path: str,
                trace_dir: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The pretrain command of one run (mock data, no checkpoint, a log line per iteration). A run marked
    `@hf-base` (LoRA: adapters on a pretrained base) starts from the random HF checkpoint `random_hf` makes
    beside `config_path` instead of the config alone."""
    precision, profile, extra, env = RUNS[run]
    s = SHAPES[shape]
    mbs = 2 * s["mbs"] if "@mbs2" in extra else s["mbs"]
    model = ["--hf-config", config_path]
    if "@hf-base" in extra:
        model = ["--load-hf", os.path.join(os.path.dirname(config_path), f"hf-{shape}")]
    extra = [e for e in extra if e not in ("@mbs2", "@hf-base")]
    model_parallel = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        if flag in extra:
            model_parallel *= int(extra[extra.index(flag) + 1])
    # each model replica takes `micro_batches` micro-batches of the shape's size per optimizer step (a run
    # with twice the micro-batch size takes half as many: the same samples)
    global_batch = micro_batches * s["mbs"] * (gpus // model_parallel)
    return pretrain_command(gpus, model, s["seq"], mbs, global_batch, iters, precision, profile, extra, env,
                            trace_dir=trace_dir)


def pretrain_command(gpus: int, model: list[str], seq: int, mbs: int, global_batch: int, iters: int, precision: str,
                     profile: str, extra: list[str], env: dict[str, str] | None = None, vocab: int = VOCAB,
                     cpu: bool = False, trace_dir: str | None = None) -> tuple[list[str], dict[str, str]]:
    """`python -m megatron_patch.pretrain` under torchrun on mock data (no checkpoint, a log line per
    iteration); `model` is `--hf-config PATH` or `--load-hf DIR`. On GPUs: Transformer Engine and the
    distributed optimizer; `cpu`: `--cpu` (gloo, the local implementation), on a free rendezvous port."""
    # (the attention backend is the profile's: Megatron's automatic choice, or FA4 where the profile takes it)
    device = ["--cpu"] if cpu else ["--transformer-impl", "transformer_engine", "--use-distributed-optimizer"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *(["--standalone"] if cpu else []), "--nproc_per_node",
           str(gpus), "-m", "megatron_patch.pretrain", *model, "--mock-data", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", str(vocab), "--seq-length", str(seq), "--micro-batch-size", str(mbs),
           "--global-batch-size", str(global_batch), "--train-iters", str(iters), "--lr", "1e-4",
           "--min-lr", "1e-5", "--lr-warmup-iters", "2", "--seed", "1234", "--precision", precision,
           "--throughput-profile", profile, "--log-interval", "1", "--log-throughput", "--eval-iters", "0",
           *device, "--make-vocab-size-divisible-by", "128", *extra]
    if trace_dir:  # megatron-core 0.19 writes the trace beside the TensorBoard folder (../torch_profile), 0.18 in it
        cmd += ["--profile", "--use-pytorch-profiler", "--profile-step-start", "6", "--profile-step-end", "8",
                "--pytorch-profiler-collect-shapes", "--tensorboard-dir", os.path.join(trace_dir, "tensorboard")]
    return cmd, run_env(env, cpu)


def run_env(extra: dict[str, str] | None = None, cpu: bool = False) -> dict[str, str]:
    """The environment of a measured training process: this one's, with the project on the path, one CUDA
    connection (Megatron's overlap wants it) and, on a GPU, without TORCHDYNAMO_DISABLE (`torchdynamo_on`:
    megatron-core's fused kernels are compiled)."""
    base = {k: v for k, v in os.environ.items() if cpu or (k, v) != ("TORCHDYNAMO_DISABLE", "1")}
    return {**base, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONPATH": ROOT + ":" + os.environ.get("PYTHONPATH", ""),
            **(extra or {})}


def random_hf(cfg: dict, folder: str) -> str:
    """A random HF checkpoint of an HF config (transformers' own initialisation, seed 0; bf16 on a GPU), made
    once: the `--load-hf` start of LoRA runs here and of scale_bench's loss comparison."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg),
                                                 dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(folder + ".partial")
    os.replace(folder + ".partial", folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return folder


def ours(shape: str, run: str, iters: int, micro_batches: int, gpus: int, tmp: str,
         trace_dir: str | None = None) -> dict:
    path = os.path.join(tmp, f"{shape}.json")
    with open(path, "w") as f:
        json.dump(config(shape), f)
    if "@hf-base" in RUNS[run][2]:
        random_hf(config(shape), os.path.join(tmp, f"hf-{shape}"))
    return run_pretrain(*our_command(shape, run, iters, micro_batches, gpus, path, trace_dir))


def run_pretrain(cmd: list[str], env: dict[str, str]) -> dict:
    """Run one pretrain command; from its log: the median step time of the second half of the iterations,
    peak memory, the global batch and every iteration's loss (or the error)."""
    from megatron_patch.training.log import parse_log

    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    text = p.stdout + p.stderr
    log = parse_log(text)
    ms = log.series("elapsed time per iteration (ms)")
    if p.returncode or len(ms) < 4:
        return {"error": text[-2000:]}
    batch = list(log.series("global batch size").values())
    return {"s_per_iter": log.median("elapsed time per iteration (ms)", 0.5) / 1000,
            "peak_gb": max(log.max_allocated_mb) / 1024 if log.max_allocated_mb else None,
            "resident_gb": log.allocated_mb[-1] / 1024 if log.allocated_mb else None,
            "samples": int(batch[-1]) if batch else None, "losses": list(log.series("lm loss").values())}


def hf(shape: str, variant: str, iters: int, micro_batches: int) -> dict:
    """One HF row in its own process (`--hf-worker`): Liger's kernels patch transformers' Llama classes for the
    whole process, and each row's memory figures are its own. The worker's result, or an error row."""
    cmd = [sys.executable, os.path.abspath(__file__), "--hf-worker", variant, "--shapes", shape, "--iters",
           str(iters), "--micro-batches", str(micro_batches)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    found = re.findall(r"^HF_RESULT (.*)$", p.stdout, re.M)
    return json.loads(found[-1]) if found else {"error": (p.stdout + p.stderr)[-2000:] or f"exit {p.returncode}"}


def hf_measure(shape: str, variant: str, iters: int, micro_batches: int) -> dict:
    """HF transformers with gradient accumulation over `micro_batches` (one optimizer step per iteration), in
    this process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    s = SHAPES[shape]
    if variant == "hf-liger":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as e:
            return {"error": f"liger_kernel not installed: {e}"}
        apply_liger_kernel_to_llama()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config(shape)), attn_implementation="sdpa",
                                             dtype=torch.bfloat16).cuda().train()
    step_model = torch.compile(model) if variant == "hf-compile" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, VOCAB, (s["mbs"], s["seq"]), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times, resident = [], None
    try:
        for _ in range(iters):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(micro_batches):
                (step_model(input_ids=ids, labels=ids).loss / micro_batches).backward()
            opt.step()
            resident = torch.cuda.memory_allocated() / 2**30  # weights, gradients, optimizer state
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    except Exception as e:  # e.g. torch.compile failing on this machine: a row saying so
        return {"error": f"{type(e).__name__}: {e}"[-2000:]}
    finally:
        peak = torch.cuda.max_memory_allocated() / 2**30
        del model, step_model, opt
        torch.cuda.empty_cache()
    half = sorted(times[len(times) // 2:])
    return {"s_per_iter": half[len(half) // 2], "peak_gb": peak, "resident_gb": resident,
            "samples": micro_batches * s["mbs"]}


def loss_difference(losses: list[float], reference: list[float], n: int) -> float | None:
    common = min(len(losses), len(reference), n)
    return max(abs(a - b) for a, b in zip(losses[:common], reference[:common])) if common else None


def versions() -> dict:
    import torch

    out = {"date": datetime.date.today().isoformat(), "torch": torch.__version__}
    for name in ("megatron.core", "transformer_engine", "transformers"):
        try:
            module = __import__(name, fromlist=["__version__"])
            out[name] = getattr(module, "__version__", "?")
        except ImportError:
            pass
    # from their metadata: liger_kernel has no __version__, and importing torchtitan here could fail on an
    # incompatible torch (its row says why); flash-attn-4: whether the profiles' attention could be FA4 on Hopper
    # (`training.profiles.te_runs_fa4_on_hopper`) or fell back to cuDNN's fused attention
    for name in ("liger_kernel", "torchtitan", "flash-attn-4"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    out.setdefault("flash-attn-4", "none")  # said, so that a table says it (a file from before: "?")
    if torch.cuda.is_available():
        out["gpu"] = f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
    return out


def table_row(shape: str, name: str, r: dict, flops: float, gpus: int, hf_rate: float | None) -> dict:
    """One row of the table from a side's result (`s_per_iter` for `samples` samples of the shape's `seq`
    tokens, `peak_gb`, `resident_gb`): tokens/s over all GPUs, TFLOP/s per GPU by Megatron's count (`flops` per
    sample, the same for every side), the per-GPU rate relative to HF's, peak memory and (where measured) the
    memory held at the end of an optimizer step: weights, gradients and optimizer state, so that peak − resident
    is what the activations and workspaces of a micro-batch took."""
    rate = r["samples"] * SHAPES[shape]["seq"] / r["s_per_iter"]  # tokens/s
    return {"shape": shape, "run": name, "gpus": gpus, "tokens_per_s": round(rate),
            "tflops_per_gpu": round(flops * r["samples"] / r["s_per_iter"] / 1e12 / gpus, 1),
            "vs_hf": round(rate / gpus / hf_rate, 3) if hf_rate else None,  # per GPU
            "peak_gb": round(r["peak_gb"], 1) if r.get("peak_gb") else None,
            **({"resident_gb": round(r["resident_gb"], 1)} if r.get("resident_gb") else {})}


class ShapeRows:
    """The rows of one shape, each printed as soon as it is measured (a call cut by its time limit keeps what it
    printed): HF's row is the reference of the rows after it; with `losses`, a run's losses are compared with
    its reference run (`loss_reference`), measured before it."""

    def __init__(self, shape: str, flops: float, gpus: int, losses: int, rows: list[dict]):
        self.shape, self.flops, self.gpus, self.losses, self.rows = shape, flops, gpus, losses, rows
        self.results: dict[str, dict] = {}
        self.hf_rate: float | None = None

    def add(self, name: str, result: dict) -> None:
        self.results[name] = result
        if "error" in result:
            row = {"shape": self.shape, "run": name, "error": result["error"][-300:]}
        else:
            row = table_row(self.shape, name, result, self.flops, self.gpus if name.startswith("ours") else 1,
                            self.hf_rate)
            if name == "hf":
                self.hf_rate, row["vs_hf"] = row["tokens_per_s"], 1.0
            if "titan_log" in result:  # torchtitan's own last log line (its tokens/s and MFU)
                row["torchtitan_log"] = result["titan_log"]
            if result.get("gpu_clock"):
                row["gpu_clock"] = result["gpu_clock"]
            if self.losses and result.get("losses"):  # shown, so a difference can be read (where runs part)
                row["losses"] = [round(v, 4) for v in result["losses"][:self.losses]]
            reference = loss_reference(name[5:]) if name.startswith("ours ") else None
            if self.losses and reference not in (None, name[5:]):
                ref = self.results.get(f"ours {reference}", {}).get("losses", [])
                row["loss_reference"] = reference
                row["max_loss_diff"] = loss_difference(result.get("losses", []), ref, self.losses)
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def _loss_cell(row: dict) -> str:
    """The largest loss difference to two significant figures (the losses themselves are logged to 4-5)."""
    if "max_loss_diff" not in row:
        return ""
    diff = row["max_loss_diff"]
    return f"{'n/a' if diff is None else f'{diff:.2g}'} (vs {row['loss_reference']})"


def _clock_cell(row: dict) -> str:
    """The median SM clock and power while the row ran, and the reasons that lowered the clock with their share of
    the busy samples (`machine.summarise_clocks`): "1,755 MHz, 690 W (power cap 85%)"."""
    c = row.get("gpu_clock")
    if not c:
        return ""
    slowed = ", ".join(f"{name} {share:.0%}" for name, share in c.get("slowed", {}).items())
    return f"{c['sm_mhz']:,} MHz, {c['power_w']} W" + (f" ({slowed})" if slowed else "")


def torchdynamo_on(argv: list[str]) -> None:
    """Restart this script without TORCHDYNAMO_DISABLE where it is set (the GPU suite's environment sets it):
    megatron-core fuses SwiGLU, bias-dropout-add and more through `torch.compile` (its `jit_fuser`), which the
    variable turns into unfused torch ops (~12% of an 8B bf16 step, measured 2026-12-02), and the HF / torchtitan
    compile rows would not compile. A user's run has dynamo on: so do the measured rows."""
    if os.environ.get("TORCHDYNAMO_DISABLE") != "1":  # torch reads only "1" as off
        return
    del os.environ["TORCHDYNAMO_DISABLE"]
    print("note: TORCHDYNAMO_DISABLE unset for the benchmark (megatron-core's fused kernels need torch.compile)",
          file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *argv])


def main() -> None:
    torchdynamo_on(sys.argv[1:])
    import titan_peer  # beside this script: the torchtitan rows
    from machine import GpuClocks, code_hash, machine  # beside this script
    from results_file import ResultsFile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=sorted(SHAPES))
    ap.add_argument("--iters", type=int, default=12, help="optimizer steps per run (the first half is warm-up)")
    ap.add_argument("--micro-batches", type=int, default=8, help="micro-batches per optimizer step, every side")
    ap.add_argument("--gpus", type=int, default=1, help="processes of our runs (layout runs need 2)")
    ap.add_argument("--runs", nargs="+", default=["bf16", "fp8"], choices=sorted(RUNS))
    ap.add_argument("--hf", nargs="+", default=["hf"], choices=[*HF_RUNS, "none"], help="HF rows (none: skip HF)")
    ap.add_argument("--torchtitan", nargs="+", default=["torchtitan"], choices=[*sorted(titan_peer.TITAN_RUNS), "none"],
                    help="torchtitan rows (none: skip torchtitan)")
    ap.add_argument("--losses", type=int, default=0,
                    help="also compare the first N iterations' losses with each run's reference run (the same "
                         "precision's 'none' run, or LOSS_REFERENCE's)")
    ap.add_argument("--trace", choices=sorted(RUNS), help="record and summarise a profiler trace of this run")
    ap.add_argument("--results", metavar="FILE",
                    help="keep each measured row in FILE (JSON lines) and take the rows kept there by an earlier "
                         "call of the same command on the same machine and code: one table over several "
                         "time-limited calls (benchmarks/results_file.py)")
    ap.add_argument("--report", metavar="FILE", help="print the table of a --results FILE and measure nothing (no "
                                                      "GPU needed)")
    ap.add_argument("--dry-run", action="store_true", help="print our runs' commands, run nothing")
    ap.add_argument("--hf-worker", choices=HF_RUNS, help=argparse.SUPPRESS)  # one HF row (hf() starts it)
    a = ap.parse_args()
    if a.report:
        report(a.report)
        return
    if a.hf_worker:
        print("HF_RESULT " + json.dumps(hf_measure(a.shapes[0], a.hf_worker, a.iters, a.micro_batches)), flush=True)
        return
    a.hf, a.torchtitan = ([n for n in names if n != "none"] for names in (a.hf, a.torchtitan))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if a.dry_run:
            for shape in a.shapes:
                for run in a.runs:
                    print(" ".join(our_command(shape, run, a.iters, a.micro_batches, a.gpus,
                                               os.path.join(tmp, f"{shape}.json"))[0]))
                for name in a.torchtitan if not SHAPES[shape].get("tied") else ():
                    print(shlex.join(titan_peer.command(SHAPES[shape], VOCAB, name, a.iters, a.micro_batches)))
            return
        meta = versions()
        where = {"machine": machine(), "code": code_hash()}  # which card, which code
        print(json.dumps({**meta, **where}), flush=True)
        kept = ResultsFile(a.results, {**where, "versions": {
            k: v for k, v in meta.items() if k != "date"}, "settings": {
            "iters": a.iters, "micro_batches": a.micro_batches, "gpus": a.gpus, "losses": a.losses}})

        def add(shape_rows: ShapeRows, name: str, measure, *args) -> None:  # measured, or kept by an earlier call
            def clocked() -> dict:  # the GPUs' clocks while it ran (a row at a lowered clock reads as such)
                with GpuClocks() as clocks:
                    result = measure(*args)
                return {**result, "gpu_clock": clocks.summary} if clocks.summary else result

            shape_rows.add(name, kept.measured(f"{shape_rows.shape}|{name}", clocked))

        for shape in a.shapes:
            flops = flops_per_sample(shape)
            shape_rows = ShapeRows(shape, flops, a.gpus, a.losses, rows)
            for name in a.hf:
                add(shape_rows, name, hf, shape, name, a.iters, a.micro_batches)
            for name in a.torchtitan:
                if SHAPES[shape].get("tied"):
                    shape_rows.add(name, {"error": "torchtitan's Llama-3 model has no tied embeddings"})
                    continue
                add(shape_rows, name, titan_peer.run, SHAPES[shape], VOCAB, name, a.iters, a.micro_batches)
            runs = list(a.runs)
            if a.losses:  # the references of the loss comparison, measured first
                runs = with_references(runs)
            for run in runs:
                add(shape_rows, f"ours {run}", ours, shape, run, max(a.iters, a.losses), a.micro_batches, a.gpus, tmp)
            if a.trace:
                from trace_summary import summarise_folder  # beside this script

                trace_dir = os.path.join(tmp, "trace")
                ours(shape, a.trace, 8, a.micro_batches, a.gpus, tmp, trace_dir)
                print(json.dumps({"shape": shape, "trace": a.trace, "where": summarise_folder(trace_dir)}), flush=True)
    print_table(meta, rows, a.micro_batches)


def print_table(meta: dict, rows: list[dict], micro_batches: int) -> None:
    """The table of `rows` (ShapeRows' rows) under a line of `meta` (versions(): date, GPU, versions), then the
    rows and meta as one JSON line."""
    print(f"{meta['date']}, {meta.get('gpu')}, torch {meta['torch']}, megatron-core {meta.get('megatron.core')}, "
          f"TE {meta.get('transformer_engine')}, transformers {meta.get('transformers')}, "
          f"torchtitan {meta.get('torchtitan')}, FA4 {meta.get('flash-attn-4', '?')}; "
          f"{micro_batches} micro-batches per step")
    print("| shape | run | tokens/s | TFLOP/s per GPU | × HF | peak GB | resident GB | max Δloss (vs) | SM clock |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            last = r["error"].splitlines()[-1] if r["error"] else ""
            print(f"| {r['shape']} | {r['run']} | error: {last} | | | | | | |")
        else:
            print(f"| {r['shape']} | {r['run']} | {r['tokens_per_s']:,} | {r['tflops_per_gpu']} | {r['vs_hf'] or ''} | "
                  f"{r['peak_gb']} | {r.get('resident_gb', '')} | {_loss_cell(r)} | {_clock_cell(r)} |")
    print(json.dumps({"meta": meta, "rows": rows}))


def report(path: str) -> None:
    """`--report FILE`: the table of a results file (`--results`), its rows in the order they were measured, HF's
    row first in each shape (the × HF reference), the losses compared as the measuring call compared them; the
    date is the file's last change."""
    import io
    from contextlib import redirect_stdout

    from results_file import read  # beside this script

    identity, results = read(path)
    settings, meta = identity.get("settings", {}), dict(identity.get("versions", {}))
    meta["date"] = datetime.date.fromtimestamp(os.path.getmtime(path)).isoformat()
    rows: list[dict] = []
    by_shape: dict[str, list[str]] = {}
    for key in results:
        shape, _, name = key.partition("|")
        if shape not in SHAPES:
            raise SystemExit(f"error: {path}: row {key!r}: unknown shape {shape!r}")
        by_shape.setdefault(shape, []).append(name)
    for shape, names in by_shape.items():
        shape_rows = ShapeRows(shape, flops_per_sample(shape), settings.get("gpus", 1), settings.get("losses", 0), rows)
        with redirect_stdout(io.StringIO()):  # the rows' JSON lines: the table below has them
            for name in sorted(names, key=lambda n: n != "hf"):
                shape_rows.add(name, results[f"{shape}|{name}"])
    print_table(meta, rows, settings.get("micro_batches", 8))


if __name__ == "__main__":
    main()
