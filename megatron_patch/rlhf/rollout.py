"""Sampling rollouts from the policy on megatron-core's inference engine (`megatron_patch.inference.generate`)
and putting them in a training batch: what the online-RL trainers (`megatron_patch.rlhf.loop`) learn from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_patch.inference.sampling import Sampling


def with_end_token(completions: list[list[int]], max_new_tokens: int, eod: int) -> list[list[int]]:
    """The sampled completions as trained on: one that ended before `max_new_tokens` ended by sampling
    the end-of-document token, which generation leaves out; it is put back, so that the policy is
    trained on (and credited or blamed for) stopping there."""
    return [c + [eod] if len(c) < max_new_tokens else c for c in completions]


def batch_of(prompts: list[list[int]], completions: list[list[int]], pad: int, device) -> tuple:
    """Right-padded prompt + completion rows: tokens, labels and the completion-token mask."""
    rows = [p + c for p, c in zip(prompts, completions)]
    s = max(len(r) for r in rows)
    tokens = torch.full((len(rows), s), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), s)
    for i, (p, r) in enumerate(zip(prompts, rows)):
        tokens[i, : len(r)] = torch.tensor(r)
        mask[i, len(p) - 1: len(r) - 1] = 1  # positions whose label is a completion token
    labels = torch.cat([tokens[:, 1:], torch.full((len(rows), 1), pad)], 1)
    return tokens.to(device), labels.to(device), mask.to(device)


@dataclass
class Rollouts:
    """One batch of sampled completions, as the reward and the losses see it."""

    prompts: list[list[int]]
    completions: list[list[int]]  # as trained on: with the end token where the generation stopped
    texts: list[str]  # the completions' text, without the end token (what a reward function reads)
    tokens: torch.Tensor  # [rows, s] prompt + completion, right-padded
    labels: torch.Tensor  # [rows, s] the next token
    mask: torch.Tensor  # [rows, s] 1 at positions whose label is a completion token
    lengths: torch.Tensor  # [rows] real tokens of each row

    @property
    def completion_lengths(self) -> list[int]:
        return [len(c) for c in self.completions]


def rollout(policy, tokenizer, prompts: list[list[int]], sampling: Sampling, device, engine: str = "auto") -> Rollouts:
    """Sample one completion per prompt on the policy itself (all of them in one call of the inference
    engine, which keeps itself for the next call while its sizes fit) and batch them for training. Every
    rank of the TP x PP group calls this with the same arguments and gets the same rollouts."""
    from megatron_patch.inference import generate

    policy.eval()
    sampled = generate(policy, tokenizer, prompts, sampling, max_batch_size=len(prompts), engine=engine)
    texts = [tokenizer.detokenize(c) for c in sampled]
    completions = with_end_token(sampled, sampling.max_new_tokens, tokenizer.eod)
    tokens, labels, mask = batch_of(prompts, completions, tokenizer.pad, device)
    lengths = torch.tensor([len(p) + len(c) for p, c in zip(prompts, completions)], device=device)
    return Rollouts(prompts, completions, texts, tokens, labels, mask, lengths)
