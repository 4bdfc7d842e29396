"""Inference on megatron-core: load a Megatron checkpoint (as stored, any layout) or an HF folder into
this rank's `GPTModel`, and generate with megatron.core.inference (static batching, KV cache; greedy or
sampled with temperature / top-k / top-p). Used by `python -m megatron_patch.generate` and `.evaluate`."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_model(mcore_dir: str | None, hf_dir: str | None, tp: int = 1, pp: int = 1, impl: str | None = None,
               dtype: torch.dtype = torch.float32, ep: int = 1):
    """(this rank's GPTModel, hf_config): a Megatron checkpoint as stored (its own implementation), or
    an HF folder converted in memory for this rank (`impl`, default local)."""
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
    """The model options shared by `generate` and `evaluate`."""
    parser.add_argument("--mcore-dir", help="a Megatron checkpoint (either format, any stored layout)")
    parser.add_argument("--hf-dir", help="or an HF folder, converted in memory")
    parser.add_argument("--tokenizer", help="tokenizer folder / model (default: the checkpoint's hf/ or --hf-dir)")
    parser.add_argument("--tp", type=int, default=1, help=">1 needs torchrun with TP x PP processes")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1, help="expert parallel (mixture-of-experts models)")
    parser.add_argument("--impl", choices=("local", "transformer_engine"),
                        help="model implementation (default: a Megatron checkpoint's own; local for --hf-dir)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
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
    model, cfg = load_model(args.mcore_dir, args.hf_dir, args.tp, args.pp, args.impl, DTYPES[args.dtype], args.ep)
    vocab = get_family(cfg).shapes(cfg, Layout()).vocab_size
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {vocab}")
    return model, vocab, tokenizer


def generate(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 1, top_p: float = 0.0, seed: int = 1234, max_batch_size: int = 8,
             stop_id: int | None = None, on_tokens: Callable[[int, list[int]], None] | None = None
             ) -> list[list[int]]:
    """New token ids for each prompt (prompts of different lengths batch together), ending at `stop_id`
    (inclusive; it must be the tokenizer's eod, the token megatron stops on) or after `max_new_tokens`
(`stop_id=None`: always `max_new_tokens`). top_k=1 is greedy. `on_tokens(prompt index, tokens so far)`
    is called after every decoding step (megatron's streaming path: a worker thread, in order)."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.inference_request import InferenceRequest, Status
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    from megatron_patch import patches

    longest = max(len(p) for p in prompts) + max_new_tokens
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, num_tokens_to_generate=max_new_tokens,
                            termination_id=-1 if stop_id is None else stop_id)
    params.no_detokenize_streaming_text = True  # streamed tokens are decoded by the caller
    params.no_early_termination = stop_id is None  # megatron otherwise stops at the tokenizer's eod
    out: list[list[int]] = []
    with torch.no_grad(), patches.applied("cpu_cuda_calls"):
        for start in range(0, len(prompts), max_batch_size):
            batch = prompts[start: start + max_batch_size]
            context = StaticInferenceContext(max_batch_size=len(batch), max_sequence_length=longest)
            controller = TextGenerationController(GPTInferenceWrapper(model, context), tokenizer)
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
                tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
                if stop_id is not None and stop_id in tokens:
                    tokens = tokens[: tokens.index(stop_id) + 1]
                out.append(tokens)
    return out


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
