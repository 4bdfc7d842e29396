"""Generation throughput on the GPU machine: `megatron_patch.inference.generate` (megatron.core.inference,
static batching with a KV cache, Transformer Engine spec) vs HF `generate` (sdpa, its default dynamic
cache) on the same weights, same run. Prints a table (docs/benchmarks.md).

    python benchmarks/generate_bench.py [--shape 1b] [--batches 1 32] [--prompt 512] [--new 256]

LLaMA-3.2-1B widths (hidden 2048, 16 layers, 32 heads / 8 kv heads, vocab 128,256), random bf16 weights
made by transformers and converted in memory. Greedy, no early stop: every sequence produces exactly
`--new` tokens from a random `--prompt`-token prompt. tokens/s = batch x new tokens / wall time of the
whole call (prefill included), after one short warm-up call each; median of `--repeat` calls.
`--shape tiny --impl local --device cpu` runs the script's logic on a CPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=1000),
}


class _Ids:
    """The little megatron's controller asks of a tokenizer when ids go in and out."""

    eod = 0

    def detokenize(self, ids) -> str:
        return ""


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--impl", default="transformer_engine", choices=["transformer_engine", "local"])
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
    from megatron_patch.inference import generate
    from megatron_patch.models import Layout, build_model

    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    s = SHAPES[a.shape]
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **s, "head_dim": s["hidden_size"] // s[
        "num_attention_heads"], "max_position_embeddings": a.prompt + a.new, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu"}
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), attn_implementation="sdpa",
                                          dtype=dtype).to(a.device).eval()
    sd = hf.state_dict()
    model = build_model(cfg, impl=a.impl, dtype=dtype, perform_initialization=False)
    state = hf_to_megatron(make_plan(cfg, Layout(), a.impl), sd.__getitem__, sd.keys(), dtype)[(0, 0, 0)]
    load_rank_state_dict(model, state)
    model.eval()
    rows = []
    for batch in a.batches:
        prompts = torch.randint(0, s["vocab_size"], (batch, a.prompt), device=a.device)
        ids = prompts.tolist()

        def ours(n=a.new):
            return generate(model, _Ids(), ids, n, top_k=1, max_batch_size=batch, stop_id=None)

        def theirs(n=a.new):
            with torch.no_grad():
                return hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                                   min_new_tokens=n, do_sample=False, pad_token_id=0)

        ours(4), theirs(4)  # warm-up
        assert all(len(t) == a.new for t in ours()) and theirs().shape[1] == a.prompt + a.new
        for name, fn in (("HF generate", theirs), ("ours (megatron.core.inference)", ours)):
            seconds = timed(fn, a.device, a.repeat)
            rows.append({"batch": batch, "run": name, "seconds": round(seconds, 3),
                         "tokens_per_s": round(batch * a.new / seconds, 1)})
        rows[-1]["vs_hf"] = round(rows[-2]["seconds"] / rows[-1]["seconds"], 2)
        print(rows[-2:], flush=True)
    print(f"\n{a.shape}, {dtype}, prompt {a.prompt}, {a.new} new tokens, greedy\n")
    print("| batch | run | seconds | tokens/s | × HF |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['run']} | {r['seconds']} | {r['tokens_per_s']} | {r.get('vs_hf', 1.0)} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
