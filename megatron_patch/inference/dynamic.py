"""`generate` on megatron-core's dynamic inference engine (`DynamicInferenceEngine` over a
`DynamicInferenceContext`): continuous batching over a paged KV cache sized by `plan_engine`, CUDA graphs on
a GPU (`set_inference_cuda_graphs`), stop strings through the controller's stop-word callback, the engine
kept between calls while it fits (`release_engine` frees it). TP, PP and EP; ALiBi through the
`alibi_paged_attention` patch; multi-latent attention through the `mla_latent_cache` patch (on a GPU since
2026-12-05, `MLA_ON_GPU`; its CUDA graphs, `MLA_GRAPHS`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from megatron_patch import compat
from megatron_patch.inference import decode_attention, decode_rope, moe_dropless
from megatron_patch.inference.sampling import Sampling
from megatron_patch.inference.stops import holds_stop, stop_window

# KV cache page size in tokens: megatron-core's default (flash-attn's paged kernels want a multiple of 256).
BLOCK_SIZE_TOKENS = 256
# ... and with multi-latent attention, whose cached-latent path asserts FlashMLA's page of 64 tokens.
MLA_BLOCK_SIZE_TOKENS = 64
# CUDA graphs captured per engine (batch sizes spread from 1 to the in-flight maximum): Megatron-LM's
# default (`--inference-dynamic-batching-num-cuda-graphs`).
NUM_CUDA_GRAPHS = 16
# Requests in flight when the caller sets no maximum: on a GPU as many as vLLM's default (`max_num_seqs`),
# enough to make decoding compute-bound at 1B-8B widths; on a CPU megatron's own default (8), where larger
# batches buy little and the per-step attention gathers grow with them.
DEFAULT_MAX_REQUESTS = {"cuda": 256, "cpu": 8}
# The automatic KV budget is what the in-flight maximum of the longest requests needs, but at most this
# share of the GPU's memory not held by this process's tensors (the weights; on a CPU: of the host's
# memory): the rest is left to activations (a prefill step of up to 16k tokens), logits and CUDA graphs.
# Not the memory free right now: that differs between the ranks of a TP / EP group, and ranks whose
# caches differ in size schedule differently and then wait for each other forever.
KV_SHARE_OF_FREE_MEMORY = 0.5
# megatron-core's asynchronous scheduling (`InferenceConfig.async_sched_mode="async"`, 0.19 on): the engine
# prepares and launches step k+1 before it resolves step k's requests, so the host's bookkeeping overlaps the
# GPU's forward pass. The same tokens (tested); a request that stops (end token, stop string) costs one forward
# pass that is thrown away. Measured at 8B on one H200 (`benchmarks/engine_probe.py --sched`): 12-18% less time
# per decode step, identical tokens. None: on where there is a GPU and megatron-core has it (on a CPU its async
# path creates CUDA streams, which a plain CPU process cannot); True / False: on / off wherever megatron-core has it.
ASYNC_SCHEDULING: bool | None = None
# Batch-1 decode's linear layers as one Triton GEMV kernel each, norms folded in (the `decode_gemv` patch,
# `inference/gemv.py`), instead of cuBLAS's GEMM kernels and TE's norm kernel. Steps of `gemv.SERVED_ROWS` (one)
# tokens only, bf16 / fp16, TP = 1, no FP8. None: on where there is a GPU; True / False: on / off (off on a CPU).
# On by default since 2026-12-06 (one H100, 8B, CUDA graphs, async, `engine_probe.py --gemv on attn gemv off
# --repeat 5`): one request 7.37 ms a step with neither kernel, 6.72 with the GEMV, 6.42 with the GEMV and the
# split-KV attention; 8 and 32 requests within 0.9% in every setting; 1B one request 2.03 -> 1.45 ms.
# (On an H200 on 2026-12-03 the spread between runs was the size of the effect: re-measured there next.)
DECODE_GEMV: bool | None = None
# Decode-only steps' attention on our split-KV Triton kernels (the `split_kv_decode_attention` patch,
# `inference/decode_attention.py`) instead of FlashAttention-4, which cannot split the key length on Hopper.
# None: on where there is a GPU; True / False: on / off (off on a CPU). On by default since 2026-12-06 (see
# DECODE_GEMV: 8B one request 7.37 -> 7.05 ms a step alone, 6.72 -> 6.42 beside the GEMV; FA4 17.8 us a layer,
# ours 7.3 us in its two kernels; 32 requests 7.99 / 8.01 ms off / on).
DECODE_ATTENTION: bool | None = None
# The engine's rotary embedding in one Triton kernel each for queries and keys (the `fused_decode_rope` patch,
# `inference/decode_rope.py`), rotating in place at each token's position, instead of an index kernel for the
# angles, TE's fused RoPE and a copy of the queries back: three kernels fewer a layer. None: on where there is a
# GPU; True / False: on / off (off on a CPU). Measured 2026-12-03 (8B, CUDA graphs, async, the other kernels on):
# one request 5.54 -> 5.05 ms a step, 32 requests 6.62 -> 6.29 ms; as close to float64 as TE's RoPE there.
DECODE_ROPE: bool | None = None
# Sampling without megatron-core's per-step stream synchronisation when every request samples alike (the
# `sampling_without_stream_sync` patch): asynchronous scheduling then overlaps the host's next step with the GPU's.
# Exact (the same tokens and generator draws, tested against the original), so it runs on a CPU too (where
# nothing waits: the CPU tests run the engine with it). Measured 2026-12-03 (8B, CUDA graphs, async, our kernels
# off): one request 6.62 -> 5.99 ms a step, 32 requests 7.81 -> 6.54 ms.
SAMPLING_NO_SYNC: bool = True
# Multi-latent attention (DeepSeek) on the dynamic engine on a GPU (the `mla_latent_cache` patch: latents in the
# paged cache, prefill in torch, decode on our Triton kernel). On since the H200 smoke of 2026-12-05: a dense
# DeepSeek-V3 generates HF's greedy tokens there (`test_mla_on_the_dynamic_engine_equals_hf`), and v2-lite with
# graphs decodes 12x faster than the static engine (1 request: 8.2 ms a token against 99.6; docs/benchmarks.md).
# Off: `auto` keeps MLA models on the static engine on a GPU (`unsupported_attention`).
MLA_ON_GPU: bool = True
# CUDA graphs of multi-latent attention's decode steps. On since the H200 smoke of 2026-12-05: a dense DeepSeek-V3's
# graphs give its eager tokens in a fresh engine's first call and the kept engine's second, on TE's layers and
# megatron-core's local ones, and with MoE layers padded or dropless (`test_mla_cuda_graphs_equal_eager`,
# `test_mla_and_moe_cuda_graphs_equal_eager`). On 2026-12-04 they had not: the MLA layers read their rotary table
# inside the graphed block from megatron-core's lru_cache, which `generate` clears after each call, so the kept
# engine's graphs read freed memory; the tables now live with the engine (`_kept_rotary_table`). Graphs of the torch
# decode (widths the Triton kernel does not take, `decode_attention.mla_kernel_takes`) stay refused until that
# test's torch-decode case has compared them with its own eager decoding on a GPU (`graphs_refused`).
MLA_GRAPHS: bool = True
# MoE routers' top-k on Transformer Engine's fused kernel (megatron-core's `moe_router_fusion`, TE >= 2.7: softmax or
# sigmoid, top-k, group limits and scaling in one kernel) for the engine's calls: megatron-core's unfused routing is
# ~16 kernels of a MoE layer's decode step (v2-lite: 107 operators a MoE + MLA layer, ~3.4 us each under graphs;
# docs/benchmarks.md). On since the H200 of 2026-12-05: Mixtral's and DeepSeek-V3's tokens equal the unfused
# router's (`test_moe_router_fusion_equals_the_unfused_router`); v2-lite with the MLA RoPE kernel 6.97 -> 6.71 ms a
# token at one request, 1,098 -> 1,225 tokens/s at 32 (`generate_bench.py --no-moe-router-fusion`: without it).
MOE_ROUTER_FUSION: bool = True
# CUDA graphs of MoE layers' decode steps by default (`moe_graph_dispatch`: the all-to-all dispatcher padded to
# capacity, or dropless below). On since the H200 smoke of 2026-12-05: a small Mixtral's graphs, padded and dropless,
# gave its eager tokens, 5.6x / 7.2x faster than eager (`test_moe_on_the_dynamic_engine_equals_hf`); mixtral-8l
# (8 experts top-2, 4096 wide) 1 request 6.5 ms a token padded, 3.8 dropless, HF 10.5 (docs/benchmarks.md).
MOE_GRAPHS: bool = True
# MoE layers dropless on the engine (`inference/moe_dropless.py`): every token to its k experts, each expert's rows
# in two grouped GEMMs with device-side offsets, no host synchronisation; eager and graph steps alike, prefill
# included, instead of megatron-core's dispatchers (a sync a layer, `SequentialMLP`'s experts one by one; under
# graphs every expert padded to a row per token, `moe_graph_dispatch`). Where `moe_dropless.refusals` passes (one
# rank holds every expert; bf16 on a GPU), and under CUDA graphs where `dropless_pays`. On since the H200 smoke of
# 2026-12-05 (its tokens = eager = megatron-core's dispatchers; exact on a CPU).
MOE_DROPLESS: bool = True
# Under CUDA graphs the padded path computes every expert (each a row per token) in dense GEMMs, the dropless one
# only the experts that tokens chose, in grouped GEMMs that were slower per expert: mixtral-8l, 32 requests (every
# expert chosen in every step) 1,566 ms dropless against 1,208 ms padded (128 new tokens, prefill included: 1.30x);
# 1 request (2 of 8 experts) 3.78 against 6.50 ms a token. So dropless where the experts expected to be chosen in a
# decode step of the engine's requests, as a share of all, times DROPLESS_COST stays below 1 (`dropless_pays`).
DROPLESS_COST: float = 1.30


def default_max_requests() -> int:
    """Requests in flight when none is asked for (`DEFAULT_MAX_REQUESTS`, by device)."""
    import torch

    return DEFAULT_MAX_REQUESTS["cuda" if torch.cuda.is_available() else "cpu"]


@dataclass(frozen=True)
class EnginePlan:
    """How a `DynamicInferenceEngine` is sized for one `generate` call."""

    max_requests: int  # requests in flight (continuous batching: waiting requests take freed slots)
    bounded: bool  # the call has more requests than that
    max_sequence_length: int  # longest prompt + max_new_tokens
    max_tokens: int  # tokens one forward step may carry (prefill chunks of several requests, decodes)
    kv_cache_gb: float  # KV cache budget of this rank, GiB (megatron's `buffer_size_gb`)
    cuda_graphs: bool  # capture CUDA graphs (`cuda_graph_impl="local"`, block scope)
    non_decode_graphs: bool  # also for prefill / mixed steps (not with the torch paged attention)
    async_scheduling: bool = False  # megatron-core's async_sched_mode="async" (ASYNC_SCHEDULING)
    decode_gemv: bool = False  # the decode_gemv patch (DECODE_GEMV): the CUDA graphs hold its kernels
    decode_attention: bool = False  # the split_kv_decode_attention patch (DECODE_ATTENTION): likewise
    decode_rope: bool = False  # the fused_decode_rope patch (DECODE_ROPE): likewise
    alibi: bool = False  # the model attends with ALiBi: the alibi_paged_attention patch (decode-only graphs)
    latent: bool = False  # multi-latent attention: the mla_latent_cache patch, pages of MLA_BLOCK_SIZE_TOKENS
    moe: bool = False  # MoE layers: with CUDA graphs, on the all-to-all dispatcher padded (moe_graph_dispatch)
    moe_dropless: bool = False  # ... or dropless in every step (MOE_DROPLESS, moe_dropless.dispatch)
    moe_router_fusion: bool = False  # routers on TE's fused top-k (MOE_ROUTER_FUSION, router_fusion)
    mla_rope: bool = False  # multi-latent attention's RoPE kernel in fused_decode_rope (decode_rope.MLA_ROPE)

    @property
    def block_size_tokens(self) -> int:
        """The KV cache's page size (`BLOCK_SIZE_TOKENS`, `MLA_BLOCK_SIZE_TOKENS`)."""
        return MLA_BLOCK_SIZE_TOKENS if self.latent else BLOCK_SIZE_TOKENS

    @property
    def kernels(self) -> tuple:
        """What the engine's CUDA graphs and steps run: an engine serves only plans that run the same."""
        return (self.cuda_graphs, self.non_decode_graphs, self.async_scheduling, self.decode_gemv,
                self.decode_attention, self.decode_rope, self.moe_dropless, self.moe_router_fusion, self.mla_rope)

    def covers(self, other: EnginePlan) -> bool:
        """An engine built for this plan serves `other` as well: the same graphs, at least as much room, and
        the same in-flight maximum where it binds (more slots than a call has requests change nothing)."""
        slots = (self.max_requests == other.max_requests
                 or (not other.bounded and self.max_requests >= other.max_requests))
        return (slots and self.kernels == other.kernels
                and self.max_sequence_length >= other.max_sequence_length and self.max_tokens >= other.max_tokens
                and self.kv_cache_gb >= other.kv_cache_gb)


