"""python -m megatron_patch.generate: offline generation from a Megatron checkpoint (or an HF folder).

    python -m megatron_patch.generate --mcore-dir ckpt --prompts prompts.jsonl --out results.jsonl \\
        [--max-new-tokens 256] [--greedy | --temperature 0.7 --top-k 50 | --top-p 0.9] [--seed 1234] \\
        [--chat] [--stop "\\n\\n"] [--max-requests 256] [--engine auto|static|dynamic] \\
        [--kv-cache-gb 20] [--cuda-graph-impl local|none]

Prompts: JSONL rows with "prompt" (text), or "messages" (rendered with the tokenizer's chat template and
a generation prompt, also with --chat for "prompt" rows); without --prompts, one prompt per non-blank
stdin line. An empty prompt is refused with its line number, an empty file as a whole, and (before the
model loads) a prompt that does not leave --max-new-tokens of the model's context (max_position_embeddings;
without --max-new-tokens: 256 new tokens, or fewer where the longest prompt leaves less).
Output: one JSON row per prompt {"prompt", "generated_text", "generated_tokens", "finish_reason"} to --out
(written whole at the end, checked writable before the model loads), or to stdout; then a summary line
(on stdout with --out, else on stderr, so stdout holds only the rows). With one prompt, the text also
streams to the terminal (stderr) as it is generated (`--stream` forces it on, `--no-stream` off).
A generation ends at the tokenizer's end-of-document token (finish_reason "eod"; the token is not
included), after --max-new-tokens ("length"), or as soon as its text contains one of the --stop strings
("stop"): generating that sequence stops there, its last token is the one that completed the stop string,
and generated_text is exactly the decoding of generated_tokens, so it ends with the stop string (plus
the rest of that token's text when the stop string ends inside a token).
Built on megatron-core's inference engines (--engine). The dynamic one queues every prompt at once and
runs them with continuous batching, at most --max-requests in flight (a finished request frees its slot
and KV cache blocks for a waiting one), over a paged KV cache of --kv-cache-gb per GPU (default: what the
in-flight requests of the longest length need, at most half the GPU memory the weights leave), CUDA graphs
on a GPU (--cuda-graph-impl). The static one runs fixed batches of --max-requests prompts. auto (the
default) picks the dynamic engine.
TP / PP / EP > 1 under torchrun.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

DEFAULT_MAX_NEW_TOKENS = 256


class _Printer:
    """Streams prompt 0's text to stderr: after each step, the part of the decoded text not yet shown."""

    def __init__(self, tokenizer):
        self.tokenizer, self.shown = tokenizer, ""

    def __call__(self, index: int, tokens: list[int]) -> None:
        if index:
            return
        text = self.tokenizer.detokenize(tokens)
        if text.startswith(self.shown):  # a partial multi-byte character can change the tail: wait for it
            sys.stderr.write(text[len(self.shown):])
            sys.stderr.flush()
            self.shown = text


