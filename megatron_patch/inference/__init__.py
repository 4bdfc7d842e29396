"""Inference on megatron-core: load a Megatron checkpoint (as stored, any layout) or an HF folder into
this rank's `GPTModel`, and generate with one of megatron-core's inference engines (`choose_engine`): the
dynamic one (`DynamicInferenceEngine` over a `DynamicInferenceContext`: continuous batching over a paged
KV cache, CUDA graphs on a GPU) or the static-batch controller; greedy or sampled with temperature /
top-k / top-p; stop strings, end token.
Used by `python -m megatron_patch.generate` and `.evaluate`, lm-eval's `generate_until` and GRPO's
rollouts (which share `read_prompts`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron_patch.inference.sampling import Sampling
from megatron_patch.names import DTYPE_NAMES, IMPLS, torch_dtype


def load_model(mcore_dir: str | None, hf_dir: str | None, *, layout=None, impl: str | None = None, dtype=None):
    """(this rank's GPTModel, hf_config): a Megatron checkpoint as stored (its own implementation), or
    an HF folder converted in memory for this rank (`impl`, default local; `dtype` default fp32), at `layout`
    (a `models.Layout`; default TP = PP = EP = 1)."""
    import torch

    from megatron_patch.models import Layout

    dtype, layout = dtype or torch.float32, layout or Layout()
    if mcore_dir:
        from megatron_patch.conversion.megatron_checkpoint import load_megatron_model

        return load_megatron_model(mcore_dir, layout=layout, impl=impl, dtype=dtype)
    from megatron_patch.conversion.engine import load_hf_into_rank, make_plan
    from megatron_patch.conversion.hf_io import HFCheckpoint
    from megatron_patch.models import build_model, get_family, load_hf_config

    impl = impl or "local"
    cfg = load_hf_config(hf_dir)
    family = get_family(cfg)
    model = build_model(cfg, layout=layout, impl=impl, dtype=dtype, perform_initialization=False, family=family)
    ckpt = HFCheckpoint(hf_dir)
    load_hf_into_rank(model, make_plan(cfg, layout, impl, family), ckpt.get, ckpt.keys(), dtype,
                      reader=ckpt)  # this rank's TP slices only, where the mapping allows
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

    from megatron_patch.names import HF_SUBDIR

    return hf_dir if hf_dir else os.path.join(mcore_dir or "", HF_SUBDIR)


def model_and_tokenizer(args, before_loading=None):
    """(model, the model's vocab_size, tokenizer) for `add_model_args` options; paths, and the tokenizer against the
    model's vocab, are checked (`before_loading(tokenizer)` runs before the weights are read)."""
    import os

    from megatron_patch.models import vocab_size
    from megatron_patch.tokenizer import build_tokenizer

    if not (args.mcore_dir or args.hf_dir):
        raise ValueError("pass --mcore-dir CKPT or --hf-dir DIR")
    for path in (args.mcore_dir, args.hf_dir):
        if path and not os.path.exists(path):
            raise ValueError(f"{path} does not exist")
    tokenizer = build_tokenizer(args.tokenizer or model_folder(args.mcore_dir, args.hf_dir))
    if before_loading is not None:
        before_loading(tokenizer)
    from megatron_patch.models import Layout

    model, cfg = load_model(args.mcore_dir, args.hf_dir, layout=Layout(args.tp, args.pp, ep=args.ep), impl=args.impl,
                            dtype=torch_dtype(args.dtype))
    vocab = vocab_size(cfg)
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {vocab}")
    return model, vocab, tokenizer


def read_prompts(path: str | None, tokenizer, chat: bool = False) -> tuple[list[str], list[list[int]]]:
    """(prompt texts, their token ids) from a JSONL file of `prompt` (text) or chat `messages` rows, or,
    with `path=None`, one prompt per non-blank stdin line. `messages` rows, and `prompt` rows with `chat`,
    are rendered with the tokenizer's chat template and a generation prompt. An empty prompt (an empty
    string or message list, or text that tokenizes to nothing) is refused with its line number."""
    import os

    from megatron_patch.jsonl import read_jsonl_numbered

    if path is not None:
        if not os.path.isfile(path):
            raise ValueError(f"{path} does not exist")
        where, rows = path, read_jsonl_numbered(path, need_any=("prompt", "messages"))
    else:
        where, rows = "<stdin>", [(n, {"prompt": line.rstrip("\n")}) for n, line in enumerate(stdin_lines(), 1)
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


def stdin_lines() -> list[str]:
    """Standard input's lines. Under torchrun every process inherits the one stdin and the first to read it
    takes all: the first rank reads, and its lines are sent to the others."""
    import sys

    import torch.distributed as dist

    from megatron_patch.runtime.parallel import join_launcher_world

    if not join_launcher_world():
        return list(sys.stdin)
    box = [list(sys.stdin) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, 0)
    return box[0]


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


ENGINES = ("auto", "static", "dynamic")


def choose_engine(model, engine: str = "auto") -> str:
    """Which of megatron-core's inference engines runs `generate`:
    - "static": the static-batch controller (fixed batches of `max_batch_size`, a KV cache per batch; TP
      and EP; not PP > 1);
    - "dynamic": `DynamicInferenceEngine` (continuous batching over a paged KV cache, CUDA graphs on a GPU;
      TP, PP and EP; ALiBi through the `alibi_paged_attention` patch; multi-latent attention through
      `mla_latent_cache`, with CUDA graphs on a GPU since 2026-12-05: `dynamic.MLA_ON_GPU`);
    - "auto": the dynamic engine wherever it runs the model (`unsupported_attention`: everywhere, unless
      `dynamic.MLA_ON_GPU` is switched off). Measured on one H200 (docs/benchmarks.md): the dynamic engine with CUDA
      graphs is 4.4x HF `generate` at 1 request at 1B widths and 5.7x at 32; the static engine is slower than HF
      (0.37x at 1B) and 12x slower than the dynamic engine at DeepSeek-V2-Lite's widths."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine != "auto":
        return engine
    from megatron_patch.inference.dynamic import unsupported_attention

    return "static" if unsupported_attention(model) is not None else "dynamic"


def generate(model, tokenizer, prompts: list[list[int]], sampling: Sampling, *, max_batch_size: int | None = None,
             on_tokens: Callable[[int, list[int]], None] | None = None, kv_cache_gb: float | None = None,
             cuda_graphs: bool | None = None, engine: str = "auto") -> list[list[int]]:
    """New token ids for each prompt, picked and ended as `sampling` says (`Sampling`), on megatron-core's
    inference engine `engine` (`choose_engine`). On the dynamic engine all prompts are queued at once and run
    with continuous batching, at most `max_batch_size` in flight (default `dynamic.default_max_requests()`); a
    request that finishes frees its slot and KV blocks for the next one. On the static one, prompts run in
    batches of `max_batch_size` (default `static.DEFAULT_BATCH_SIZE`), prompts of different lengths together.
    Sampled tokens are reproducible for the same requests, `max_batch_size` and engine. `on_tokens(prompt
    index, tokens so far)` is called after every step in which a request grew. Dynamic engine only:
    `kv_cache_gb`, this rank's KV cache budget (default: `dynamic.plan_engine`'s automatic one); `cuda_graphs`,
    capture CUDA graphs (default: on a GPU). Every rank of a TP / PP / EP group calls this with the same
    arguments."""
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: generation needs at least one prompt token")
    check_lengths(prompts, sampling.max_new_tokens, context_length(model))
    try:
        if choose_engine(model, engine) == "static":
            from megatron_patch.inference.static import DEFAULT_BATCH_SIZE, generate_static

            if model.config.pipeline_model_parallel_size > 1:
                raise ValueError("the static inference engine does not run pipeline-parallel models: use the "
                                 "dynamic one (--engine dynamic)")
            return generate_static(model, tokenizer, prompts, sampling, max_batch_size or DEFAULT_BATCH_SIZE,
                                   on_tokens)
        from megatron_patch.inference.dynamic import generate_dynamic

        return generate_dynamic(model, tokenizer, prompts, sampling, max_batch_size, on_tokens, kv_cache_gb,
                                cuda_graphs)
    finally:
        forget_inference_rope()


def forget_inference_rope() -> None:
    """Drop the rotary embeddings megatron-core cached while generating (an lru_cache on the embedding classes'
    `forward`, keyed by sequence length): made under `torch.inference_mode`, they are inference tensors, and a
    training step that meets one in the cache fails where it saves it for backward (TE's fused RoPE does):
    `Inference tensors cannot be saved for backward`. RLHF and custom trainers generate, then train."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    for cls in (rotary_pos_embedding.RotaryEmbedding, yarn_rotary_pos_embedding.YarnRotaryEmbedding):
        clear = getattr(cls.forward, "cache_clear", None)
        if clear is not None:
            clear()