def latent_attention(model) -> bool:
    """Whether `model` attends with multi-latent attention (DeepSeek): the engine then caches latents."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    return any(isinstance(m, MultiLatentAttention) for m in model.modules())


def moe_layers(model) -> list:
    """`model`'s MoE layers (megatron-core's `MoELayer`)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def runs_dropless(moe: list) -> bool:
    """Whether an engine's calls run the MoE layers `moe` (`moe_layers`) dropless (`MOE_DROPLESS`, and every layer
    passes `moe_dropless.refusals`)."""
    return bool(moe) and MOE_DROPLESS and moe_dropless.refusals(moe) is None


MOE_DISPATCHES = ("auto", "dropless", "padded")


@contextlib.contextmanager
def moe_dispatch(kind: str) -> Iterator[None]:
    """The engines' MoE path for a block (benchmarks): `auto` (the defaults: `MOE_DROPLESS`, `dropless_pays`),
    `dropless` (wherever `moe_dropless.refusals` passes, at any request count) or `padded` (megatron-core's
    dispatchers, padded under CUDA graphs)."""
    global MOE_DROPLESS, DROPLESS_COST
    saved = MOE_DROPLESS, DROPLESS_COST
    if kind == "dropless":
        MOE_DROPLESS, DROPLESS_COST = True, 0.0
    elif kind == "padded":
        MOE_DROPLESS = False
    elif kind != "auto":
        raise ValueError(f"MoE dispatch {kind!r}: one of {', '.join(MOE_DISPATCHES)}")
    try:
        yield
    finally:
        MOE_DROPLESS, DROPLESS_COST = saved


