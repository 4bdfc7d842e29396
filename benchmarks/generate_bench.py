"""Generation throughput on the GPU machine: `megatron_patch.inference.generate` on megatron-core's dynamic
inference engine (continuous batching, paged KV cache, CUDA graphs) and on its static one, next to HF
`generate` on the same weights, in the same run. Prints a table (docs/benchmarks.md) and one JSON line.

    python benchmarks/generate_bench.py [--shapes 1b 8b] [--requests 1 32 256] [--new 256] \\
        [--min-prompt 128] [--max-prompt 1024] [--prompts prompts.jsonl] [--hf hf hf-static-compile]
    python benchmarks/generate_bench.py --shapes tiny --device cpu --impl local --dtype fp32 \\
        --requests 1 3 --new 4 --min-prompt 4 --max-prompt 12 --repeat 1 --hf hf       # the logic, on a CPU

Shapes: LLaMA-3 widths (`1b`: Llama-3.2-1B, hidden 2048, 16 layers, tied embeddings; `8b`: Llama-3.1-8B,
hidden 4096, 32 layers), vocab 128,256; multi-latent attention at DeepSeek-V2-Lite's widths (`v2-lite`, 27
layers, 64 experts, with a query latent); a mixture of experts at Mixtral-8x7B's widths with 8 of its 32 layers
(`mixtral-8l`; `--moe-dispatch`: the engine's own choice, `auto`, or its MoE layers always dropless on grouped
GEMMs or always on megatron-core's dispatchers, padded under CUDA graphs; each row names the path it ran, from
the engine's plan); random bf16 weights
made by transformers and converted in memory. On a GPU the dynamic engine runs multi-latent attention with CUDA
graphs of its decode steps, as `generate` does by default since 2026-12-05; `--no-mla-graphs` leaves the graphs
out (`dynamic.MLA_GRAPHS`), `--no-mla-gpu` puts DeepSeek's models on the static engine as before
(`dynamic.MLA_ON_GPU`). Multi-latent attention's RoPE runs in one kernel (`decode_rope.MLA_ROPE`) and MoE
routers on Transformer Engine's fused top-k (`dynamic.MOE_ROUTER_FUSION`), by default since 2026-12-05 (v2-lite,
one request: 8.28 -> 6.71 ms a token); `--no-mla-rope` / `--no-moe-router-fusion` leave them out. (`--mla-gpu`,
`--mla-graphs`, `--mla-rope` and `--moe-router-fusion`, which switched them on before, are still accepted.)
`--te-swiglu` builds our model with Megatron's `--use-te-activation-func` (Transformer Engine's SwiGLU op, one
kernel a layer where megatron-core's unfused SwiGLU runs two): the rows read "TE SwiGLU".
Requests: a JSONL file of prompts (`{"prompt_ids": [...]}`, random token ids, lengths uniform in
[--min-prompt, --max-prompt], seed 0; written to --prompts if that file does not exist, else read from it);
a row with N requests takes the file's first N. Greedy, no early stop: every request produces exactly
--new tokens.

Rows for N requests: ours, all N queued in one `generate` call with N in flight (`--cuda-graph-impl`:
graphs on or off); `hf`: HF `generate` on the N prompts as one left-padded batch (sdpa, dynamic cache);
`hf-static-compile`: the same with `cache_implementation="static"`, for which HF `generate` compiles the
decode steps itself (`torch.compile(mode="reduce-overhead")`; the row's `compiled` says whether it did), skipped
with the reason when it fails. tokens/s = N x --new /
wall time of the call (prefill included), median of --repeat after one warm-up call of the same shape.
At N = 1 each side is also timed for a single new token, and ms per decoded token = (time for --new tokens -
time for 1) / (--new - 1), next to the memory-bandwidth bound: the bytes a decode step must read (every
weight but the input embedding table, of which one row is read; the KV cache is small at N = 1) divided
by --bandwidth-tb-s (default: the GPU's own, by its name: 4.8 for the H200, 3.35 for the H100). Peak memory:
torch.cuda.max_memory_allocated during the call. `--results FILE` keeps each row in FILE as it is measured; the same
command run again on the same machine and code takes the rows kept there and measures the rest (a shape whose rows
are all kept is not even built): one table over several time-limited calls (benchmarks/results_file.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import importlib.metadata
import json
import os
import random
import time
from collections.abc import Iterator

import torch
from machine import bandwidth_tb_s, code_hash, machine  # beside this script
from results_file import ResultsFile

# DeepSeek-V2-Lite's rotary embedding (its config.json): YaRN, as every released DeepSeek MLA model rotates
V2_LITE_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
SHAPES = {  # LLaMA-3 widths, and DeepSeek's where a shape names its model type
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True),
    # multi-latent attention at DeepSeek-V2-Lite's widths (15.7B parameters, 2.4B active; latent 512 + rope 64 a
    # token) with DeepSeek-V2's query latent of 1536: V2-Lite has none, which megatron-core 0.19's MLA cannot build
    "v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048,
                    intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                    num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, num_experts_per_tok=6,
                    n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512,
                    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, topk_method="greedy", n_group=1,
                    topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, vocab_size=102400,
                    rope_theta=10000.0, rope_scaling=V2_LITE_YARN, max_position_embeddings=163840,
                    tie_word_embeddings=False),
    # Mixtral-8x7B's widths (8 experts of FFN 14336, top-2, vocab 32,000) with 8 of its 32 layers: 11.7B
    # parameters, 3.3B read a token
    "mixtral-8l": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8,
                       num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, rope_theta=1000000.0,
                       tie_word_embeddings=False),
    "tiny-moe": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=64,
                     intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     num_local_experts=4, num_experts_per_tok=2, vocab_size=1000, rope_theta=10000.0,
                     tie_word_embeddings=False),
    "tiny-mla": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=64,
                     intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                     first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
                     qk_nope_head_dim=16, v_head_dim=16, topk_method="greedy", n_group=1, topk_group=1,
                     routed_scaling_factor=1.0, norm_topk_prob=False, vocab_size=1000, rope_theta=10000.0,
                     rope_scaling=V2_LITE_YARN, tie_word_embeddings=False),
}
HF_RUNS = ("hf", "hf-static-compile")


def write_prompts(path: str, count: int, low: int, high: int, vocab: int, seed: int = 0) -> None:
    """`count` prompts of random token ids, lengths uniform in [low, high]."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"prompt_ids": [rng.randrange(vocab) for _ in range(rng.randint(low, high))]}) + "\n")


