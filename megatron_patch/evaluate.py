"""python -m megatron_patch.evaluate: score a Megatron checkpoint (or an HF folder) without converting.

    python -m megatron_patch.evaluate --mcore-dir ckpt [--tokenizer DIR] \\
        [--text docs.jsonl | --data-prefix corpus_text_document] [--choices mc.jsonl] [--report out.json]

- perplexity: every document (JSONL `text`, or each document of a Megatron indexed dataset) is split
  into windows of --seq-length tokens; the loss is the mean negative log-likelihood over all predicted
  tokens, perplexity = exp(loss);
- multiple choice (`{"question", "choices": [...], "answer": index}`, `answer` the 0-based index of the
  right choice): each choice is scored by the log-likelihood of its tokens after the question, as
  lm-evaluation-harness does: the context is the question, the continuation is `" " + choice` (no space
  is added when the choice already starts with whitespace or the question already ends with it);
  `acc` picks the highest total, `acc_norm` the highest per character of the choice. A malformed row
  (answer out of range, choices not a non-empty list of strings, answer not an integer) is refused with
  its file and line before the model loads.
One JSON report on stdout (and in --report, checked writable before the model loads and written whole at
the end). TP/PP > 1 run under torchrun (`megatron_logits` gathers).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Question:
    """A multiple-choice row: the question, its choices, the 0-based index of the right one, and where it
    was read ("file, line N"), for errors found while scoring."""

    question: str
    choices: list[str]
    answer: int
    where: str = ""


def read_questions(path: str) -> list[Question]:
    """The multiple-choice rows of a JSONL file, each checked (errors name the file and 1-based line)."""
    from megatron_patch.jsonl import read_jsonl_numbered

    questions = []
    for n, row in read_jsonl_numbered(path):
        where = f"{path}, line {n}"
        missing = [k for k in ("question", "choices", "answer") if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{where}: needs question, choices and answer (missing {', '.join(missing)})")
        question, choices, answer = row["question"], row["choices"], row["answer"]
        if not isinstance(question, str):
            raise ValueError(f"{where}: 'question' must be a string, got {json.dumps(question)}")
        if not isinstance(choices, list):
            got = "a string" if isinstance(choices, str) else json.dumps(choices)
            raise ValueError(f"{where}: 'choices' must be a list of strings, got {got}")
        if not choices:
            raise ValueError(f"{where}: 'choices' is empty")
        for k, choice in enumerate(choices):
            if not isinstance(choice, str):
                raise ValueError(f"{where}: choice {k} must be a string, got {json.dumps(choice)}")
        if isinstance(answer, bool) or not isinstance(answer, int):
            raise ValueError(f"{where}: 'answer' must be the 0-based index of the right choice, "
                             f"got {json.dumps(answer)}")
        if not 0 <= answer < len(choices):
            raise ValueError(f"{where}: 'answer' {answer} is out of range for {len(choices)} choices "
                             f"(0-based: 0..{len(choices) - 1})")
        questions.append(Question(question, choices, answer, where))
    if not questions:
        raise ValueError(f"no multiple-choice rows in {path}")
    return questions


def continuation(question: str, choice: str) -> str:
    """The text scored after the question: `" " + choice`, without doubling a space that is already
    there (a choice starting, or a question ending, with whitespace)."""
    return choice if choice[:1].isspace() or question[-1:].isspace() else " " + choice


class Scorer:
    """Log-probabilities of token sequences under a Megatron model (any TP x PP)."""

    def __init__(self, model, vocab_size: int):
        self.model, self.vocab_size = model, vocab_size

    def token_logprobs(self, ids: list[int]) -> torch.Tensor:
        """log p(ids[i] | ids[:i]) for i = 1..len-1 (float32, on the CPU; computed on the model's device)."""
        from megatron_patch.runtime.logits import megatron_logits

        x = torch.tensor([ids], device=next(self.model.parameters()).device)  # the full-vocab logits stay there
        logits = megatron_logits(self.model, x, self.vocab_size)[0]
        return torch.log_softmax(logits[:-1], dim=-1).gather(1, x[0, 1:, None])[:, 0].cpu()

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

    def multiple_choice(self, questions: list[Question], tokenize: Callable[[str], list[int]]) -> dict:
        correct = correct_norm = 0
        for q in questions:
            context = tokenize(q.question)
            if not context:
                raise ValueError(f"{q.where}: the question has no tokens; the first choice token needs a context")
            scores, norms = [], []
            for k, choice in enumerate(q.choices):
                cont = tokenize(continuation(q.question, choice))
                if not cont:
                    raise ValueError(f"{q.where}: choice {k} has no tokens")
                lp = self.token_logprobs(context + cont)[len(context) - 1:]
                scores.append(lp.sum().item())
                norms.append(scores[-1] / max(len(choice), 1))
            correct += int(max(range(len(q.choices)), key=scores.__getitem__) == q.answer)
            correct_norm += int(max(range(len(q.choices)), key=norms.__getitem__) == q.answer)
        return {"acc": correct / len(questions), "acc_norm": correct_norm / len(questions), "questions": len(questions)}


def evaluate(args: argparse.Namespace) -> dict:
    import os

    from megatron_patch.cli import finite_json, is_first_rank
    from megatron_patch.inference import model_and_tokenizer
    from megatron_patch.jsonl import read_jsonl_numbered
    from megatron_patch.outputs import atomic_output_file, check_output_file

    if not (args.text or args.data_prefix or args.choices):
        raise ValueError("nothing to evaluate: pass --text, --data-prefix and/or --choices")
    if args.report:
        check_output_file(args.report, "--report")
    for path in (args.text, args.choices):
        if path and not os.path.exists(path):
            raise ValueError(f"{path} does not exist")
    texts = []
    for n, row in read_jsonl_numbered(args.text, need_any=(args.json_key,)) if args.text else []:
        if not isinstance(row[args.json_key], str):
            raise ValueError(f"{args.text}, line {n}: {args.json_key!r} must be a string")
        texts.append(row[args.json_key])
    questions = read_questions(args.choices) if args.choices else None
    model, vocab, tokenizer = model_and_tokenizer(args)
    scorer = Scorer(model, vocab)
    report: dict = {}
    if args.text or args.data_prefix:
        if args.text:
            docs = [tokenizer.tokenize(t) for t in texts]
        else:
            from megatron.core.datasets.indexed_dataset import IndexedDataset

            ds = IndexedDataset(args.data_prefix)
            docs = [ds[i].tolist() for i in range(len(ds))]
        report["perplexity"] = scorer.perplexity(docs, args.seq_length)
    if questions is not None:
        report["multiple_choice"] = scorer.multiple_choice(questions, tokenizer.tokenize)
    if args.report and is_first_rank():
        with atomic_output_file(args.report) as f:
            json.dump(finite_json(report)[0], f, indent=1)  # JSON has no NaN/Infinity: the summary warns
    return report


def parser() -> argparse.ArgumentParser:
    from megatron_patch.cli import HelpFormatter, positive_int
    from megatron_patch.inference import add_model_args

    p = argparse.ArgumentParser(prog="python -m megatron_patch.evaluate", description=__doc__,
                                formatter_class=HelpFormatter)
    add_model_args(p)
    p.add_argument("--text", help="JSONL documents for perplexity")
    p.add_argument("--json-key", default="text", help="the field of --text rows holding the document")
    p.add_argument("--data-prefix", help="a Megatron indexed dataset for perplexity")
    p.add_argument("--choices", help='JSONL multiple-choice rows {"question", "choices": [...], "answer": 0-based '
                   'index}; each choice is scored as the continuation " " + choice (no doubled space)')
    p.add_argument("--seq-length", type=positive_int, default=2048, metavar="N",
                   help="perplexity window (tokens scored per forward pass)")
    p.add_argument("--report", help="also write the JSON report here (checked before the model loads, written whole)")
    return p


def main(argv: list[str] | None = None) -> int:
    from megatron_patch.cli import run

    args = parser().parse_args(argv)
    return run(lambda: evaluate(args))[0]


if __name__ == "__main__":
    sys.exit(main())
