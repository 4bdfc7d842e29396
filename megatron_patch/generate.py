"""python -m megatron_patch.generate: offline generation from a Megatron checkpoint (or an HF folder).

    python -m megatron_patch.generate --mcore-dir ckpt --prompts prompts.jsonl --out results.jsonl \\
        [--max-new-tokens 256] [--greedy | --temperature 0.7 --top-k 50 --top-p 0.9] [--seed 1234] \\
        [--chat] [--stop "\\n\\n"] [--batch-size 8]

Prompts: JSONL rows with "prompt" (text), or "messages" (rendered with the tokenizer's chat template and
a generation prompt, also with --chat for "prompt" rows); without --prompts, one prompt per stdin line.
Output: one JSON row per prompt {"prompt", "generated_text", "generated_tokens"} to --out (or stdout),
then a summary line. With one prompt, the text also streams to the terminal (stderr) as it is generated
(`--stream` forces it on, `--no-stream` off). Generation stops at the tokenizer's end-of-document token or after
--max-new-tokens; --stop strings cut the text at their first occurrence. Built on megatron.core.inference
(static batching with a KV cache); TP/PP > 1 under torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _prompts(args, tokenizer) -> tuple[list[str], list[list[int]]]:
    texts, ids = [], []
    if args.prompts:
        if not os.path.isfile(args.prompts):
            raise ValueError(f"{args.prompts} does not exist")
        from megatron_patch.jsonl import read_jsonl

        rows = read_jsonl(args.prompts, need_any=("prompt", "messages"))
    else:
        rows = [{"prompt": line.rstrip("\n")} for line in sys.stdin if line.strip()]
    for row in rows:
        if "messages" in row or args.chat:
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            texts.append(tokenizer.detokenize(enc.ids))
            ids.append(list(enc.ids))
        else:
            texts.append(row["prompt"])
            ids.append(tokenizer.tokenize(row["prompt"]))
    if not ids:
        raise ValueError("no prompts")
    return texts, ids


class _Printer:
    """Streams prompt 0's text to stderr: after each step, the part of the decoded text not yet shown."""

    def __init__(self, tokenizer):
        self.tokenizer, self.shown = tokenizer, ""

    def __call__(self, index: int, tokens: list[int]) -> None:
        if index:
            return
        text = self.tokenizer.detokenize([t for t in tokens if t != self.tokenizer.eod])
        if text.startswith(self.shown):  # a partial multi-byte character can change the tail: wait for it
            sys.stderr.write(text[len(self.shown):])
            sys.stderr.flush()
            self.shown = text


def run(args) -> dict:
    from megatron_patch.inference import generate, model_and_tokenizer
    from megatron_patch.cli import is_first_rank

    prompts: list = []
    model, _, tokenizer = model_and_tokenizer(args, lambda tok: prompts.extend(_prompts(args, tok)))
    texts, prompt_ids = prompts
    start = time.time()
    top_k = 1 if args.greedy else args.top_k
    stream = args.stream if args.stream is not None else len(prompt_ids) == 1 and sys.stderr.isatty()
    printer = _Printer(tokenizer) if stream and is_first_rank() else None
    outs = generate(model, tokenizer, prompt_ids, args.max_new_tokens, args.temperature, top_k, args.top_p,
                    args.seed, args.batch_size, stop_id=tokenizer.eod, on_tokens=printer)
    if printer is not None:
        sys.stderr.write("\n")
    seconds = time.time() - start
    sink = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    try:
        for text, tokens in zip(texts, outs):
            generated = tokenizer.detokenize([t for t in tokens if t != tokenizer.eod])
            for stop in args.stop or []:
                if stop in generated:
                    generated = generated[: generated.index(stop)]
            sink.write(json.dumps({"prompt": text, "generated_text": generated, "generated_tokens": tokens}) + "\n")
    finally:
        if args.out:
            sink.close()
    new = sum(len(t) for t in outs)
    return {"prompts": len(outs), "new_tokens": new, "seconds": round(seconds, 2),
            "tokens_per_s": round(new / seconds, 1) if seconds else None, "out": args.out}


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.inference import add_model_args
    from megatron_patch.cli import run as run_tool

    p = argparse.ArgumentParser(prog="python -m megatron_patch.generate", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--prompts", help="JSONL prompts (default: one per stdin line)")
    p.add_argument("--out", help="JSONL results (default: stdout)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (same as --top-k 1)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--chat", action="store_true", help="render plain prompts with the chat template")
    p.add_argument("--stop", nargs="*", help="cut each generation at the first of these strings")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print the text to stderr as it is generated (default: on for one prompt on a terminal)")
    args = p.parse_args(argv)
    return run_tool(lambda: run(args))[0]


if __name__ == "__main__":
    sys.exit(main())
