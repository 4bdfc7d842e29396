"""Inference on megatron-core: load a Megatron checkpoint (as stored, any layout) or an HF folder into
this rank's `GPTModel`, and generate with megatron.core.inference (static batching, KV cache; greedy or
sampled with temperature / top-k / top-p; stop strings). Used by `python -m megatron_patch.generate`
and `.evaluate`, and by GRPO's rollouts (which share `read_prompts`)."""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from megatron_patch.names import DTYPE_NAMES, IMPLS, torch_dtype


def load_model(mcore_dir: str | None, hf_dir: str | None, tp: int = 1, pp: int = 1, impl: str | None = None,
               dtype=None, ep: int = 1):
    """(this rank's GPTModel, hf_config): a Megatron checkpoint as stored (its own implementation), or
    an HF folder converted in memory for this rank (`impl`, default local; `dtype` default fp32)."""
    import torch

    dtype = dtype or torch.float32
    if mcore_dir:
        from megatron_patch.conversion.mcore_io import load_megatron_model

        return load_megatron_model(mcore_dir, tp, pp, impl, dtype, ep=ep)
    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
    from megatron_patch.conversion.hf_io import HFCheckpoint
    from megatron_patch.models import Layout, build_model, load_hf_config
    from megatron_patch.models.family import current_rank

    impl = impl or "local"
    cfg = load_hf_config(hf_dir)
    model = build_model(cfg, tp, pp, impl=impl, dtype=dtype, perform_initialization=False, ep=ep)
    rank = current_rank()
    ckpt = HFCheckpoint(hf_dir)
    state = hf_to_megatron(make_plan(cfg, Layout(tp, pp, ep=ep), impl), ckpt.get, ckpt.keys(), dtype,
                           stages=[rank[1]], tp_ranks=[rank[0]], ep_ranks=[rank[2]])
    load_rank_state_dict(model, state[rank])
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
    tokenizer = build_tokenizer(args.tokenizer or (os.path.join(args.mcore_dir, "hf") if args.mcore_dir
                                                   else args.hf_dir))
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


def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 1, top_p: float = 0.0, seed: int = 1234, max_batch_size: int = 8,
             stop_id: int | None = None, on_tokens: Callable[[int, list[int]], None] | None = None,
             stop: Sequence[str] = ()) -> list[list[int]]:
    """New token ids for each prompt (prompts of different lengths batch together). A generation ends
    after `max_new_tokens`, before `stop_id` (megatron stops on the tokenizer's eod, which `stop_id` must
    be, and leaves it out; `stop_id=None`: no early end), or at the token whose addition makes the
    generated text (its detokenization) contain one of the `stop` strings: that token is the last one
    returned, so the text ends with the stop string, plus the rest of that token's text when the stop
    string ends inside it. top_k=1 is greedy. `on_tokens(prompt index, tokens so far)` is called after
    every decoding step (megatron's streaming path: a worker thread, in order)."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.inference_request import InferenceRequest, Status
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_patch import patches

    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: generation needs at least one prompt token")
    check_stop(stop)
    longest = max(len(p) for p in prompts) + max_new_tokens
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, num_tokens_to_generate=max_new_tokens,
                            termination_id=-1 if stop_id is None else stop_id)
    params.no_detokenize_streaming_text = True  # streamed tokens are decoded by the caller
    params.no_early_termination = stop_id is None  # megatron otherwise stops at the tokenizer's eod
    out: list[list[int]] = []
    import torch

    with torch.no_grad(), patches.applied("cpu_cuda_calls"):
        for start in range(0, len(prompts), max_batch_size):
            batch = prompts[start: start + max_batch_size]
            context = StaticInferenceContext(max_batch_size=len(batch), max_sequence_length=longest)
            controller = _stop_string_controller()(GPTInferenceWrapper(model, context), tokenizer,
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
def _stop_string_controller() -> type:
    """megatron's `TextGenerationController`, also ending a request once its generated text contains a
    stop string (built on first use: megatron-core is imported lazily)."""
    import torch
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class StopStringController(TextGenerationController):
        """megatron-core 0.19's static-batch path has no stop strings (`SamplingParams.stop_words` is
        served by the dynamic engine's bookkeeping only), but after every step it asks
        `update_generation_status` which requests are done. A request marked done there stops growing
        (its generated length no longer counts, its stream ends), and the loop ends once all are done:
        a batch whose every request hit eod or a stop string stops computing."""

        def __init__(self, inference_wrapped_model, tokenizer, prompt_lengths: list[int], stop: Sequence[str]):
            super().__init__(inference_wrapped_model, tokenizer)
            self.prompt_lengths, self.stop = prompt_lengths, tuple(stop)
            # A stop string completed by the newest token lies within its last tokens (a character spans at
            # most 4 byte-level tokens); decoding that tail, with a margin so that the tail's first tokens
            # (a partial character, a dropped leading space) stay clear of it, keeps a step's cost
            # independent of the length generated so far.
            self.window = 4 * max((len(s) for s in self.stop), default=0) + 8

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
            hit = [alive and any(s in self.tokenizer.detokenize(row[max(start - low, 0):]) for s in self.stop)
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