def dropless_pays(config, requests: int) -> bool:
    """Whether a CUDA-graph decode step of `requests` tokens runs faster dropless than padded (`DROPLESS_COST`):
    with E experts and top-k routing, the share of experts that some token chooses is 1 - (1 - k/E)^requests
    (independent choices)."""
    share = 1 - (1 - config.moe_router_topk / config.num_moe_experts) ** requests
    return share * DROPLESS_COST < 1


def graphs_refused(model, latent: bool, moe: list) -> str | None:
    """Why the dynamic engine captures no CUDA graphs of `model` (None: it may): MoE layers (`moe`, its
    `moe_layers`) on a dispatcher `moe_graph_dispatch` cannot make capturable (the flex one), and multi-latent
    attention (`latent`) while `MLA_GRAPHS` is off."""
    if any(m.config.moe_token_dispatcher_type not in ("allgather", "alltoall") for m in moe):
        return (f"CUDA graphs of MoE layers: megatron-core's {model.config.moe_token_dispatcher_type} token "
                "dispatcher reads each expert's token count on the host, which a graph cannot capture; "
                "generate without CUDA graphs")
    if latent and not MLA_GRAPHS:
        return ("CUDA graphs of multi-latent attention are switched off (dynamic.MLA_GRAPHS); "
                "generate without CUDA graphs")
    if latent and not decode_attention.mla_kernel_takes(model.config.params_dtype, model.config.kv_lora_rank,
                                                        model.config.qk_pos_emb_head_dim):
        return ("CUDA graphs of multi-latent attention decoded in torch (widths or dtype the Triton kernel does not "
                "take, decode_attention.mla_kernel_takes): not yet compared with eager decoding on a GPU; "
                "generate without CUDA graphs")
    return None


