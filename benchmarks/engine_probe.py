"""Probe megatron-core's dynamic inference engine on one GPU through `megatron_patch.inference.generate`: decode
speed with CUDA graphs on and off, and (--profile) where a decode step's time goes.

    python benchmarks/engine_probe.py [--shape 1b] [--requests 1 32] [--graphs on off] [--sched legacy async] \\
        [--gemv on attn gemv off] [--sampling-sync on off] [--rope on|off] [--new 64] \\
        [--moe-dispatch auto|dropless|padded] [--profile DIR [--profile-requests 1 32] [--profile-steps 6]]
    python benchmarks/engine_probe.py --shape tiny --device cpu --impl local --dtype fp32 --graphs off \\
        --requests 1 2 --new 4 --min-prompt 4 --max-prompt 12 --repeat 1          # the logic, on a CPU

The model: `generate_bench.SHAPES` widths (`1b`: hidden 2048, 16 layers, 32 heads, 8 KV heads, vocab 128,256),
built by our builder (`megatron_patch.models.build_model`) with megatron-core's random initialisation; prompts
as generate_bench writes them (seed 0, lengths uniform in [--min-prompt, --max-prompt]); greedy, no early stop.
One JSON row per (graphs, requests), printed as soon as measured: `build_s` (the first call: engine, KV cache,
graph capture), `seconds` / `tokens_per_s` of a call for --new tokens (median of --repeat), `ms_per_token` =
(time for --new tokens - time for 1) / (--new - 1): one decode step of all N requests; `bound_ms`: weight bytes
read per decode step / --bandwidth-tb-s; `tokens_vs_graphs_on|off`: agreement of the greedy tokens with the
row of the same requests and the other graphs setting. --sched: megatron-core's scheduling of engine steps,
`legacy` (resolve step k, then prepare step k+1) or `async` (0.19 on: prepare and launch step k+1 before resolving
step k, so the host's bookkeeping overlaps the GPU; `dynamic.ASYNC_SCHEDULING`), one set of rows each, with
`tokens_vs_legacy`. --gemv on / attn / gemv / off: our decode kernels (a GPU only): batch-1 decode's linear layers on
the Triton GEMV kernel instead of cuBLAS (`dynamic.DECODE_GEMV`) and decode attention on the split-KV kernels
instead of FA4 (`dynamic.DECODE_ATTENTION`): both, the attention only, the GEMV only, or neither; one set of rows
each, with `tokens_vs_kernels_off`. --sampling-sync on / off: megatron-core's sampling, which synchronises the
stream every step (a blocking host-to-device copy), or ours without it (`dynamic.SAMPLING_NO_SYNC`; exact, so a
CPU runs it too); one set of rows each, with `tokens_vs_sampling_sync`. --rope on / off (every row of the call):
our in-place RoPE kernel (`dynamic.DECODE_ROPE`, a GPU only) or megatron-core's angle gathers, TE's RoPE and the
query copy.
A configuration that fails gives a row with `error` (the traceback on stderr) and the next
one runs. A new engine is built for every row (`release_engine` between rows).

--profile DIR: for each of --profile-requests (graphs: the first of --graphs), a torch.profiler Chrome trace of
--profile-steps engine steps in the middle of decoding (DIR/trace_n{N}_graphs_{on|off}.json.gz), then a summary:
the top CUDA kernels by total time, kernel time per category and the idle GPU time between kernels (host gaps:
launch overhead, Python, synchronisation) per step (`benchmarks/trace_summary.py`'s arithmetic), and the top
host-side ops by self CPU time; then the same call under cProfile: the Python functions that take the host's
time, as ms per engine step (`host_functions`: own time and cumulative time, the top --top by own time). Each
--sched gets its profile. Written to DIR/summary_n{N}_graphs_{on|off}_{sched}.{json,txt} and printed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate_bench import (  # noqa: E402
    SHAPES,
    Timer,
    _Ids,
    bandwidth,
    hf_config,
    read_prompts,
    versions,
    write_prompts,
)
from trace_summary import _events, summarise  # noqa: E402


def build(a, context: int):
    """The random megatron-core GPTModel of --shape (our builder; eval mode)."""
    from megatron_patch.models import build_model
    from megatron_patch.names import torch_dtype

    torch.manual_seed(0)
    return build_model(hf_config(a.shape, context), impl=a.impl, dtype=torch_dtype(a.dtype)).eval()


def decode_bytes(model) -> int:
    """Bytes a decode step reads: every parameter once (a tied output layer once), less the input embedding
    table when the output layer has its own (a step reads one row of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.share_embeddings_and_output_weights:
        emb = model.embedding.word_embeddings.weight
        total -= emb.numel() * emb.element_size()
    return total


# One tokenizer for every call: the engine is kept between calls for the same model and tokenizer object
# (`dynamic._Engines`); a new `_Ids()` per call (as generate_bench.py makes) rebuilds it, graphs and all, each time.
TOKENIZER = _Ids()


def call(model, prompts, new: int, graphs: bool):
    from megatron_patch.inference import Sampling, generate

    out = generate(model, TOKENIZER, prompts, Sampling(new, top_k=1, stop_id=None), max_batch_size=len(prompts),
                   cuda_graphs=graphs, engine="dynamic")
    assert all(len(t) == new for t in out), [len(t) for t in out]
    return out


def agreement(out: list[list[int]], other: list[list[int]]) -> dict:
    """How far two runs' greedy tokens agree: requests identical, mean length of the common prefix."""
    pairs = list(zip(out, other))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs]
    return {"identical": sum(a == b for a, b in pairs) / len(pairs), "mean_common_prefix": sum(prefix) / len(pairs)}


