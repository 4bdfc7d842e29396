"""python -m megatron_patch.generate: offline generation from a Megatron checkpoint (or an HF folder).

    python -m megatron_patch.generate --mcore-dir ckpt --prompts prompts.jsonl --out results.jsonl \\
        [--max-new-tokens 256] [--greedy | --temperature 0.7 --top-k 50 --top-p 0.9] [--seed 1234] \\
        [--chat] [--stop "\\n\\n"] [--batch-size 8]

Prompts: JSONL rows with "prompt" (text), or "messages" (rendered with the tokenizer's chat template and
a generation prompt, also with --chat for "prompt" rows); without --prompts, one prompt per non-blank
stdin line. An empty prompt is refused with its line number.
Output: one JSON row per prompt {"prompt", "generated_text", "generated_tokens", "finish_reason"} to --out
(written whole at the end, checked writable before the model loads), or to stdout; then a summary line
(on stdout with --out, else on stderr, so stdout holds only the rows). With one prompt, the text also
streams to the terminal (stderr) as it is generated (`--stream` forces it on, `--no-stream` off).
A generation ends at the tokenizer's end-of-document token (finish_reason "eod"; the token is not
included), after --max-new-tokens ("length"), or as soon as its text contains one of the --stop strings
("stop"): generating that sequence stops there, its last token is the one that completed the stop string,
and generated_text is exactly the decoding of generated_tokens, so it ends with the stop string (plus
the rest of that token's text when the stop string ends inside a token). Built on megatron.core.inference
(static batching with a KV cache); TP/PP > 1 under torchrun.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time


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


def run(args) -> dict:
    from megatron_patch.cli import is_first_rank
    from megatron_patch.inference import check_stop, generate, model_and_tokenizer, read_prompts
    from megatron_patch.conversion.atomic import atomic_output_file, check_output_file

    stop = [unescape(s) for s in args.stop or []]
    check_stop(stop, "--stop")
    if args.out:
        check_output_file(args.out, "--out")
    prompts: list = []
    model, _, tokenizer = model_and_tokenizer(
        args, lambda tok: prompts.extend(read_prompts(args.prompts, tok, args.chat)))
    texts, prompt_ids = prompts
    start = time.time()
    top_k = 1 if args.greedy else args.top_k
    stream = args.stream if args.stream is not None else len(prompt_ids) == 1 and sys.stderr.isatty()
    printer = _Printer(tokenizer) if stream and is_first_rank() else None
    outs = generate(model, tokenizer, prompt_ids, args.max_new_tokens, args.temperature, top_k, args.top_p,
                    args.seed, args.batch_size, stop_id=tokenizer.eod, on_tokens=printer, stop=stop)
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


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.cli import HelpFormatter, positive_int
    from megatron_patch.cli import run as run_tool
    from megatron_patch.inference import add_model_args

    p = argparse.ArgumentParser(prog="python -m megatron_patch.generate", description=__doc__,
                                formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("--prompts", help="JSONL prompts (default: one per stdin line)")
    p.add_argument("--out", help="JSONL results, written whole at the end (default: stdout, the summary then on stderr)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, metavar="N", help="longest generation")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --top-k 1)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling threshold (0: off)")
    p.add_argument("--seed", type=int, default=1234, help="sampling seed")
    p.add_argument("--chat", action="store_true", help="render plain prompts with the chat template")
    p.add_argument("--stop", nargs="*", help="end a generation as soon as its text contains one of these strings "
                   "(kept in generated_text; its last token is the one that completed the string); \\n, \\t, \\r "
                   "and \\\\ in them are a newline, tab, carriage return and backslash")
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="N", help="prompts generated together")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print the text to stderr as it is generated (default: on for one prompt on a terminal)")
    args = p.parse_args(argv)
    return run_tool(lambda: run(args), summary=sys.stdout if args.out else sys.stderr)[0]


if __name__ == "__main__":
    sys.exit(main())
