"""Inference on megatron-core: load a Megatron checkpoint (as stored, any layout) or an HF folder into
this rank's `GPTModel`, and generate with one of megatron-core's inference engines (`choose_engine`): the
dynamic one (`DynamicInferenceEngine` over a `DynamicInferenceContext`: continuous batching over a paged
KV cache, CUDA graphs on a GPU) or the static-batch controller; greedy or sampled with temperature /
top-k / top-p; stop strings, end token.
Used by `python -m megatron_patch.generate` and `.evaluate`, lm-eval's `generate_until` and GRPO's
rollouts (which share `read_prompts`)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from megatron_patch.names import DTYPE_NAMES, IMPLS, torch_dtype


def load_model(mcore_dir: str | None, hf_dir: str | None, tp: int = 1, pp: int = 1, impl: str | None = None,
               dtype=None, ep: int = 1):
    """(this rank's GPTModel, hf_config): a Megatron checkpoint as stored (its own implementation), or
    an HF folder converted in memory for this rank (`impl`, default local; `dtype` default fp32)."""
    import torch

    dtype = dtype or torch.float32
    if mcore_dir:
        from megatron_patch.conversion.megatron_checkpoint import load_megatron_model

        return load_megatron_model(mcore_dir, tp, pp, impl, dtype, ep=ep)
    from megatron_patch.conversion.engine import load_hf_into_rank, make_plan
    from megatron_patch.conversion.hf_io import HFCheckpoint
    from megatron_patch.models import Layout, build_model, get_family, load_hf_config

    impl = impl or "local"
    cfg = load_hf_config(hf_dir)
    family = get_family(cfg)
    model = build_model(cfg, tp, pp, impl=impl, dtype=dtype, perform_initialization=False, ep=ep, family=family)
    ckpt = HFCheckpoint(hf_dir)
    load_hf_into_rank(model, make_plan(cfg, Layout(tp, pp, ep=ep), impl, family), ckpt.get, ckpt.keys(), dtype)
    return model.eval(), cfg


def add_model_args(parser) -> None:
    """The model options shared by `generate`, `evaluate` and GRPO."""
    from megatron_patch.cli import positive_int

    parser.add_argument("--mcore-dir", help="a Megatron checkpoint (either format, any stored layout)")
    parser.add_argument("--hf-dir", help="or an HF folder, converted in memory")
    parser.add_argument("--tokenizer", help="tokenizer folder / model (default: the checkpoint's hf/ or --hf-dir)")
    parser.add_argument("--tp", type=positive_int, default=1, metavar="N",
                        help="tensor parallel ranks (>1: under torchrun with TP x PP processes)")
    parser.add_argument("--pp", type=positive_int, default=1, metavar="N", help="pipeline parallel ranks")
    parser.add_argument("--ep", type=positive_int, default=1, metavar="N",
                        help="expert parallel ranks (mixture-of-experts models)")
    parser.add_argument("--impl", choices=IMPLS,
                        help="model implementation (default: a Megatron checkpoint's own; local for --hf-dir)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="fp32",
                        help="weights and activations (bf16 is the usual choice on a GPU)")


def model_folder(mcore_dir: str | None, hf_dir: str | None) -> str:
    """The folder holding a model's HF config and tokenizer: an HF folder itself, or a Megatron
    checkpoint's `hf/` (what the converter and our training runs keep beside the weights)."""
    import os

    from megatron_patch.conversion.mcore_io import HF_SUBDIR

    return hf_dir if hf_dir else os.path.join(mcore_dir or "", HF_SUBDIR)


def model_and_tokenizer(args, before_loading=None):
    """(model, the model's vocab_size, tokenizer) for `add_model_args` options; paths, and the tokenizer against the
    model's vocab, are checked (`before_loading(tokenizer)` runs before the weights are read)."""
    import os

    from megatron_patch.models import Layout, get_family
    from megatron_patch.tokenizer import build_tokenizer

    if not (args.mcore_dir or args.hf_dir):
        raise ValueError("pass --mcore-dir CKPT or --hf-dir DIR")
    for path in (args.mcore_dir, args.hf_dir):
        if path and not os.path.exists(path):
            raise ValueError(f"{path} does not exist")
    tokenizer = build_tokenizer(args.tokenizer or model_folder(args.mcore_dir, args.hf_dir))
    if before_loading is not None:
        before_loading(tokenizer)
    model, cfg = load_model(args.mcore_dir, args.hf_dir, args.tp, args.pp, args.impl, torch_dtype(args.dtype), args.ep)
    vocab = get_family(cfg).shapes(cfg, Layout()).vocab_size
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {vocab}")
    return model, vocab, tokenizer


def read_prompts(path: str | None, tokenizer, chat: bool = False) -> tuple[list[str], list[list[int]]]:
    """(prompt texts, their token ids) from a JSONL file of `prompt` (text) or chat `messages` rows, or,
    with `path=None`, one prompt per non-blank stdin line. `messages` rows, and `prompt` rows with `chat`,
    are rendered with the tokenizer's chat template and a generation prompt. An empty prompt (an empty
    string or message list, or text that tokenizes to nothing) is refused with its line number."""
    import os
    import sys

    from megatron_patch.jsonl import read_jsonl_numbered

    if path is not None:
        if not os.path.isfile(path):
            raise ValueError(f"{path} does not exist")
        where, rows = path, read_jsonl_numbered(path, need_any=("prompt", "messages"))
    else:
        where, rows = "<stdin>", [(n, {"prompt": line.rstrip("\n")}) for n, line in enumerate(sys.stdin, 1)
                                  if line.strip()]
    texts, ids = [], []
    for n, row in rows:
        if "messages" in row:
            messages = row["messages"]
            if not isinstance(messages, list):
                raise ValueError(f"{where}, line {n}: 'messages' must be a list of messages")
        else:
            if not isinstance(row["prompt"], str):
                raise ValueError(f"{where}, line {n}: 'prompt' must be a string")
            messages = [{"role": "user", "content": row["prompt"]}] if chat and row["prompt"] else None
        if messages is not None:
            if not messages:
                raise ValueError(f"{where}, line {n}: empty prompt")
            try:
                prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True).ids)
            except ValueError as e:
                raise ValueError(f"{where}, line {n}: {e}") from e
            text = tokenizer.detokenize(prompt)
        else:
            text = row["prompt"]
            prompt = tokenizer.tokenize(text) if text else []
        if not prompt:
            raise ValueError(f"{where}, line {n}: empty prompt")
        texts.append(text)
        ids.append(prompt)
    if not ids:
        raise ValueError(f"no prompts in {where}")
    return texts, ids