def set_sched(sched: str) -> None:
    """megatron-core's step scheduling for the engines built from now on (--sched)."""
    from megatron_patch import compat
    from megatron_patch.inference import dynamic

    if sched == "async" and not compat.async_scheduling_available():
        raise ValueError("--sched async: this megatron-core has no asynchronous scheduling (0.19 on)")
    dynamic.ASYNC_SCHEDULING = sched == "async"


def set_kernels(kernels: str, sampling_sync: str = "on", rope: str = "off") -> None:
    """Our decode kernels for the engines built from now on (--gemv): on = GEMV and split-KV attention, attn = the
    attention only, gemv = the GEMV only, off = neither; and megatron-core's per-step stream synchronisation in sampling
    (--sampling-sync): on = megatron-core's sampling, off = ours without it (dynamic.SAMPLING_NO_SYNC); and
    (--rope) our in-place RoPE kernel or megatron-core's gather + TE RoPE + copy (dynamic.DECODE_ROPE)."""
    from megatron_patch.inference import dynamic

    dynamic.DECODE_GEMV, dynamic.DECODE_ATTENTION = kernels in ("on", "gemv"), kernels in ("on", "attn")
    dynamic.SAMPLING_NO_SYNC = sampling_sync == "off"
    dynamic.DECODE_ROPE = rope == "on"