def read_prompts(path: str, vocab: int) -> list[list[int]]:
    rows = [json.loads(line)["prompt_ids"] for line in open(path) if line.strip()]
    if not rows:
        raise SystemExit(f"error: no prompts in {path}")
    if any(not r or max(r) >= vocab for r in rows):
        raise SystemExit(f"error: {path}: an empty prompt or a token id outside the vocab of {vocab}")
    return rows


def hf_config(shape: str, context: int) -> dict:
    s = SHAPES[shape]
    if "model_type" in s:
        return {**s, "max_position_embeddings": context, "rms_norm_eps": 1e-6, "hidden_act": "silu"}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **s,
            "head_dim": s["hidden_size"] // s["num_attention_heads"], "max_position_embeddings": context,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu"}


def bytes_read_per_decode_step(hf) -> int:
    """Every weight once (tied embeddings once), less the input embedding table when it is a separate
    matrix (a decode step reads one row of it), and of a mixture of experts' routed experts the share one token
    is routed to (`num_experts_per_tok` of them; shared experts whole)."""
    total = sum(p.numel() * p.element_size() for p in hf.parameters())  # parameters() lists a tied weight once
    if not hf.config.tie_word_embeddings:
        emb = hf.get_input_embeddings().weight
        total -= emb.numel() * emb.element_size()
    c = hf.config
    experts = getattr(c, "num_local_experts", None) or getattr(c, "n_routed_experts", None)
    if experts:
        routed = sum(p.numel() * p.element_size() for n, p in hf.named_parameters()
                     if ".experts." in n and "shared_experts" not in n)
        total -= routed - routed * c.num_experts_per_tok // experts
    return total