def kv_bytes_per_token(model, latent: bool | None = None) -> int:
    """Bytes of K and V one token occupies in this rank's cache (its layers, its share of KV heads); with
    multi-latent attention (`latent`, default: `latent_attention(model)`), of its latent and rotated key part (one
    row a layer, on every TP rank whole)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config = model.config
    layers = sum(isinstance(m, TransformerLayer) for m in model.modules())
    if latent_attention(model) if latent is None else latent:
        return layers * (config.kv_lora_rank + config.qk_pos_emb_head_dim) * config.params_dtype.itemsize
    heads = config.num_query_groups or config.num_attention_heads
    heads_here = max(1, heads // config.tensor_model_parallel_size)
    return 2 * layers * heads_here * config.kv_channels * config.params_dtype.itemsize


def plan_engine(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, max_requests: int | None = None,
                kv_cache_gb: float | None = None, cuda_graphs: bool | None = None) -> EnginePlan:
    """The engine for these requests. `max_requests` (default `default_max_requests()`) is capped at the
    number of requests and rounded up to a multiple of TP (megatron-core splits requests over TP ranks
    in its CUDA-graph bookkeeping). `kv_cache_gb` None: the automatic budget (`KV_SHARE_OF_FREE_MEMORY`);
    a budget that cannot hold the longest request is refused. `cuda_graphs` None: on a GPU, at PP = EP = 1, for
    models without multi-latent attention (graphs at PP > 1 are untested here; MoE layers are captured on the
    all-to-all dispatcher padded to capacity, `moe_graph_dispatch`, decode steps only, or dropless in every step
    where `MOE_DROPLESS` is on, `moe_dropless.refusals` passes and `dropless_pays` at `max_requests` (without
    graphs: wherever it is allowed), by default while `MOE_GRAPHS` is on;
    multi-latent attention is refused while `MLA_GRAPHS` is off)."""
    import torch

    from megatron_patch import patches

    tp = model.config.tensor_model_parallel_size
    longest = max(len(p) for p in prompts)
    n = min(max_requests or default_max_requests(), len(prompts))
    n = -(-n // tp) * tp
    latent = latent_attention(model)
    page = MLA_BLOCK_SIZE_TOKENS if latent else BLOCK_SIZE_TOKENS
    block = page * kv_bytes_per_token(model, latent)
    blocks_per_request = -(-(longest + max_new_tokens) // page)
    need = (n * blocks_per_request + 1) * block  # + megatron's dummy block
    if kv_cache_gb is None:
        if torch.cuda.is_available():
            device = torch.cuda.current_device()
            free = torch.cuda.get_device_properties(device).total_memory - torch.cuda.memory_allocated(device)
        else:
            import psutil

            free = psutil.virtual_memory().total
        budget = min(need, int(KV_SHARE_OF_FREE_MEMORY * free))
    else:
        budget = int(kv_cache_gb * 1024 ** 3)
    if budget // block - 1 < blocks_per_request:
        given = (f"the KV cache budget of {kv_cache_gb:g} GiB (--kv-cache-gb)" if kv_cache_gb is not None else
                 f"the automatic KV cache budget of {budget / 1024 ** 3:.3g} GiB ({KV_SHARE_OF_FREE_MEMORY:g} of the "
                 "memory the weights leave)")
        holds = max(budget // block - 1, 0) * page
        raise ValueError(f"{given} holds {holds} tokens; the longest request needs {longest + max_new_tokens} "
                         f"({longest} prompt + {max_new_tokens} new tokens), in blocks of {page} tokens "
                         f"{blocks_per_request * block / 1024 ** 3:.3g} GiB: raise --kv-cache-gb")
    moe = moe_layers(model)
    dropless = runs_dropless(moe)
    refused = graphs_refused(model, latent, [] if dropless else moe)
    if cuda_graphs is None:
        from megatron.core import parallel_state as ps

        cuda_graphs = (torch.cuda.is_available() and model.config.pipeline_model_parallel_size == 1
                       and ps.get_expert_model_parallel_world_size() == 1 and refused is None
                       and (MOE_GRAPHS or not moe))
    if cuda_graphs and not torch.cuda.is_available():
        raise ValueError("CUDA graphs need a GPU")
    if cuda_graphs and refused is not None:
        raise ValueError(refused)
    if (dropless and cuda_graphs and not dropless_pays(moe[0].config, n)
            and graphs_refused(model, latent, moe) is None):
        dropless = False  # the padded graphs are the faster at this many requests
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    from megatron_patch.models.modules.alibi import has_alibi

    alibi = has_alibi(model)
    return EnginePlan(max_requests=n, bounded=n < len(prompts), max_sequence_length=longest + max_new_tokens,
                      max_tokens=max(DynamicInferenceContext.DEFAULT_MAX_TOKENS, longest, n),
                      kv_cache_gb=budget / 1024 ** 3, cuda_graphs=cuda_graphs,
                      # (attention in torch reads the prompts' lengths on the host; MoE layers padded to capacity
                      # would give every expert a row for each token of a prefill: decode-only graphs only)
                      non_decode_graphs=not (patches.attends_in_torch(model.config.params_dtype) or alibi or latent
                                             or (bool(moe) and not dropless)),
                      async_scheduling=async_scheduling(), decode_gemv=wanted(DECODE_GEMV),
                      decode_attention=wanted(DECODE_ATTENTION), decode_rope=wanted(DECODE_ROPE), alibi=alibi,
                      latent=latent, moe=bool(moe), moe_dropless=dropless,
                      moe_router_fusion=bool(moe) and wanted(MOE_ROUTER_FUSION) and router_fusion_available(),
                      mla_rope=latent and wanted(DECODE_ROPE) and decode_rope.MLA_ROPE)


def router_fusion_available() -> bool:
    """Whether megatron-core found Transformer Engine's fused top-k router (`fused_topk_with_score_function`)."""
    from megatron.core.transformer.moe import moe_utils

    return getattr(moe_utils, "fused_topk_with_score_function", None) is not None