def measure(a, model, prompts, graphs: bool, timer: Timer, bound_ms: float, seen: dict, sched: str = "legacy",
            gemv: str = "on", sync: str = "on") -> dict:
    """One row; `seen` keeps each (requests, graphs, sched, kernels, sampling sync)'s tokens, compared with the
    other graphs setting's, with legacy scheduling's, with our decode kernels off (`gemv`: on, off, attn: only
    the split-KV attention, gemv: only the GEMV; on: both) and with megatron-core's sampling (`sync` on)."""
    from megatron_patch.inference import dynamic
    from megatron_patch.inference.dynamic import release_engine

    row = {"shape": a.shape, "requests": len(prompts), "cuda_graphs": graphs, "sched": sched, "new": a.new}
    try:
        set_sched(sched)
        set_kernels(gemv, sync, a.rope)
        row["gemv"], row["split_kv_attention"] = dynamic.wanted(dynamic.DECODE_GEMV), dynamic.wanted(
            dynamic.DECODE_ATTENTION)
        row["rope_kernel"] = dynamic.wanted(dynamic.DECODE_ROPE)
        row["sampling_sync"] = not dynamic.SAMPLING_NO_SYNC
        row["moe_dropless"] = dynamic.plan_engine(model, prompts, a.new, max_requests=len(prompts),
                                                  cuda_graphs=graphs).moe_dropless
        timer.sync()
        t = time.perf_counter()
        out = call(model, prompts, a.new, graphs)  # builds the engine (and captures its graphs)
        timer.sync()
        row["build_s"] = round(time.perf_counter() - t, 2)
        n = len(prompts)
        if (n, not graphs, sched, gemv, sync) in seen:
            row["tokens_vs_graphs_" + ("off" if graphs else "on")] = agreement(out, seen[n, not graphs, sched, gemv,
                                                                                      sync])
        if sched != "legacy" and (n, graphs, "legacy", gemv, sync) in seen:
            row["tokens_vs_legacy"] = agreement(out, seen[n, graphs, "legacy", gemv, sync])
        if gemv != "off" and (n, graphs, sched, "off", sync) in seen:
            row["tokens_vs_kernels_off"] = agreement(out, seen[n, graphs, sched, "off", sync])
        if sync == "off" and (n, graphs, sched, gemv, "on") in seen:
            row["tokens_vs_sampling_sync"] = agreement(out, seen[n, graphs, sched, gemv, "on"])
        seen[n, graphs, sched, gemv, sync] = out
        seconds, peak = timer(lambda: call(model, prompts, a.new, graphs))
        one, _ = timer(lambda: call(model, prompts, 1, graphs))  # the same engine (its plan covers this one)
        row.update(seconds=round(seconds, 4), tokens_per_s=round(len(prompts) * a.new / seconds, 1),
                   ms_per_token=float(f"{(seconds - one) / (a.new - 1) * 1e3:.4g}"),
                   bound_ms=float(f"{bound_ms:.4g}"), peak_gib=None if peak is None else round(peak, 2))
    except Exception as e:  # the row says why; the traceback goes to stderr; the next row runs
        traceback.print_exc()
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    finally:
        release_engine()
    return row


def kernel_table(kernels: list[dict], top: int) -> list[dict]:
    """The `top` kernel names by total GPU time: calls, total and mean microseconds."""
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        by_name.setdefault(k.get("name", "?"), []).append(k["dur"])
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [{"kernel": name[:120], "calls": len(d), "total_us": round(sum(d), 1), "mean_us": round(sum(d) / len(d), 2)}
            for name, d in rows]


PROFILE_WAIT = 4  # engine steps before the profiler's warm-up: past the prefill step(s)


def host_functions(a, model, prompts, graphs: bool, engine) -> tuple[int, list[dict]]:
    """A --new token call under cProfile: (engine steps, the top --top functions by own time as ms per step,
    with their cumulative ms per step and calls per step)."""
    import cProfile
    import pstats

    steps = [0]
    step = engine.step_modern

    def counted(*args, **kwargs):
        steps[0] += 1
        return step(*args, **kwargs)

    engine.step_modern = counted
    prof = cProfile.Profile()
    try:
        prof.runcall(call, model, prompts, a.new, graphs)
    finally:
        del engine.step_modern
    n = max(steps[0], 1)
    stats = pstats.Stats(prof).stats  # {(file, line, function): (primitive calls, calls, own s, cumulative s, _)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:a.top]
    return steps[0], [{"function": f"{os.path.basename(k[0])}:{k[1]}:{k[2]}", "own_ms": round(v[2] / n * 1e3, 4),
                       "cum_ms": round(v[3] / n * 1e3, 4), "calls": round(v[1] / n, 2)} for k, v in rows]


