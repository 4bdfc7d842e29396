"""python -m megatron_patch.evaluate: score a Megatron checkpoint (or an HF folder) without converting.

    python -m megatron_patch.evaluate --mcore-dir ckpt [--tokenizer DIR] \\
        [--text docs.jsonl | --data-prefix corpus_text_document] [--choices mc.jsonl] [--report out.json]

- perplexity: every document (JSONL `text`, or each document of a Megatron indexed dataset) is split
  into windows of --seq-length tokens; the loss is the mean negative log-likelihood over all predicted
  tokens, perplexity = exp(loss);
- multiple choice (`{"question", "choices": [...], "answer": index}`): each choice is scored by the
  log-likelihood of its tokens after the question (the context ends with the question, the choice is
  the continuation, a space between them), as lm-evaluation-harness does: `acc` picks the highest total,
  `acc_norm` the highest per character of the choice.
One JSON report on stdout (and in --report). TP/PP > 1 run under torchrun (`megatron_logits` gathers).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch


class Scorer:
    """Log-probabilities of token sequences under a Megatron model (any TP x PP)."""

    def __init__(self, model, vocab_size: int):
        self.model, self.vocab_size = model, vocab_size

    def token_logprobs(self, ids: list[int]) -> torch.Tensor:
        """log p(ids[i] | ids[:i]) for i = 1..len-1."""
        from megatron_patch.conversion.verify import megatron_logits

        x = torch.tensor([ids])
        logits = megatron_logits(self.model, x, self.vocab_size)[0].float()
        return torch.log_softmax(logits[:-1], dim=-1).gather(1, x[0, 1:, None])[:, 0]

    def perplexity(self, documents: list[list[int]], seq_length: int) -> dict:
        nll, count = 0.0, 0
        for doc in documents:
            for start in range(0, max(len(doc) - 1, 1), seq_length):
                window = doc[start: start + seq_length + 1]
                if len(window) < 2:
                    continue
                lp = self.token_logprobs(window)
                nll -= lp.sum().item()
                count += lp.numel()
        if not count:
            raise ValueError("no document has two or more tokens to score")
        return {"loss": nll / count, "perplexity": math.exp(nll / count), "tokens": count, "documents": len(documents)}

    def multiple_choice(self, rows: list[dict], tokenize) -> dict:
        correct = correct_norm = 0
        for n, row in enumerate(rows):
            try:
                question, choices, answer = row["question"], row["choices"], int(row["answer"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"multiple-choice row {n}: needs question, choices and answer ({e})") from e
            context = tokenize(question)
            scores, norms = [], []
            for choice in choices:
                cont = tokenize(" " + choice)
                lp = self.token_logprobs(context + cont)[len(context) - 1:]
                scores.append(lp.sum().item())
                norms.append(scores[-1] / max(len(choice), 1))
            correct += int(max(range(len(choices)), key=scores.__getitem__) == answer)
            correct_norm += int(max(range(len(choices)), key=norms.__getitem__) == answer)
        return {"acc": correct / len(rows), "acc_norm": correct_norm / len(rows), "questions": len(rows)}


def evaluate(args: argparse.Namespace) -> dict:
    import os

    from megatron_patch.inference import model_and_tokenizer
    from megatron_patch.jsonl import read_jsonl

    for path in (args.text, args.choices):
        if path and not os.path.exists(path):
            raise ValueError(f"{path} does not exist")
    model, vocab, tokenizer = model_and_tokenizer(args)
    scorer = Scorer(model, vocab)
    report: dict = {}
    if args.text or args.data_prefix:
        if args.text:
            docs = [tokenizer.tokenize(r[args.json_key]) for r in read_jsonl(args.text)]
        else:
            from megatron.core.datasets.indexed_dataset import IndexedDataset

            ds = IndexedDataset(args.data_prefix)
            docs = [ds[i].tolist() for i in range(len(ds))]
        report["perplexity"] = scorer.perplexity(docs, args.seq_length)
    if args.choices:
        report["multiple_choice"] = scorer.multiple_choice(read_jsonl(args.choices), tokenizer.tokenize)
    if not report:
        raise ValueError("nothing to evaluate: pass --text, --data-prefix and/or --choices")
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
    return report


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.inference import add_model_args
    from megatron_patch.cli import run

    p = argparse.ArgumentParser(prog="python -m megatron_patch.evaluate", description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--text", help="JSONL documents for perplexity")
    p.add_argument("--json-key", default="text")
    p.add_argument("--data-prefix", help="a Megatron indexed dataset for perplexity")
    p.add_argument("--choices", help="JSONL multiple-choice questions")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--report", help="also write the JSON report here")
    args = p.parse_args(argv)
    return run(lambda: evaluate(args))[0]


if __name__ == "__main__":
    sys.exit(main())