@contextlib.contextmanager
def router_fusion(model, on: bool) -> Iterator[None]:
    """The model's MoE routers on TE's fused top-k (`moe_router_fusion` in the configs they read) while `on`;
    put back after."""
    configs = [model.config] + [m.router.config for m in moe_layers(model)] if on else []
    saved = [(c, c.moe_router_fusion) for c in {id(c): c for c in configs}.values()]
    for c, _ in saved:
        c.moe_router_fusion = True
    try:
        yield
    finally:
        for c, value in saved:
            c.moe_router_fusion = value


def async_scheduling() -> bool:
    """Whether engines built now schedule asynchronously (`ASYNC_SCHEDULING`)."""
    import torch

    wanted = torch.cuda.is_available() if ASYNC_SCHEDULING is None else ASYNC_SCHEDULING
    return bool(wanted) and compat.async_scheduling_available()


def wanted(switch: bool | None) -> bool:
    """A GPU-only switch of this module (`DECODE_GEMV`, `DECODE_ATTENTION`, `DECODE_ROPE`): None is on where
    there is a GPU; always off without one."""
    import torch

    return bool(True if switch is None else switch) and torch.cuda.is_available()


def unsupported_attention(model) -> str | None:
    """Why megatron-core's dynamic engine cannot run this model's attention here, or None. The engine attends
    through its own paged-KV kernel (`Attention.flash_decode_and_prefill`), not the layer's core
    attention: ALiBi biases are added there by the `alibi_paged_attention` patch; multi-latent attention
    (DeepSeek) runs megatron-core's cached-latent path with the `mla_latent_cache` patch, tested on a CPU (its
    GPU decode kernel under Triton's interpreter): on a GPU (Transformer Engine's fused layers, CUDA graphs, speed
    against the static engine) only with `MLA_ON_GPU` until measured there."""
    import torch

    if latent_attention(model) and torch.cuda.is_available() and not MLA_ON_GPU:
        return "multi-latent attention on a GPU (its cached-latent path is verified on a CPU only so far)"
    return None


def generate_dynamic(model, tokenizer, prompts: list[list[int]], sampling: Sampling, max_requests: int | None,
                     on_tokens, kv_cache_gb: float | None, cuda_graphs: bool | None) -> list[list[int]]:
    """`generate` on megatron-core's dynamic engine (the arguments as `megatron_patch.inference.generate`
    checked them): every prompt queued at once, at most `max_requests` in flight."""
    import torch

    from megatron_patch import patches

    why = unsupported_attention(model)
    if why is not None:
        raise ValueError(f"megatron-core's dynamic inference engine does not support {why}: use the static one "
                         "(--engine static)")
    with (torch.no_grad(), patches.applied("cpu_cuda_calls"), patches.applied("paged_attention_in_torch"),
          patches.applied("fa4_no_split_kv_on_sm90"), _inference_mode()):
        _require_einops()
        plan = plan_engine(model, prompts, sampling.max_new_tokens, max_requests, kv_cache_gb, cuda_graphs)
        with (patches.applied("decode_gemv") if plan.decode_gemv else contextlib.nullcontext(),
              patches.applied("split_kv_decode_attention") if plan.decode_attention else contextlib.nullcontext(),
              patches.applied("fused_decode_rope") if plan.decode_rope else contextlib.nullcontext(),
              patches.applied("sampling_without_stream_sync") if SAMPLING_NO_SYNC else contextlib.nullcontext(),
              # last: ALiBi layers attend with their bias before any other paged attention sees them
              patches.applied("alibi_paged_attention") if plan.alibi else contextlib.nullcontext(),
              _latent_cache(model) if plan.latent else contextlib.nullcontext(),
              _moe_dispatch(model, plan), router_fusion(model, plan.moe_router_fusion)):
            engine = _Engines.get(model, tokenizer, plan)
            return _run(engine, tokenizer, prompts, sampling, on_tokens)