def unescape(text: str) -> str:
    """`--stop "\\n\\n"` as a user types it in a shell (which passes the backslashes through): the escapes
    \\n, \\t, \\r and \\\\ become the characters they name; other text is kept as it is."""
    return re.sub(r"\\([ntr\\])", lambda m: {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[m[1]], text)


def finish_reason(text: str, tokens: list[int], stop: list[str], max_new_tokens: int) -> str:
    """Why a generation of `generate` ended: "stop" (its text holds a stop string), "length"
    (max_new_tokens reached), else "eod" (the end-of-document token, left out of `tokens`)."""
    if any(s in text for s in stop):
        return "stop"
    return "length" if len(tokens) >= max_new_tokens else "eod"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run(args) -> dict:
    from dataclasses import replace

    from megatron_patch.cli import is_first_rank
    from megatron_patch.inference import (
        check_lengths,
        context_length,
        context_length_of,
        generate,
        model_and_tokenizer,
        read_prompts,
    )
    from megatron_patch.inference.sampling import Sampling, check_stop
    from megatron_patch.outputs import atomic_output_file, check_output_file

    stop = [unescape(s) for s in args.stop or []]
    check_stop(stop, "--stop")
    # checked before the model loads (--max-new-tokens is settled once the prompts are read)
    sampling = Sampling(1, args.temperature, 1 if args.greedy else args.top_k, args.top_p, args.seed, stop=stop)
    if args.cuda_graph_impl == "local" and not _cuda_available():
        raise ValueError("--cuda-graph-impl local needs a GPU")
    if args.out:
        check_output_file(args.out, "--out")
    prompts: list = []

    def fit(context: int) -> None:
        """--max-new-tokens as given must fit the context with every prompt; by default it is 256, or what
        the longest prompt leaves of the context."""
        if args.max_new_tokens is None:
            args.max_new_tokens = max(1, min(DEFAULT_MAX_NEW_TOKENS, context - max(len(p) for p in prompts[1])))
        check_lengths(prompts[1], args.max_new_tokens, context, "--max-new-tokens")

    def read(tokenizer) -> None:  # before the weights are read
        prompts.extend(read_prompts(args.prompts, tokenizer, args.chat))
        context = context_length_of(args.mcore_dir, args.hf_dir)
        if context is not None:
            fit(context)

    model, _, tokenizer = model_and_tokenizer(args, read)
    if args.max_new_tokens is None:  # (no HF config to read before loading)
        fit(context_length(model))
    texts, prompt_ids = prompts
    start = time.time()
    stream = args.stream if args.stream is not None else len(prompt_ids) == 1 and sys.stderr.isatty()
    printer = _Printer(tokenizer) if stream and is_first_rank() else None
    graphs = None if args.cuda_graph_impl is None else args.cuda_graph_impl == "local"
    outs = generate(model, tokenizer, prompt_ids, replace(sampling, max_new_tokens=args.max_new_tokens,
                                                          stop_id=tokenizer.eod),
                    max_batch_size=args.max_requests, on_tokens=printer, kv_cache_gb=args.kv_cache_gb,
                    cuda_graphs=graphs, engine=args.engine)
    if printer is not None:
        sys.stderr.write("\n")
    seconds = time.time() - start
    if is_first_rank():
        rows = []
        for text, tokens in zip(texts, outs):
            generated = tokenizer.detokenize(tokens)
            rows.append(json.dumps({"prompt": text, "generated_text": generated, "generated_tokens": tokens,
                                    "finish_reason": finish_reason(generated, tokens, stop, args.max_new_tokens)}))
        if args.out:
            with atomic_output_file(args.out) as f:
                f.writelines(row + "\n" for row in rows)
        else:
            sys.stdout.writelines(row + "\n" for row in rows)
            sys.stdout.flush()
    new = sum(len(t) for t in outs)
    return {"prompts": len(outs), "new_tokens": new, "seconds": round(seconds, 2),
            "tokens_per_s": round(new / seconds, 1) if seconds else None, "out": args.out}


def parser() -> argparse.ArgumentParser:
    from megatron_patch.cli import HelpFormatter, positive_float, positive_int
    from megatron_patch.inference import ENGINES, add_model_args

    p = argparse.ArgumentParser(prog="python -m megatron_patch.generate", description=__doc__,
                                formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("--prompts", help="JSONL prompts (default: one per stdin line)")
    p.add_argument("--out",
                   help="JSONL results, written whole at the end (default: stdout, the summary then on stderr)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                   help=f"longest generation (default: {DEFAULT_MAX_NEW_TOKENS}, or what the longest prompt leaves of "
                   "the model's context; a value given must fit the context with every prompt)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --top-k 1)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling threshold (0: off)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed")
    p.add_argument("--chat", action="store_true", help="render plain prompts with the chat template")
    p.add_argument("--stop", nargs="*", help="end a generation as soon as its text contains one of these strings "
                   "(kept in generated_text; its last token is the one that completed the string); \\n, \\t, \\r "
                   "and \\\\ in them are a newline, tab, carriage return and backslash")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="megatron-core's inference engine: dynamic (continuous batching, paged KV cache, CUDA "
                   "graphs on a GPU; TP/PP/EP), static (fixed batches; TP/EP, not PP), auto: dynamic")
    p.add_argument("--max-requests", "--inference-max-requests", "--batch-size", dest="max_requests",
                   type=positive_int, default=None, metavar="N",
                   help="requests generated together: in flight at once on the dynamic engine (a finished "
                   "request's slot goes to a waiting one; default 256 on a GPU, 8 on a CPU, at most the number "
                   "of prompts, rounded up to a multiple of --tp), the batch size of the static one (default 8)")
    p.add_argument("--kv-cache-gb", "--inference-dynamic-batching-buffer-size-gb", dest="kv_cache_gb",
                   type=positive_float, default=None, metavar="GB",
                   help="dynamic engine: KV cache memory per GPU, GiB (default: what --max-requests requests of "
                   "the longest length need, at most half the GPU memory the weights leave)")
    p.add_argument("--cuda-graph-impl", choices=("local", "none"), default=None,
                   help="dynamic engine: local captures megatron-core's inference CUDA graphs (block scope); "
                   "none: eager (default: local on a GPU at --pp 1 and --ep 1, else none; MoE layers: dropless "
                   "where few experts are chosen in a step, else decode steps with each expert padded to "
                   "capacity; multi-latent attention: decode steps where its Triton kernel decodes, 16-bit at "
                   "DeepSeek's widths, refused with the reason elsewhere)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print the text to stderr as it is generated (default: on for one prompt on a terminal)")
    return p


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.cli import run as run_tool

    args = parser().parse_args(argv)
    return run_tool(lambda: run(args), summary=sys.stdout if args.out else sys.stderr)[0]


if __name__ == "__main__":
    sys.exit(main())