def versions() -> dict:
    out = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none"}
    for name in ("transformers", "megatron-core", "transformer-engine", "transformer_engine_torch", "flash-attn",
                 "flash-attn-4", "einops"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    from megatron.core.transformer import attention

    out["attention"] = ("flash-attn" if attention.HAVE_FA3 or attention.HAVE_FA4
                        or attention.flash_attn_varlen_func is not None else "torch (paged_attention_in_torch patch)")
    return out


class Timer:
    def __init__(self, device: str, repeat: int):
        self.device, self.repeat = device, repeat

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def __call__(self, fn) -> tuple[float, float | None]:
        """(median seconds of `repeat` calls after one warm-up call, peak GiB allocated during them on a
        GPU)."""
        fn()
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(self.repeat):
            self.sync()
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        peak = torch.cuda.max_memory_allocated() / 1024 ** 3 if self.device == "cuda" else None
        return sorted(times)[len(times) // 2], peak


class _Ids:
    """What megatron's engine asks of a tokenizer when ids go in and out (no stop strings here)."""

    eod = 0

    def detokenize(self, ids, **kwargs) -> str:
        return ""


def run_ids(a) -> list[str]:
    """The rows of each request count, in order: our engines, then HF's rows."""
    return [*a.engines, *(h for h in HF_RUNS if h in a.hf)]


def run_shape(a, shape: str, prompts: list[list[int]], timer: Timer, kept: ResultsFile) -> list[dict]:
    keys = [f"{shape}|{n}|{rid}" for n in a.requests for rid in run_ids(a)]
    if keys and all(kept.get(k) is not None for k in keys):  # every row kept by an earlier call: nothing to build
        rows = [kept.get(k) for k in keys]
        for row in rows:
            print(json.dumps(row), flush=True)
        add_vs_hf(rows)
        return rows
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
    from megatron_patch.conversion.hf_io import checkpoint_state_dict
    from megatron_patch.inference import Sampling, dynamic, generate
    from megatron_patch.inference.dynamic import moe_layers, release_engine
    from megatron_patch.models import Layout, build_model
    from megatron_patch.names import torch_dtype

    dtype = torch_dtype(a.dtype)
    cfg = hf_config(shape, max(len(p) for p in prompts) + a.new)
    torch.manual_seed(0)
    with torch.device(a.device):  # initialised where it runs: an 8B model's random init on the host takes minutes
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), attn_implementation="sdpa",
                                              dtype=dtype).eval()
    sd = checkpoint_state_dict(hf)  # (mixture-of-experts models: through save_pretrained, as released)
    model = build_model(cfg, impl=a.impl, dtype=dtype, perform_initialization=False,
                        **({"use_te_activation_func": True} if a.te_swiglu else {}))
    load_rank_state_dict(model, hf_to_megatron(make_plan(cfg, Layout(), a.impl), sd.__getitem__, sd.keys(), dtype)
                         [(0, 0, 0)])
    model.eval()
    del sd
    graphs = {"local": True, "none": False, None: None}[a.cuda_graph_impl]
    bound_ms = bytes_read_per_decode_step(hf) / (bandwidth(a) * 1e12) * 1e3
    rows = []
    tokenizer = _Ids()  # one object: the dynamic engine is reused while the tokenizer and plan stay (_Engines.get)
    moe = bool(moe_layers(model))
    for n in a.requests:
        batch = prompts[:n]
        padded = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (padded - len(p)) + p for p in batch], device=a.device)
        mask = torch.tensor([[0] * (padded - len(p)) + [1] * len(p) for p in batch], device=a.device)

        def ours(new: int = a.new, engine: str = "dynamic", batch=batch, n=n) -> None:
            out = generate(model, tokenizer, batch, Sampling(new, top_k=1, stop_id=None), max_batch_size=n,
                           cuda_graphs=graphs if engine == "dynamic" else None, engine=engine)
            assert all(len(t) == new for t in out)

        def hf_call(new: int = a.new, ids=ids, mask=mask, padded=padded, **kw) -> None:
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=0, **kw)
            assert out.shape[1] == padded + new

        # (an MoE model's dynamic row names the path the engine's plan takes at this many requests)
        plan = dynamic.plan_engine(model, batch, a.new, max_requests=n, cuda_graphs=graphs) if moe else None
        path = ("" if plan is None else ", dropless MoE" if plan.moe_dropless else
                ", padded MoE" if plan.cuda_graphs else "")
        swiglu = ", TE SwiGLU" if a.te_swiglu else ""
        runs = {engine: (f"ours ({engine} engine{path if engine == 'dynamic' else ''}{swiglu})",
                         lambda new=a.new, engine=engine: ours(new, engine)) for engine in a.engines}
        runs["hf"] = ("HF generate", hf_call)
        runs["hf-static-compile"] = ("HF static cache + torch.compile",
                                     lambda new=a.new: hf_call(new, cache_implementation="static"))
        for rid in run_ids(a):
            name, fn = runs[rid]
            row = kept.measured(f"{shape}|{n}|{rid}", lambda name=name, fn=fn, n=n: measure_row(
                a, timer, shape, n, name, fn, bound_ms, hf), failed="skipped")
            rows.append(row)
            print(json.dumps(row), flush=True)
        release_engine()
    add_vs_hf(rows)
    return rows