def _moe_dispatch(model, plan: EnginePlan):
    """How the engine's calls run the model's MoE layers: dropless (`moe_dropless.dispatch`), padded to capacity
    under CUDA graphs (`moe_graph_dispatch`), or on the model's own dispatchers."""
    if plan.moe_dropless:
        return moe_dropless.dispatch(moe_layers(model))
    if plan.cuda_graphs and plan.moe:
        return moe_graph_dispatch(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def moe_graph_dispatch(model) -> Iterator[None]:
    """MoE layers as CUDA graphs can capture them, for the engine's calls: megatron-core's token dispatchers read
    each expert's token count on the host (`.cpu()`, `.item()`), except its all-to-all dispatcher in drop-and-pad
    mode, where every expert takes a fixed capacity of rows. The engine's controller turns that mode on for graph
    steps (and off for eager ones) when the config's `moe_pad_experts_for_cuda_graph_inference` is set, with a
    capacity of every token (`num_moe_experts / moe_router_topk`: no token dropped; the padded rows weigh 0). Here
    each MoE layer's all-gather dispatcher (ours; both compute the same, only the all-to-all one has the padded
    mode) is swapped for an all-to-all one (built once per layer, kept for later calls) and the switch set;
    afterwards the dispatchers, the switch and the capacity settings the controller changes are put back, as is
    megatron-core's process-wide list of MoE layers (`inference.utils.moe_layer_cache`, filled from the first model
    it sees)."""
    from megatron.core.inference import utils as inference_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    layers = moe_layers(model)
    fields = ("moe_pad_experts_for_cuda_graph_inference", "moe_expert_capacity_factor",
              "moe_pad_expert_input_to_capacity")
    configs = {id(c): c for c in [model.config, *(m.config for m in layers),
                                  *(m.token_dispatcher.config for m in layers)]}.values()
    saved = [(c, {f: getattr(c, f) for f in fields}) for c in configs]
    dispatchers = [m.token_dispatcher for m in layers]
    inference_utils.moe_layer_cache = None
    try:
        for m in layers:
            if not isinstance(m.token_dispatcher, MoEAlltoAllTokenDispatcher):
                if "_graph_dispatcher" not in m.__dict__:
                    m.__dict__["_graph_dispatcher"] = MoEAlltoAllTokenDispatcher(
                        m.num_local_experts, m.local_expert_indices, config=m.config,
                        pg_collection=_moe_groups(m.token_dispatcher))
                m.token_dispatcher = m.__dict__["_graph_dispatcher"]
        for c, _ in saved:
            c.moe_pad_experts_for_cuda_graph_inference = True
        yield
    finally:
        for m, d in zip(layers, dispatchers):
            m.token_dispatcher = d
        for c, values in saved:
            for f, v in values.items():
                setattr(c, f, v)
        inference_utils.moe_layer_cache = None


def _moe_groups(dispatcher):
    """The process groups a token dispatcher was built with, as megatron-core's dispatchers take them (0.18.2 and
    0.19 keep the three they use on the dispatcher)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(ep=dispatcher.ep_group, expt_tp=dispatcher.tp_group, tp_ep=dispatcher.tp_ep_group)


@contextlib.contextmanager
def _latent_cache(model) -> Iterator[None]:
    """megatron-core's cached-latent switch (`cache_mla_latents`, on the config and on each MLA layer, which
    copies it when built) on for one call, with the `mla_latent_cache` patch: the layers cannot train with it
    on (they assert), and GRPO / PPO train between calls. Afterwards the layers are put back as they were
    (`patches.mla_latent_forget`)."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    from megatron_patch import patches

    layers = [m for m in model.modules() if isinstance(m, MultiLatentAttention)]
    configs = {id(c): c for c in [model.config, *(m.config for m in layers)]}.values()
    saved = [(c, c.cache_mla_latents) for c in configs] + [(m, m.cache_mla_latents) for m in layers]
    ropes = [m.rotary_pos_emb for m in layers if callable(getattr(m, "rotary_pos_emb", None))]
    with patches.applied("mla_latent_cache"):
        try:
            for owner, _ in saved:
                owner.cache_mla_latents = True
            for rope in ropes:
                rope.forward = functools.partial(_kept_rotary_table, rope)
            yield
        finally:
            for rope in ropes:
                rope.__dict__.pop("forward", None)
            for owner, value in saved:
                owner.cache_mla_latents = value
            for m in layers:
                patches.mla_latent_forget(m)


# The rotary tables multi-latent attention layers read during the kept engine's calls, kept as long as the engine
# (`_Engines.release` empties it): (id(rotary module), offset, packed_seq, cp_group, length or None) -> the tables.
_ROTARY_TABLES: dict[tuple, list] = {}