def check_stop(stop: Sequence[str], name: str = "stop") -> None:
    """Stop strings must be non-empty: every text contains the empty string. `name`: the argument or flag
    the errors name."""
    if any(s == "" for s in stop):
        raise ValueError(f"{name}: an empty string would end every generation at its first token")



# KV cache page size in tokens: megatron-core's default (flash-attn's paged kernels want a multiple of 256).
BLOCK_SIZE_TOKENS = 256
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


def default_max_requests() -> int:
    """Requests in flight when none is asked for (`DEFAULT_MAX_REQUESTS`, by device)."""
    import torch

    return DEFAULT_MAX_REQUESTS["cuda" if torch.cuda.is_available() else "cpu"]


def context_length(model) -> int:
    """The longest sequence (prompt + generated tokens) this GPTModel takes: its max_position_embeddings."""
    from megatron.core.utils import unwrap_model

    return int(unwrap_model(model).max_sequence_length)


def context_length_of(mcore_dir: str | None, hf_dir: str | None) -> int | None:
    """The model's context (prompt + generated tokens; its family's reading of max_position_embeddings)
    from its HF config, before any weight is read; None if the config cannot be found (loading then
    fails with its own error)."""
    import os

    from megatron_patch.models import get_family, load_hf_config

    folder = model_folder(mcore_dir, hf_dir)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return None
    cfg = load_hf_config(folder)
    return get_family(cfg).max_sequence_length(cfg)


