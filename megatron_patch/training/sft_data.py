"""SFT data: JSONL conversations -> fixed-length packed samples with per-document attention and an
assistant-only loss mask.

Input lines are chat form `{"messages": [{"role", "content"}, ...]}` or instruction form
`{"instruction", "input"?, "output", "system"?}`, rendered with the tokenizer's chat template
(`megatron_patch.tokenizer`): the loss mask is 1 exactly on assistant tokens (content and end token).

Packing: conversations (each at most seq_length + 1 tokens; longer ones are truncated, counted in
`truncated`) are placed first-fit, in a seeded shuffled order, into bins of seq_length + 1 tokens; the
rest of a bin is padding with no loss. A sample carries, for the tokens fed to the model:
- `tokens`, `labels` (the next token), `loss_mask` (1 where the label is an assistant token of the same
  document), `position_ids` restarting at 0 for every document;
- `attention_mask` [1, s, s] (True = masked): causal within each document, nothing across documents —
  what megatron-core's local attention takes;
- `cu_seqlens` (padded with -1 to a fixed length so batches collate), the document boundaries that
  Transformer Engine's packed (THD) attention takes through `PackedSeqParams`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

import numpy as np
import torch

from megatron_patch.jsonl import read_jsonl
from megatron_patch.tokenizer import Tokenizer


def read_conversations(paths: Iterable[str]) -> list[dict]:
    out = [row for path in paths for row in read_jsonl(path)]
    if not out:
        raise ValueError(f"no conversations in {', '.join(paths)}")
    return out


def pack(lengths: list[int], capacity: int, seed: int) -> list[list[int]]:
    """First-fit packing of documents (by index) into bins of `capacity` tokens, seeded order."""
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


class PackedSFTDataset(torch.utils.data.Dataset):
    def __init__(self, conversations: list[dict], tokenizer: Tokenizer, seq_length: int, seed: int = 1234,
                 num_samples: int | None = None):
        self.seq_length = seq_length
        self.pad = tokenizer.pad
        capacity = seq_length + 1  # tokens and the label shifted by one
        self.docs: list[tuple[np.ndarray, np.ndarray]] = []
        self.truncated = 0
        for n, example in enumerate(conversations):
            try:
                enc = tokenizer.apply_chat_template(example)
            except ValueError as e:
                raise ValueError(f"conversation {n}: {e}") from e
            ids, mask = np.asarray(enc.ids, np.int64), np.asarray(enc.loss_mask, np.int64)
            if len(ids) > capacity:
                self.truncated += 1
                ids, mask = ids[:capacity], mask[:capacity]
            if mask[1:].any():  # something to learn once shifted
                self.docs.append((ids, mask))
        if not self.docs:
            raise ValueError("no conversation has an assistant turn to train on")
        self.bins = pack([len(d[0]) for d in self.docs], capacity, seed)
        self.num_samples = num_samples or len(self.bins)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        s = self.seq_length
        ids = np.full(s + 1, self.pad, np.int64)
        lmask = np.zeros(s + 1, np.int64)
        doc = np.full(s + 1, -1, np.int64)  # document of each buffer position; -1 = padding
        pos = np.zeros(s + 1, np.int64)
        cu, start = [0], 0
        for d, i in enumerate(self.bins[idx % len(self.bins)]):
            t, m = self.docs[i]
            n = len(t)
            ids[start:start + n], lmask[start:start + n], doc[start:start + n] = t, m, d
            pos[start:start + n] = np.arange(n)
            start += n
            cu.append(min(start, s))
        if cu[-1] < s:
            cu.append(s)  # the padding tail as its own (loss-free) segment
        inputs = doc[:-1]
        # the label of input p is token p+1: it counts when it is an assistant token of p's document
        loss_mask = (lmask[1:] == 1) & (doc[1:] == inputs) & (inputs >= 0)
        causal = np.tril(np.ones((s, s), bool))
        same = (inputs[:, None] == inputs[None, :]) & (inputs[:, None] >= 0)
        attention_mask = ~(causal & (same | np.eye(s, dtype=bool)))
        cu_padded = np.full(s + 1, -1, np.int32)
        cu_padded[: len(cu)] = cu
        return {
            "tokens": torch.from_numpy(ids[:-1].copy()),
            "labels": torch.from_numpy(ids[1:].copy()),
            "loss_mask": torch.from_numpy(loss_mask.astype(np.float32)),
            "position_ids": torch.from_numpy(pos[:-1].copy()),
            "attention_mask": torch.from_numpy(attention_mask[None]),
            "cu_seqlens": torch.from_numpy(cu_padded),
        }