def measure_row(a, timer: Timer, shape: str, n: int, name: str, fn, bound_ms: float, hf) -> dict:
    """One row: `fn(new)` timed (and at one request `fn(1)`, for ms per decoded token); a row that cannot run says
    why (`skipped`), the others go on."""
    row = {"shape": shape, "requests": n, "run": name}
    try:
        seconds, peak = timer(fn)
        one = timer(lambda: fn(1))[0] if n == 1 else None
        row.update(timing_fields(n, a.new, seconds, one, bound_ms), peak_gib=None if peak is None else round(peak, 2))
        if name.startswith("HF static"):
            row["compiled"] = hf_compiled(hf)
    except Exception as e:  # a row that cannot run says why, the others go on
        row["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return row


def bandwidth(a) -> float:
    """--bandwidth-tb-s, or the GPU's own (benchmarks/machine.py) where not given."""
    return bandwidth_tb_s(a.bandwidth_tb_s, a.device == "cuda")


def hf_compiled(hf) -> bool:
    """Whether HF `generate` ran its decode steps compiled: with a static cache on a GPU it compiles the forward
    itself (`get_compiled_call`, `torch.compile(mode="reduce-overhead")`: its supported path; compiling
    `hf.forward` by hand as well compiled the prefill too and failed with "accessing tensor output of CUDAGraphs
    that has been overwritten", 2026-12-02). False where dynamo is off (TORCHDYNAMO_DISABLE=1): the row then
    measures the static cache alone."""
    import torch._dynamo.config

    return hasattr(hf, "_compiled_call") and not torch._dynamo.config.disable


def timing_fields(requests: int, new: int, seconds: float, one_token_seconds: float | None,
                  bound_ms: float) -> dict:
    """A row's timing columns from its measured times: `seconds` (the call for `new` tokens per request),
    tokens/s, and with `one_token_seconds` (the same call for a single token, timed at N = 1) ms per decoded
    token = (seconds - one_token_seconds) / (new - 1) next to the bandwidth bound `bound_ms`. Arithmetic
    only, so that it is tested on given numbers: a measured time has no guaranteed sign or size (on a busy
    CPU the one-token call can outlast the longer one, and ms per token comes out negative: reported as
    measured, not hidden)."""
    row = {"seconds": round(seconds, 3), "tokens_per_s": round(requests * new / seconds, 1)}
    if one_token_seconds is not None:
        row["ms_per_token"] = float(f"{(seconds - one_token_seconds) / (new - 1) * 1e3:.4g}")
        row["bound_ms"] = float(f"{bound_ms:.4g}")
    return row


def add_vs_hf(rows: list[dict]) -> None:
    """Each timed row's speed relative to the HF generate row of the same request count (`vs_hf`: HF's
    seconds / the row's; > 1 is faster than HF), where that HF row ran."""
    base = {r["requests"]: r for r in rows if r["run"] == "HF generate" and "seconds" in r}
    for r in rows:
        if r["requests"] in base and "seconds" in r:
            r["vs_hf"] = round(base[r["requests"]]["seconds"] / r["seconds"], 2)


def table(rows: list[dict]) -> str:
    lines = ["| shape | requests | run | seconds | tokens/s | × HF | ms/token (N=1) | bound ms | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['requests']} | {r['run']} | skipped: {r['skipped']} | | | | | |")
            continue
        lines.append(f"| {r['shape']} | {r['requests']} | {r['run']} | {r['seconds']} | {r['tokens_per_s']:,} | "
                     f"{r.get('vs_hf', '')} | {r.get('ms_per_token', '')} | {r.get('bound_ms', '')} | "
                     f"{'' if r['peak_gib'] is None else r['peak_gib']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["1b", "8b"], choices=sorted(SHAPES), help="model widths")
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 32, 256], help="requests per row")
    ap.add_argument("--new", type=int, default=256, help="new tokens per request")
    ap.add_argument("--min-prompt", type=int, default=128, help="shortest prompt, tokens")
    ap.add_argument("--max-prompt", type=int, default=1024, help="longest prompt, tokens")
    ap.add_argument("--prompts", help="JSONL of prompt_ids (written if missing; default: a temporary file)")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per row (median)")
    ap.add_argument("--engines", nargs="+", default=["dynamic", "static"], choices=["dynamic", "static"],
                    help="our rows (the static engine takes minutes at 256 requests: leave it out there)")
    ap.add_argument("--hf", nargs="*", default=list(HF_RUNS), choices=HF_RUNS, help="HF rows")
    ap.add_argument("--impl", default="transformer_engine", choices=["transformer_engine", "local"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--cuda-graph-impl", choices=["local", "none"], default=None,
                    help="our CUDA graphs (default: on a GPU)")
    ap.add_argument("--bandwidth-tb-s", type=float, default=None,
                    help="memory bandwidth for the bound, TB/s (default: the GPU's by its name, benchmarks/machine.py: "
                         "H200 4.8, H100 3.35)")
    ap.add_argument("--no-mla-gpu", action="store_true",
                    help="multi-latent attention (DeepSeek) on the static engine on a GPU (dynamic.MLA_ON_GPU off)")
    ap.add_argument("--no-mla-graphs", action="store_true",
                    help="no CUDA graphs of multi-latent attention's decode steps (dynamic.MLA_GRAPHS off)")
    ap.add_argument("--no-mla-rope", action="store_true",
                    help="multi-latent attention's RoPE unfused, as megatron-core does it (decode_rope.MLA_ROPE off)")
    ap.add_argument("--te-swiglu", action="store_true",
                    help="our model's MLPs with Transformer Engine's SwiGLU op (--use-te-activation-func: one kernel "
                         "where megatron-core's unfused SwiGLU runs two; SwiGLU models under --impl "
                         "transformer_engine). Rows read 'TE SwiGLU'")
    ap.add_argument("--no-moe-router-fusion", action="store_true",
                    help="MoE routers unfused, as megatron-core builds them (dynamic.MOE_ROUTER_FUSION off)")
    # the switches before they were defaults (docs/benchmarks.md): accepted, no effect
    for old in ("--mla-gpu", "--mla-graphs", "--mla-rope", "--moe-router-fusion"):
        ap.add_argument(old, action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--moe-dispatch", choices=["auto", "dropless", "padded"], default="auto",
                    help="MoE layers: auto = the engine's choice (dynamic.MOE_DROPLESS, dynamic.dropless_pays); "
                         "dropless = grouped GEMMs at every request count; padded = megatron-core's dispatchers "
                         "(padded under CUDA graphs). Rows read 'dropless MoE' / 'padded MoE'")
    ap.add_argument("--out", help="also write the rows and versions here as JSON")
    ap.add_argument("--results", metavar="FILE",
                    help="keep each measured row in FILE (JSON lines) and take the rows kept there by an earlier call "
                         "of the same command on the same machine and code (benchmarks/results_file.py)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU here (use --shapes tiny --device cpu --impl local --dtype fp32)")
    if a.te_swiglu and a.impl != "transformer_engine":
        ap.error("--te-swiglu needs --impl transformer_engine (Transformer Engine's op)")
    if min(a.requests) < 1 or a.new < 2 or not 1 <= a.min_prompt <= a.max_prompt:
        ap.error("--requests >= 1, --new >= 2 and 1 <= --min-prompt <= --max-prompt")
    return a


@contextlib.contextmanager
def switches(no_mla_gpu: bool = False, no_mla_graphs: bool = False, no_mla_rope: bool = False,
             no_router_fusion: bool = False) -> Iterator[None]:
    """`dynamic.MLA_ON_GPU`, `dynamic.MLA_GRAPHS`, `decode_rope.MLA_ROPE` and `dynamic.MOE_ROUTER_FUSION` off as
    asked, for the rows; put back after."""
    from megatron_patch.inference import decode_rope, dynamic

    saved = dynamic.MLA_ON_GPU, dynamic.MLA_GRAPHS, decode_rope.MLA_ROPE, dynamic.MOE_ROUTER_FUSION
    dynamic.MLA_ON_GPU, dynamic.MLA_GRAPHS = saved[0] and not no_mla_gpu, saved[1] and not no_mla_graphs
    decode_rope.MLA_ROPE, dynamic.MOE_ROUTER_FUSION = saved[2] and not no_mla_rope, saved[3] and not no_router_fusion
    try:
        yield
    finally:
        dynamic.MLA_ON_GPU, dynamic.MLA_GRAPHS, decode_rope.MLA_ROPE, dynamic.MOE_ROUTER_FUSION = saved


def main(argv: list[str] | None = None) -> dict:
    import tempfile

    a = parse_args(argv)
    vocab = min(SHAPES[s]["vocab_size"] for s in a.shapes)
    with tempfile.TemporaryDirectory() as tmp:
        path = a.prompts or os.path.join(tmp, "prompts.jsonl")
        if not os.path.exists(path):
            write_prompts(path, max(a.requests), a.min_prompt, a.max_prompt, vocab)
        prompts = read_prompts(path, vocab)
    if len(prompts) < max(a.requests):
        raise SystemExit(f"error: {path} has {len(prompts)} prompts, fewer than --requests {max(a.requests)}")
    from megatron_patch.inference import dynamic

    info = versions()
    where = {"machine": machine(), "code": code_hash()}  # which card, which code
    print(json.dumps({**info, **where}), flush=True)
    timer = Timer(a.device, a.repeat)
    settings = {k: v for k, v in vars(a).items() if k not in ("results", "out", "prompts")}
    kept = ResultsFile(a.results, {**where, "versions": {
        k: v for k, v in info.items() if k != "date"}, "settings": settings,
        "prompts": hashlib.sha256(json.dumps(prompts[:max(a.requests)]).encode()).hexdigest()[:16]})
    rows = []
    with dynamic.moe_dispatch(a.moe_dispatch), switches(a.no_mla_gpu, a.no_mla_graphs, a.no_mla_rope,
                                                        a.no_moe_router_fusion):
        for shape in a.shapes:
            rows.extend(run_shape(a, shape, prompts, timer, kept))
            if a.device == "cuda":  # this shape's models are gone: free their memory for the next
                gc.collect()
                torch.cuda.empty_cache()
    lengths = [len(p) for p in prompts[:max(a.requests)]]
    print(f"\n{info['date']}, {info['gpu']}, {a.dtype}, --impl {a.impl}, attention: {info['attention']}; prompts "
          f"{min(lengths)}-{max(lengths)} tokens (mean {sum(lengths) / len(lengths):.0f}), {a.new} new tokens, "
          f"greedy; torch {info['torch']}, transformers {info.get('transformers')}, megatron-core "
          f"{info.get('megatron-core')}\n")
    print(table(rows))
    result = {"versions": info, "args": vars(a), "rows": rows}
    print(json.dumps(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
