"""Training throughput on the GPU machine: our pretrain path (`python -m megatron_patch.pretrain`,
Transformer Engine, bf16 and fp8) vs a plain HF `transformers` training step (bf16 weights, sdpa
attention, fused AdamW) on the same LLaMA shape, in the same run. Prints a table (docs/benchmarks.md).

    python benchmarks/train_bench.py [--shapes 1b 8b] [--iters 30] [--runs bf16 fp8 ...]

Runs (`--runs`, names from RUNS): "bf16" and "fp8" are our path with its defaults; the others add or
remove one Megatron flag each, to show what each costs or buys.

TFLOP/s use Megatron's formula (`megatron.training.training.num_floating_point_operations`, which
counts the causal attention and the output layer) for both sides, so the columns compare directly;
tokens/s and peak GPU memory are measured. Our side runs one process, mock data, no checkpointing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {  # LLaMA widths; the 8B width keeps 8 of its 32 layers so one GPU holds model + Adam state
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, seq=4096, mbs=2),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
               num_key_value_heads=8, seq=8192, mbs=1),
}
VOCAB = 128256


RUNS = {  # name -> (precision, extra Megatron flags)
    "bf16": ("bf16", []),
    "fp8": ("fp8", []),
    "bf16 no-wgrad-fusion": ("bf16", ["--no-gradient-accumulation-fusion"]),
    "bf16 no-mask": ("bf16", ["--no-create-attention-mask-in-dataloader"]),
    "bf16 ce-fusion": ("bf16", ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"]),
    "fp8 ce-fusion": ("fp8", ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"]),
    "fp8 tensorwise ce-fusion": ("fp8", ["--fp8-recipe", "tensorwise", "--cross-entropy-loss-fusion",
                                         "--cross-entropy-fusion-impl", "native"]),
}


def config(shape: str) -> dict:
    s = SHAPES[shape]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
            "hidden_size": s["hidden_size"], "intermediate_size": s["intermediate_size"],
            "num_hidden_layers": s["num_hidden_layers"], "num_attention_heads": s["num_attention_heads"],
            "num_key_value_heads": s["num_key_value_heads"], "max_position_embeddings": s["seq"],
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu"}


def flops_per_iteration(shape: str) -> float:
    """Megatron's count for one iteration of batch mbs x seq (forward + backward)."""
    from megatron.training.arguments import parse_args
    from megatron.training.training import num_floating_point_operations

    s = SHAPES[shape]
    h, heads, groups = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"]
    argv, sys.argv = sys.argv, [sys.argv[0]]
    try:
        args = parse_args()  # megatron's defaults for every field its formula reads
    finally:
        sys.argv = argv
    args.__dict__.update(num_layers=s["num_hidden_layers"], hidden_size=h, ffn_hidden_size=s["intermediate_size"],
                         num_attention_heads=heads, num_query_groups=groups, group_query_attention=True,
                         kv_channels=h // heads, seq_length=s["seq"], padded_vocab_size=VOCAB, swiglu=True)
    return float(num_floating_point_operations(args, s["mbs"]))


def ours(shape: str, precision: str, iters: int, tmp: str, extra: list[str]) -> dict:
    s = SHAPES[shape]
    path = os.path.join(tmp, f"{shape}.json")
    with open(path, "w") as f:
        json.dump(config(shape), f)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "-m", "megatron_patch.pretrain",
           "--hf-config", path, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
           "--seq-length", str(s["seq"]), "--micro-batch-size", str(s["mbs"]), "--global-batch-size", str(s["mbs"]),
           "--train-iters", str(iters), "--lr", "1e-4", "--precision", precision, "--transformer-impl",
           "transformer_engine", "--log-interval", "1", "--log-throughput",
           "--eval-iters", "0", "--eval-interval", "100000", "--use-distributed-optimizer",
           "--attention-backend", "auto", "--make-vocab-size-divisible-by", "128", *extra]
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONPATH": ROOT + ":" + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    text = p.stdout + p.stderr
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", text)]
    mem = [float(x) for x in re.findall(r"max allocated: ([0-9.]+)", text)]
    if p.returncode or len(ms) < 4:
        return {"error": text[-2000:]}
    step = sorted(ms[len(ms) // 2:])[len(ms[len(ms) // 2:]) // 2] / 1000  # median of the second half
    losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", text)]
    return {"s_per_iter": step, "peak_gb": max(mem) / 1024 if mem else None, "last_loss": losses[-1] if losses else None}


def hf(shape: str, iters: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    s = SHAPES[shape]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config(shape)), attn_implementation="sdpa",
                                             dtype=torch.bfloat16).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, VOCAB, (s["mbs"], s["seq"]), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    half = sorted(times[len(times) // 2:])
    out = {"s_per_iter": half[len(half) // 2], "peak_gb": torch.cuda.max_memory_allocated() / 2**30}
    del model, opt
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=sorted(SHAPES))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--runs", nargs="+", default=["bf16", "fp8"], choices=sorted(RUNS))
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in a.shapes:
            flops = flops_per_iteration(shape)
            tokens = SHAPES[shape]["mbs"] * SHAPES[shape]["seq"]
            results = {"HF transformers bf16": hf(shape, a.iters)}
            for run in a.runs:
                precision, extra = RUNS[run]
                results[f"ours {run}"] = ours(shape, precision, a.iters, tmp, extra)
                print(shape, run, results[f"ours {run}"], flush=True)
            base = results["HF transformers bf16"].get("s_per_iter")
            for name, r in results.items():
                if "error" in r:
                    rows.append({"shape": shape, "run": name, "error": r["error"]})
                    continue
                rows.append({"shape": shape, "run": name, "tokens_per_s": round(tokens / r["s_per_iter"]),
                             "tflops": round(flops / r["s_per_iter"] / 1e12, 1),
                             "vs_hf": round(base / r["s_per_iter"], 3) if base else None,
                             "peak_gb": round(r["peak_gb"], 1) if r["peak_gb"] else None,
                             "last_loss": r.get("last_loss")})
    print("| shape | run | tokens/s | TFLOP/s | × HF | peak GB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['run']} | error | | | |")
        else:
            print(f"| {r['shape']} | {r['run']} | {r['tokens_per_s']} | {r['tflops']} | {r['vs_hf']} | {r['peak_gb']} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
