"""`generate` on megatron-core's static-batch controller: fixed batches, a KV cache per batch (TP and EP, not
PP); MoE layers dropless as on the dynamic engine where `dynamic.runs_dropless`. The path measured on the GPU
machine; see `megatron_patch.inference.choose_engine`."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence

from megatron_patch.inference.sampling import Sampling
from megatron_patch.inference.stops import holds_stop, stop_window

DEFAULT_BATCH_SIZE = 8  # prompts per batch when the caller names none (megatron-core's own default)


def generate_static(model, tokenizer, prompts: list[list[int]], sampling: Sampling, batch_size: int,
                    on_tokens) -> list[list[int]]:
    """`generate` on megatron-core's static-batch controller: batches of `batch_size` prompts, each with
    its own KV cache; a batch stops computing once all its requests hit the end token or a stop string."""
    import time
    from collections import OrderedDict

    import torch
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.inference_request import InferenceRequest, Status
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    from megatron_patch import patches
    from megatron_patch.inference import dynamic, moe_dropless

    longest = max(len(p) for p in prompts) + sampling.max_new_tokens
    moe = dynamic.moe_layers(model)
    params = sampling.megatron_params()
    params.no_detokenize_streaming_text = True  # streamed tokens are decoded by the caller
    params.no_early_termination = sampling.stop_id is None  # megatron otherwise stops at the tokenizer's eod
    out: list[list[int]] = []
    with (torch.no_grad(), patches.applied("cpu_cuda_calls"),
          moe_dropless.dispatch(moe) if dynamic.runs_dropless(moe) else contextlib.nullcontext()):
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start: start + batch_size]
            context = StaticInferenceContext(max_batch_size=len(batch), max_sequence_length=longest)
            controller = _static_controller()(GPTInferenceWrapper(model, context), tokenizer,
                                              [len(p) for p in batch], sampling.stop)
            controller.sampling_rng.manual_seed(sampling.seed + start)  # the controller samples from its own generator
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
            self.prompt_lengths, self.stop, self.window = prompt_lengths, tuple(stop), stop_window(stop)

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
            hit = [alive and holds_stop(self.tokenizer, row[max(start - low, 0):], self.stop)
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