def check_lengths(prompts: Sequence[Sequence[int]], max_new_tokens: int, context: int,
                  name: str = "max_new_tokens") -> None:
    """Every prompt plus `max_new_tokens` must fit the model's context (`name`: the option the error
    names)."""
    for i, prompt in enumerate(prompts):
        if len(prompt) + max_new_tokens > context:
            raise ValueError(f"prompt {i + 1} has {len(prompt)} tokens: with {name} {max_new_tokens} it needs "
                             f"{len(prompt) + max_new_tokens}, more than the model's context of {context} tokens "
                             "(max_position_embeddings)")


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

    def covers(self, other: EnginePlan) -> bool:
        """An engine built for this plan serves `other` as well: the same graphs, at least as much room, and
        the same in-flight maximum where it binds (more slots than a call has requests change nothing)."""
        slots = (self.max_requests == other.max_requests
                 or (not other.bounded and self.max_requests >= other.max_requests))
        return (slots and (self.cuda_graphs, self.non_decode_graphs) == (other.cuda_graphs, other.non_decode_graphs)
                and self.max_sequence_length >= other.max_sequence_length and self.max_tokens >= other.max_tokens
                and self.kv_cache_gb >= other.kv_cache_gb)


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V one token occupies in this rank's cache (its layers, its share of KV heads)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config = model.config
    heads = config.num_query_groups or config.num_attention_heads
    heads_here = max(1, heads // config.tensor_model_parallel_size)
    layers = sum(isinstance(m, TransformerLayer) for m in model.modules())
    return 2 * layers * heads_here * config.kv_channels * config.params_dtype.itemsize


def plan_engine(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, max_requests: int | None = None,
                kv_cache_gb: float | None = None, cuda_graphs: bool | None = None) -> EnginePlan:
    """The engine for these requests. `max_requests` (default `default_max_requests()`) is capped at the
    number of requests and rounded up to a multiple of TP (megatron-core splits requests over TP ranks
    in its CUDA-graph bookkeeping). `kv_cache_gb` None: the automatic budget (`KV_SHARE_OF_FREE_MEMORY`);
    a budget that cannot hold the longest request is refused. `cuda_graphs` None: on a GPU, at PP = EP = 1
    (graphs at PP > 1 are untested here; at EP > 1 megatron-core also wants MoE layers padded for them)."""
    import torch

    from megatron_patch import patches

    tp = model.config.tensor_model_parallel_size
    longest = max(len(p) for p in prompts)
    n = min(max_requests or default_max_requests(), len(prompts))
    n = -(-n // tp) * tp
    block = BLOCK_SIZE_TOKENS * kv_bytes_per_token(model)
    blocks_per_request = -(-(longest + max_new_tokens) // BLOCK_SIZE_TOKENS)
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
        holds = max(budget // block - 1, 0) * BLOCK_SIZE_TOKENS
        raise ValueError(f"{given} holds {holds} tokens; the longest request needs {longest + max_new_tokens} "
                         f"({longest} prompt + {max_new_tokens} new tokens), in blocks of {BLOCK_SIZE_TOKENS} tokens "
                         f"{blocks_per_request * block / 1024 ** 3:.3g} GiB: raise --kv-cache-gb")
    if cuda_graphs is None:
        from megatron.core import parallel_state as ps

        cuda_graphs = (torch.cuda.is_available() and model.config.pipeline_model_parallel_size == 1
                       and ps.get_expert_model_parallel_world_size() == 1)
    if cuda_graphs and not torch.cuda.is_available():
        raise ValueError("CUDA graphs need a GPU")
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    return EnginePlan(max_requests=n, bounded=n < len(prompts), max_sequence_length=longest + max_new_tokens,
                      max_tokens=max(DynamicInferenceContext.DEFAULT_MAX_TOKENS, longest, n),
                      kv_cache_gb=budget / 1024 ** 3, cuda_graphs=cuda_graphs,
                      non_decode_graphs=not patches.is_active("paged_attention_in_torch"))


def unsupported_attention(model) -> str | None:
    """Why megatron-core's dynamic engine cannot run this model's attention, or None. The engine attends
    through its own paged-KV kernel (`Attention.flash_decode_and_prefill`), not the layer's core
    attention, so attention that lives in the core attention is lost there: ALiBi biases
    (`models/modules/alibi.py`: Bloom, Baichuan-13B); multi-latent attention needs megatron-core's
    cached-latent FlashMLA path (DeepSeek)."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    from megatron_patch.models.modules.alibi import AlibiDotProductAttention

    for m in model.modules():
        if isinstance(m, MultiLatentAttention):
            return "multi-latent attention (it needs megatron-core's cached-latent FlashMLA kernels)"
        if isinstance(m, AlibiDotProductAttention) or getattr(m, "alibi_slopes", None) is not None:
            return "ALiBi attention (the engine's paged attention adds no position bias)"
    return None


ENGINES = ("auto", "static", "dynamic")


def choose_engine(model, engine: str = "auto") -> str:
    """Which of megatron-core's inference engines runs `generate`:
    - "static": the static-batch controller (fixed batches of `max_batch_size`, a KV cache per batch; TP
      and EP; not PP > 1) — the path measured on the GPU machine so far (greedy = HF there);
    - "dynamic": `DynamicInferenceEngine` (continuous batching over a paged KV cache, CUDA graphs on a GPU;
      TP, PP and EP; not ALiBi or multi-latent attention: `unsupported_attention`);
    - "auto": static, except where only the dynamic engine runs the model (PP > 1). The dynamic engine's
      GPU path (CUDA graphs, flash-attn's paged kernels) has not been measured yet; it becomes the
      default once it has."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine != "auto":
        return engine
    return "dynamic" if model.config.pipeline_model_parallel_size > 1 else "static"


def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 1, top_p: float = 0.0, seed: int = 1234, max_batch_size: int | None = None,
             stop_id: int | None = None, on_tokens: Callable[[int, list[int]], None] | None = None,
             stop: Sequence[str] = (), kv_cache_gb: float | None = None,
             cuda_graphs: bool | None = None, engine: str = "auto") -> list[list[int]]:
    """New token ids for each prompt, on megatron-core's inference engine `engine` (`choose_engine`). On the
    dynamic engine all prompts are queued at once and run with continuous batching, at most
    `max_batch_size` in flight (default `default_max_requests()`); a request that finishes frees its slot
    and KV blocks for the next one. On the static one, prompts run in batches of `max_batch_size` (default
    `DEFAULT_MAX_REQUESTS["cpu"]`), prompts of different lengths together.
    A generation ends after `max_new_tokens`, before `stop_id` (the end token: left out of the result;
    None: no early end), or at the token whose addition makes the generated text (its detokenization)
    contain one of the `stop` strings: that token is the last one returned, so the text ends with the
    stop string, plus the rest of that token's text when the stop string ends inside it. top_k=1 is
    greedy; otherwise tokens are sampled (temperature, top-k or top-p) from one generator seeded with
    `seed` (reproducible for the same requests, `max_batch_size` and engine). `on_tokens(prompt index,
    tokens so far)` is called after every step in which a request grew. Dynamic engine only:
    `kv_cache_gb`, this rank's KV cache budget (default: `plan_engine`'s automatic one); `cuda_graphs`,
    capture CUDA graphs (default: on a GPU). Every rank of a TP / PP / EP group calls this with the same
    arguments."""
    import torch

    from megatron_patch import patches

    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: generation needs at least one prompt token")
    check_stop(stop)
    if top_k == 1:
        top_p = 0.0  # greedy: the argmax, whatever the other filters say
    elif top_k > 0 and top_p > 0:
        raise ValueError(f"top_k {top_k} and top_p {top_p}: megatron-core samples with one of the two filters")
    if top_k != 1 and temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling (got {temperature}); greedy decoding is top_k=1")
    check_lengths(prompts, max_new_tokens, context_length(model))
    if choose_engine(model, engine) == "static":
        if model.config.pipeline_model_parallel_size > 1:
            raise ValueError("the static inference engine does not run pipeline-parallel models: use the dynamic "
                             "one (--engine dynamic)")
        return _generate_static(model, tokenizer, prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                max_batch_size or DEFAULT_MAX_REQUESTS["cpu"], stop_id, on_tokens, stop)
    why = unsupported_attention(model)
    if why is not None:
        raise ValueError(f"megatron-core's dynamic inference engine does not support {why}: use the static one "
                         "(--engine static)")
    with (torch.no_grad(), patches.applied("cpu_cuda_calls"), patches.applied("paged_attention_in_torch"),
          _inference_mode()):
        _require_einops()
        plan = plan_engine(model, prompts, max_new_tokens, max_batch_size, kv_cache_gb, cuda_graphs)
        engine = _Engines.get(model, tokenizer, plan)
        return _run(engine, tokenizer, prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_id, on_tokens,
                    stop)


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
        cls.engine = _build_engine(model, tokenizer, plan)
        cls.model, cls.tokenizer, cls.plan = model, tokenizer, plan
        return cls.engine

    @classmethod
    def release(cls) -> None:
        if cls.engine is not None and cls.plan.cuda_graphs:
            from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

            delete_cuda_graphs()
        cls.model = cls.tokenizer = cls.plan = cls.engine = None


def release_engine() -> None:
    """Free the cached inference engine (its KV cache and CUDA graphs)."""
    _Engines.release()


def set_inference_cuda_graphs(model, on: bool) -> None:
    """THE switch for CUDA graphs (one place): megatron-core's inference graphs, block scope. On:
    `cuda_graph_impl="local"` and `inference_cuda_graph_scope=block` on the model's config and a
    `CudaGraphManager` on each decoder block, as a `TransformerBlock` built with those settings would own
    (our models are built without graphs: training owns the config). Block scope graphs only forward
    passes that carry a dynamic inference context in inference mode (`TransformerBlock.
    _should_call_local_cudagraph`), so training and scoring forwards of the same model stay eager. The
    engine captures the graphs when it is built (`DynamicInferenceEngine.create_cuda_graphs`, sizes from
    `InferenceConfig.num_cuda_graphs`). Off: the config back to no inference graphs (the managers stay,
    unused)."""
    from megatron.core.transformer.cuda_graphs import CudaGraphManager
    from megatron.core.transformer.enums import InferenceCudaGraphScope
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = model.config
    if not on:
        if config.inference_cuda_graph_scope == InferenceCudaGraphScope.block:
            config.cuda_graph_impl, config.inference_cuda_graph_scope = "none", InferenceCudaGraphScope.none
        return
    config.cuda_graph_impl = "local"
    config.inference_cuda_graph_scope = InferenceCudaGraphScope.block
    for m in model.modules():
        if isinstance(m, TransformerBlock) and not hasattr(m, "cudagraph_manager"):
            m.cudagraph_manager = CudaGraphManager(config)


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
    config = InferenceConfig(block_size_tokens=BLOCK_SIZE_TOKENS, buffer_size_gb=plan.kv_cache_gb,
                             max_requests=plan.max_requests, max_tokens=plan.max_tokens,
                             max_sequence_length=plan.max_sequence_length,
                             num_cuda_graphs=NUM_CUDA_GRAPHS if plan.cuda_graphs else None,
                             use_cuda_graphs_for_non_decode_steps=plan.non_decode_graphs)
    context = DynamicInferenceContext(model.config, config)
    controller = TextGenerationController(GPTInferenceWrapper(model, context), tokenizer)
    return _dynamic_engine_class()(controller, context)


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


def _stop_window(stop: Sequence[str]) -> int:
    """How many of the newest tokens a stop string completed by the newest one lies within: a character
    spans at most 4 byte-level tokens, plus a margin so that the tail's first tokens (a partial
    character, a dropped leading space) stay clear of it. Decoding only that tail keeps a step's cost
    independent of the length generated so far."""
    return 4 * max((len(s) for s in stop), default=0) + 8


def _holds_stop(tokenizer, tail: list[int], stop: Sequence[str]) -> bool:
    text = tokenizer.detokenize(tail)
    return any(s in text for s in stop)


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
        self.window = _stop_window(self.stop)

    def __call__(self, active_request_ids: list[int]) -> set[int]:
        sampled = self.engine.controller._sampled_tokens_cuda[: len(active_request_ids)].tolist()
        done = set()
        for request_id, token in zip(active_request_ids, sampled):
            tokens = _tokens_so_far(self.engine.requests[request_id].record)[-self.window:] + [token]
            if _holds_stop(self.tokenizer, tokens, self.stop):
                done.add(request_id)
        return done


def _run(engine, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float, top_k: int,
         top_p: float, seed: int, stop_id: int | None, on_tokens, stop: Sequence[str]) -> list[list[int]]:
    """Queue every prompt, step the engine until all have finished, return their tokens in order."""
    from megatron.core.inference.inference_request import Status
    from megatron.core.inference.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, num_tokens_to_generate=max_new_tokens,
                            termination_id=-1 if stop_id is None else stop_id)
    engine.controller.sampling_rng.manual_seed(seed)
    engine.controller.set_stop_word_finished_ids_callback(
        _StopStrings(engine, tokenizer, stop) if stop else engine._get_and_clear_stop_word_finished_ids)
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


def _generate_static(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                     top_k: int, top_p: float, seed: int, batch_size: int, stop_id: int | None, on_tokens,
                     stop: Sequence[str]) -> list[list[int]]:
    """`generate` on megatron-core's static-batch controller: batches of `batch_size` prompts, each with
    its own KV cache; a batch stops computing once all its requests hit the end token or a stop string."""
    import time
    from collections import OrderedDict

    import torch
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.inference_request import InferenceRequest, Status
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_patch import patches

    longest = max(len(p) for p in prompts) + max_new_tokens
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, num_tokens_to_generate=max_new_tokens,
                            termination_id=-1 if stop_id is None else stop_id)
    params.no_detokenize_streaming_text = True  # streamed tokens are decoded by the caller
    params.no_early_termination = stop_id is None  # megatron otherwise stops at the tokenizer's eod
    out: list[list[int]] = []
    with torch.no_grad(), patches.applied("cpu_cuda_calls"):
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start: start + batch_size]
            context = StaticInferenceContext(max_batch_size=len(batch), max_sequence_length=longest)
            controller = _static_controller()(GPTInferenceWrapper(model, context), tokenizer,
                                              [len(p) for p in batch], stop)
            controller.sampling_rng.manual_seed(seed + start)  # the controller samples from its own generator
            requests = OrderedDict(
                (i, InferenceRequest(request_id=i, prompt="", sampling_params=params, prompt_tokens=list(p),
                                     arrival_time=time.time(), status=Status.ACTIVE_BUT_NOT_GENERATING_TOKENS))
                for i, p in enumerate(batch))
            streams = (OrderedDict((i, _Stream(lambda tokens, n=start + i: on_tokens(n, tokens))) for i in requests)
                       if on_tokens is not None else None)
            done = controller.generate_all_output_tokens_static_batch(requests, streams)
            for i in range(len(batch)):
                tokens = done[i].generated_tokens
                out.append(tokens.tolist() if hasattr(tokens, "tolist") else list(tokens))
    return out


@functools.cache
def _static_controller() -> type:
    """megatron's `TextGenerationController`, also ending a request of a static batch once its generated
    text contains a stop string (built on first use: megatron-core is imported lazily)."""
    import torch
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class StopStringController(TextGenerationController):
        """megatron-core 0.19's static-batch path has no stop strings (`SamplingParams.stop_words` is
        served by the dynamic engine's bookkeeping only), but after every step it asks
        `update_generation_status` which requests are done. A request marked done there stops growing
        (its generated length no longer counts, its stream ends), and the loop ends once all are done."""

        def __init__(self, inference_wrapped_model, tokenizer, prompt_lengths: list[int], stop: Sequence[str]):
            super().__init__(inference_wrapped_model, tokenizer)
            self.prompt_lengths, self.stop, self.window = prompt_lengths, tuple(stop), _stop_window(stop)

        def update_generation_status(self, updated_prompts_tokens, generation_started, current_context_end_position,
                                     is_generation_done_tensor, generated_sequence_lengths, termination_id=None):
            done, lengths = super().update_generation_status(
                updated_prompts_tokens, generation_started, current_context_end_position, is_generation_done_tensor,
                generated_sequence_lengths, termination_id)
            if not self.stop:
                return done, lengths
            # the newest token is already counted in `lengths`: marking the request done now keeps it
            live = (generation_started & ~done).tolist()
            if not any(live):
                return done, lengths
            end = current_context_end_position + 1
            low = max(0, end - self.window)
            tail = updated_prompts_tokens[:, low:end].tolist()  # one device-to-host copy per step
            hit = [alive and _holds_stop(self.tokenizer, row[max(start - low, 0):], self.stop)
                   for alive, row, start in zip(live, tail, self.prompt_lengths)]
            if any(hit):
                done = done | torch.tensor(hit, device=done.device)
            return done, lengths

    return StopStringController


class _Stream:
    """What megatron's static-batch streaming needs of a stream (`put`, `finish`, `finished`; its own
    AsyncStream needs an asyncio loop): each put carries the request's tokens generated so far."""

    def __init__(self, callback: Callable[[list[int]], None]):
        self.callback, self.finished = callback, False

    def put(self, request) -> None:
        tokens = request.generated_tokens
        self.callback(tokens.tolist() if hasattr(tokens, "tolist") else list(tokens))

    def finish(self, exception=None) -> None:
        self.finished = True