def profile(a, model, prompts, graphs: bool, sched: str = "legacy") -> dict:
    """A trace of --profile-steps engine steps in the middle of a --new token call (the engine already built by
    a first call), its summary, and the host's Python functions over a whole call (cProfile)."""
    from torch.profiler import ProfilerActivity, schedule

    from megatron_patch.inference import dynamic

    set_sched(sched)
    name = f"n{len(prompts)}_graphs_{'on' if graphs else 'off'}_{sched}"
    call(model, prompts, a.new, graphs)
    engine = dynamic._Engines.engine
    path = os.path.join(a.profile, f"trace_{name}.json")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with torch.profiler.profile(activities=activities, with_stack=a.with_stack, record_shapes=False,
                                schedule=schedule(wait=PROFILE_WAIT, warmup=2, active=a.profile_steps),
                                on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        step = engine.step_modern

        def stepped(*args, **kwargs):
            out = step(*args, **kwargs)
            prof.step()
            return out

        engine.step_modern = stepped  # (an instance attribute: gone with the engine)
        try:
            call(model, prompts, a.new, graphs)
        finally:
            del engine.step_modern
    engine_steps, functions = host_functions(a, model, prompts, graphs, engine)
    dynamic.release_engine()
    kernels, ops, ranges = _events(path, steps=True)  # the kernels of the --profile-steps steps, not the next one's
    kernels = [k for k in kernels if k.get("dur", 0) > 0]
    steps = [end - begin for begin, end in ranges]
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as z:  # (perfetto / chrome://tracing read it)
        shutil.copyfileobj(f, z)
    os.remove(path)
    summary = {"config": name, "steps": a.profile_steps, "trace": path + ".gz", "with_stack": a.with_stack,
               "host_step_ms": round(sum(steps) / max(len(steps), 1) / 1e3, 3)}  # wall time of one engine step
    if kernels:
        s = summarise(kernels, ops)
        summary.update(window_ms_per_step=round(s["window_ms"] / a.profile_steps, 3),
                       gpu_idle_ms_per_step=round(s["idle_ms"] / a.profile_steps, 3), idle_share=s["idle_share"],
                       kernels_per_step=round(len(kernels) / a.profile_steps, 1), categories=s["categories"],
                       top_kernels=kernel_table(kernels, a.top))
    summary.update(engine_steps_per_call=engine_steps, host_functions=functions)
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=70)
    with open(os.path.join(a.profile, f"summary_{name}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(a.profile, f"summary_{name}.txt"), "w") as f:
        f.write(host)
    print(json.dumps(summary), flush=True)
    print(host, flush=True)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b", choices=sorted(SHAPES), help="model widths (generate_bench.SHAPES)")
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 32], help="requests in flight, one row each")
    ap.add_argument("--graphs", nargs="+", default=["on", "off"], choices=["on", "off"], help="CUDA graphs")
    ap.add_argument("--sched", nargs="+", default=["legacy"], choices=["legacy", "async"],
                    help="megatron-core's step scheduling (async: 0.19 on)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--min-prompt", type=int, default=128, help="shortest prompt, tokens")
    ap.add_argument("--max-prompt", type=int, default=1024, help="longest prompt, tokens")
    ap.add_argument("--repeat", type=int, default=2, help="timed calls per measurement (median)")
    ap.add_argument("--impl", default="transformer_engine", choices=["transformer_engine", "local"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--bandwidth-tb-s", type=float, default=None,
                    help="memory bandwidth for the bound, TB/s (default: the GPU's, benchmarks/machine.py)")
    ap.add_argument("--gemv", nargs="+", choices=["on", "attn", "gemv", "off"], default=["on"],
                    help="our decode kernels (GPU only): on = batch-1 decode's linear layers on the Triton GEMV "
                         "kernel (dynamic.DECODE_GEMV) and decode attention on the split-KV kernels "
                         "(dynamic.DECODE_ATTENTION); attn = the attention only; gemv = the GEMV only; off = "
                         "neither. One set of rows "
                         "each, `tokens_vs_kernels_off` where off ran too")
    ap.add_argument("--sampling-sync", nargs="+", choices=["on", "off"], default=["off"],
                    help="on = megatron-core's sampling, which synchronises the stream every step; off = the "
                         "sampling_without_stream_sync patch (dynamic.SAMPLING_NO_SYNC). One set of rows "
                         "each, `tokens_vs_sampling_sync` where on ran too (default off: the library's default)")
    ap.add_argument("--rope", choices=["on", "off"], default="on",
                    help="every row: on = our in-place RoPE kernel (dynamic.DECODE_ROPE, a GPU only; the "
                         "library's default), off = megatron-core's angle gathers, TE's fused RoPE and the query copy")
    ap.add_argument("--moe-dispatch", choices=["auto", "dropless", "padded"], default="auto",
                    help="MoE layers in every row and profile: auto = the engine's choice (dynamic.MOE_DROPLESS, "
                         "dynamic.dropless_pays), dropless = grouped GEMMs at every request count, padded = "
                         "megatron-core's dispatchers (padded under CUDA graphs); rows carry `moe_dropless`")
    ap.add_argument("--profile", metavar="DIR", help="also write profiler traces and summaries here")
    ap.add_argument("--profile-requests", type=int, nargs="+", default=[1], help="requests of the profiled runs")
    ap.add_argument("--profile-steps", type=int, default=6, help="engine steps traced")
    ap.add_argument("--with-stack", action="store_true", help="Python stacks in the trace (slows the host down)")
    ap.add_argument("--skip-rows", action="store_true", help="only --profile (no timed rows)")
    ap.add_argument("--top", type=int, default=15, help="rows of the kernel and host-op tables")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no GPU here (use --shape tiny --device cpu --impl local --dtype fp32 --graphs off)")
    if min(a.requests + a.profile_requests) < 1 or a.new < 2 or not 1 <= a.min_prompt <= a.max_prompt:
        ap.error("--requests / --profile-requests >= 1, --new >= 2 and 1 <= --min-prompt <= --max-prompt")
    if a.profile and a.new < PROFILE_WAIT + 2 + a.profile_steps + 2:
        ap.error(f"--profile needs --new >= {PROFILE_WAIT + 4 + a.profile_steps} (steps past the traced ones)")
    return a


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse_args(argv)
    count = max(a.requests + a.profile_requests)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prompts.jsonl")
        write_prompts(path, count, a.min_prompt, a.max_prompt, SHAPES[a.shape]["vocab_size"])
        prompts = read_prompts(path, SHAPES[a.shape]["vocab_size"])
    print(json.dumps(versions()), flush=True)
    model = build(a, max(len(p) for p in prompts) + a.new)
    bound_ms = decode_bytes(model) / (bandwidth(a) * 1e12) * 1e3
    timer, rows, seen = Timer(a.device, a.repeat), [], {}
    from megatron_patch.inference import dynamic

    defaults = (dynamic.ASYNC_SCHEDULING, dynamic.DECODE_GEMV, dynamic.DECODE_ATTENTION, dynamic.SAMPLING_NO_SYNC,
                dynamic.DECODE_ROPE)
    with dynamic.moe_dispatch(a.moe_dispatch):
        for sched in a.sched:
            for gemv in a.gemv:
                for sync in a.sampling_sync:
                    for graphs in ([] if a.skip_rows else a.graphs):
                        for n in a.requests:
                            rows.append(measure(a, model, prompts[:n], graphs == "on", timer, bound_ms, seen, sched,
                                                gemv, sync))
                            print(json.dumps(rows[-1]), flush=True)
        (dynamic.ASYNC_SCHEDULING, dynamic.DECODE_GEMV, dynamic.DECODE_ATTENTION, dynamic.SAMPLING_NO_SYNC,
         dynamic.DECODE_ROPE) = defaults
        if a.profile:
            os.makedirs(a.profile, exist_ok=True)
            set_kernels(a.gemv[0], a.sampling_sync[0], a.rope)
            for sched in a.sched:
                for n in a.profile_requests:
                    try:
                        rows.append(profile(a, model, prompts[:n], a.graphs[0] == "on", sched))
                    except Exception as e:
                        traceback.print_exc()
                        error = f"{type(e).__name__}: {str(e)[:300]}"
                        print(json.dumps({"profile": n, "sched": sched, "error": error}), flush=True)
        (dynamic.ASYNC_SCHEDULING, dynamic.DECODE_GEMV, dynamic.DECODE_ATTENTION, dynamic.SAMPLING_NO_SYNC,
         dynamic.DECODE_ROPE) = defaults
    return rows


if __name__ == "__main__":
    main()