def _kept_rotary_table(rope, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
    """An MLA layer's rotary table (what `RotaryEmbedding.forward` / `YarnRotaryEmbedding.forward` return) for
    the engine's calls. Those layers compute it inside the decoder block, from megatron-core's lru_cache (32
    entries, process-wide; GQA's comes in from the model, a graph input), which `generate` clears after every call
    (`forget_inference_rope`) and deep models overflow; a CUDA graph reads the table's memory, not the object, so
    the kept engine's graphs read freed memory in its next call (tokens parted from eager decoding on the H200,
    2026-12-04). Here each table lives with the engine. Rows depend only on their position, so one table of the
    next power of two serves every shorter length (a view of it), except where context parallelism slices the
    table by rank (then one a length); a longer request makes a longer table and the shorter ones stay (graphs
    captured earlier read them)."""
    forward = type(rope).forward
    compute = getattr(forward, "__wrapped__", forward)  # (not megatron-core's lru_cache)
    group = cp_group if cp_group is not None else getattr(rope, "cp_group", None)
    prefix = packed_seq or group is None or group.size() == 1
    key = (id(rope), offset, packed_seq, id(cp_group), None if prefix else max_seq_len)
    kept = _ROTARY_TABLES.setdefault(key, [])
    if not kept or kept[-1][0] < max_seq_len:
        length = 1 << (max_seq_len - 1).bit_length() if prefix else max_seq_len
        kept.append((length, compute(rope, length, offset, packed_seq, cp_group)))
    table = kept[-1][1]
    if isinstance(table, tuple):  # YaRN: (table, mscale)
        return (table[0][:max_seq_len], *table[1:])
    return table[:max_seq_len]


@contextlib.contextmanager
def _inference_mode() -> Iterator[None]:
    """megatron-core's process-wide `InferenceMode` flag for the duration of a call (the engine sets it
    when built and never clears it; left set, other forward passes of the model change path: GPTModel
    then asserts gathered logits, MoE layers pick their inference dispatcher)."""
    from megatron.core.inference.utils import InferenceMode

    was_active = InferenceMode.is_active()
    InferenceMode.set_active()
    try:
        yield
    finally:
        if not was_active:
            InferenceMode.unset_active()


def _require_einops() -> None:
    """megatron-core's dynamic attention path reshapes with einops, an optional import there."""
    from megatron.core.transformer import attention

    if attention.rearrange is None:
        raise ValueError("generation needs the einops package (megatron-core's dynamic inference engine uses it): "
                         "pip install einops")


class _Engines:
    """The last engine built, kept for the next call on the same model (GRPO generates every step, lm-eval
    once per group of requests): building one allocates the KV cache and, on a GPU, captures the CUDA
    graphs, which the next call reuses when its plan fits (`EnginePlan.covers`). One engine at a time:
    another model or a larger plan replaces it, `release()` frees it."""

    model = None
    tokenizer = None
    plan: EnginePlan | None = None
    engine = None

    @classmethod
    def get(cls, model, tokenizer, plan: EnginePlan):
        if (cls.engine is not None and cls.model is model and cls.tokenizer is tokenizer
                and cls.plan.covers(plan)):
            cls.engine.reset()
            return cls.engine
        cls.release()
        try:
            cls.engine = _build_engine(model, tokenizer, plan)
        except BaseException:
            # a capture that failed part-way leaves runners behind (drop them: the next engine would meet them)
            if plan.cuda_graphs:
                drop_inference_cuda_graphs(model)
            raise
        cls.model, cls.tokenizer, cls.plan = model, tokenizer, plan
        return cls.engine

    @classmethod
    def release(cls) -> None:
        if cls.engine is not None and cls.plan.cuda_graphs:
            drop_inference_cuda_graphs(cls.model)
        cls.model = cls.tokenizer = cls.plan = cls.engine = None
        _ROTARY_TABLES.clear()


def release_engine() -> None:
    """Free the cached inference engine (its KV cache and CUDA graphs)."""
    _Engines.release()


def set_inference_cuda_graphs(model, on: bool) -> None:
    """THE switch for CUDA graphs (one place): megatron-core's inference graphs, block scope. On:
    `cuda_graph_impl="local"` and `inference_cuda_graph_scope=block` on the model's config and a new
    `CudaGraphManager` on each decoder block, as a `TransformerBlock` built with those settings would own
    (our models are built without graphs: training owns the config). Block scope graphs only forward
    passes that carry a dynamic inference context in inference mode (`TransformerBlock.
    _should_call_local_cudagraph`), so training and scoring forwards of the same model stay eager. The
    engine captures the graphs when it is built (`DynamicInferenceEngine.create_cuda_graphs`, sizes from
    `InferenceConfig.num_cuda_graphs`).

    A new manager for every engine: a manager keys its graphs by batch dimensions alone
    (`CudaGraphManager.__call__`: `cache_key = context.padded_batch_dimensions`, token / prefill / decode
    counts) and keeps them in `custom_cudagraphs_lookup_table`, which `delete_cuda_graphs` does not clear.
    Kept across engines, the next engine's capture finds the old engine's runner under the same key, captures
    into it and then checks the call against the arguments that runner was made with
    (`_CudaGraphRunner.replay_graph_capture` / `get_mismatch_errors`): the old `inference_context` (compared
    by identity) and, with another `max_sequence_length`, a `rotary_pos_emb` of another length →
    `AssertionError: CUDA graph argument mismatch`; it would also keep the old context, and its KV cache,
    alive. `need_backward=False`: inference graphs have no backward pass, and a manager that may need one
    swaps `torch.autograd.function.FunctionCtx.save_for_backward` process-wide for an observer that only
    graph creation puts back (`_CudagraphGlobalRecord._enable_saved_tensors_observer`), which training
    between two generate calls (GRPO) would then run under.

    Off: the config back to no inference graphs and the managers dropped (`drop_inference_cuda_graphs`)."""
    from megatron.core.transformer.cuda_graphs import CudaGraphManager
    from megatron.core.transformer.enums import InferenceCudaGraphScope
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = model.config
    if not on:
        if config.inference_cuda_graph_scope == InferenceCudaGraphScope.block:
            config.cuda_graph_impl, config.inference_cuda_graph_scope = "none", InferenceCudaGraphScope.none
        _drop_block_managers(model)
        return
    config.cuda_graph_impl = "local"
    config.inference_cuda_graph_scope = InferenceCudaGraphScope.block
    for block in [m for m in model.modules() if isinstance(m, TransformerBlock)]:
        block.cudagraph_manager = CudaGraphManager(config, need_backward=False)


def _drop_block_managers(model) -> None:
    """Remove the decoder blocks' CUDA-graph managers (the block then runs eagerly; only inference uses them:
    `TransformerBlock._should_call_local_cudagraph`)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    for block in [m for m in model.modules() if isinstance(m, TransformerBlock)]:
        if hasattr(block, "cudagraph_manager"):
            del block.cudagraph_manager


def drop_inference_cuda_graphs(model) -> None:
    """Free the inference CUDA graphs captured for `model` and forget them: megatron-core's
    `delete_cuda_graphs` (the graphs, their memory pool, its global record) and the blocks' managers, which
    still map batch dimensions to the old runners (see `set_inference_cuda_graphs`)."""
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    delete_cuda_graphs()
    _drop_block_managers(model)


def _build_engine(model, tokenizer, plan: EnginePlan):
    """megatron-core's `DynamicInferenceEngine` for `plan`: context, GPT inference wrapper, controller."""
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.contexts import DynamicInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    set_inference_cuda_graphs(model, plan.cuda_graphs)
    # At EP > 1 the context sets up buffers for megatron-core's inference-optimized MoE dispatcher whatever
    # the model's implementation: the default, NVLS, needs NVLink multicast (symmetric memory); NCCL's
    # all-gather needs nothing special (our models keep their own dispatcher either way).
    model.config.inference_moe_token_dispatcher_type = "nccl"
    config = InferenceConfig(block_size_tokens=plan.block_size_tokens, buffer_size_gb=plan.kv_cache_gb,
                             max_requests=plan.max_requests, max_tokens=plan.max_tokens,
                             max_sequence_length=plan.max_sequence_length,
                             num_cuda_graphs=NUM_CUDA_GRAPHS if plan.cuda_graphs else None,
                             use_cuda_graphs_for_non_decode_steps=plan.non_decode_graphs,
                             **({"async_sched_mode": _async_mode()} if plan.async_scheduling else {}))
    context = DynamicInferenceContext(model.config, config)
    # The KV cache is `torch.empty`: FA4's paged kernel loads whole pages and multiplies the unwritten rows of a
    # request's last page by 0, which is NaN if they hold NaN or Inf bits (its `flash_attn_varlen_func`
    # docstring: those rows must be finite), e.g. memory a -inf attention mask used before. Zeroed once here.
    buffer = getattr(context, "memory_buffer", None)
    if buffer is not None:
        buffer.zero_()
    controller = TextGenerationController(GPTInferenceWrapper(model, context), tokenizer)
    return _dynamic_engine_class()(controller, context)


def _async_mode():
    from megatron.core.inference.config import AsyncScheduleMode

    return AsyncScheduleMode.ASYNC


def _dynamic_engine_class() -> type:
    """megatron-core's `DynamicInferenceEngine`. Its package imports the data-parallel coordinator, whose
    module calls `faulthandler.enable()`, which needs `sys.stderr` to be a real file: under a captured or
    redirected stderr (pytest, a notebook) the import runs with the process's own stderr in place."""
    import sys

    saved = sys.stderr
    try:
        saved.fileno()
    except (AttributeError, OSError, ValueError):
        sys.stderr = sys.__stderr__
    try:
        from megatron.core.inference.engines import DynamicInferenceEngine
    finally:
        sys.stderr = saved
    return DynamicInferenceEngine


def _tokens_so_far(record) -> list[int]:
    """A request's generated tokens, over the pieces of a request the engine evicted and re-queued."""
    return [t for request in record.requests for t in request.generated_tokens]


class _StopStrings:
    """Ends a request at the token whose addition makes its generated text contain a stop string.
    megatron-core's own `SamplingParams.stop_words` match token sequences (a stop string tokenized
    alone), which misses one that ends inside a token or tokenizes differently in context. The engine's
    controller asks a callback, after sampling and before it updates the requests, which active requests
    to end (`set_stop_word_finished_ids_callback`): here it decodes the tail of each request's tokens
    with the newly sampled one. A request ended there keeps that token and stops at once, like one that
    sampled its end token (no forward pass is spent on it after that)."""

    def __init__(self, engine, tokenizer, stop: Sequence[str]):
        self.engine, self.tokenizer, self.stop = engine, tokenizer, tuple(stop)
        self.window = stop_window(self.stop)

    def __call__(self, active_request_ids: list[int]) -> set[int]:
        sampled = self.engine.controller._sampled_tokens_cuda[: len(active_request_ids)].tolist()
        done = set()
        for request_id, token in zip(active_request_ids, sampled):
            tokens = _tokens_so_far(self.engine.requests[request_id].record)[-self.window:] + [token]
            if holds_stop(self.tokenizer, tokens, self.stop):
                done.add(request_id)
        return done


def _run(engine, tokenizer, prompts: list[list[int]], sampling: Sampling, on_tokens) -> list[list[int]]:
    """Queue every prompt, step the engine until all have finished, return their tokens in order."""
    from megatron.core.inference.inference_request import Status

    params = sampling.megatron_params()
    stop_id = sampling.stop_id
    engine.controller.sampling_rng.manual_seed(sampling.seed)
    engine.controller.set_stop_word_finished_ids_callback(
        _StopStrings(engine, tokenizer, sampling.stop) if sampling.stop
        else engine._get_and_clear_stop_word_finished_ids)
    out: list[list[int] | None] = [None] * len(prompts)
    shown = [0] * len(prompts)

    def final(tokens: list[int]) -> list[int]:
        # the engine keeps the end token it sampled; ours are the tokens before it
        return tokens[:-1] if stop_id is not None and tokens and tokens[-1] == stop_id else tokens

    for i, prompt in enumerate(prompts):
        engine.add_request(i, list(prompt), params)
    while engine.has_unfinished_requests():
        step = engine.step_modern()
        for record in step["finished_request_records"]:
            request = record.merge()
            if request.status == Status.FAILED:
                raise RuntimeError(f"the inference engine refused prompt {request.request_id + 1} "
                                   f"({len(request.prompt_tokens)} tokens): "
                                   f"{[e.payload for e in request.events if e.payload is not None]}")
            out[request.request_id] = final(list(request.generated_tokens))
        if on_tokens is not None:
            for i in step["active_request_ids"]:
                tokens = _tokens_so_far(engine.requests[i].record)
                if len(tokens) > shown[i]:
                    shown[i] = len(tokens)
                    on_tokens(i, tokens)
            for record in step["finished_request_records"]:
                i = record.request_id
                if len(out[i]) > shown[i]:
                    shown[i] = len(out[i])
                    on_tokens(i, out[i])
    return out
