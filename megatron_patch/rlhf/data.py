"""Preference data: JSONL rows {"prompt", "chosen", "rejected"} -> pairs of token sequences.

`prompt` is text or a list of chat messages; `chosen` / `rejected` are the two answers (text, or a list of
messages that continue the prompt). Plain text is tokenized as prompt + answer + end-of-document; chat
(message lists, or `chat=True`) is rendered with the tokenizer's chat template, the answer being the
assistant turn. Each sample holds the two sequences (chosen first) right-padded to `seq_length`:
`tokens`, `labels` (next token), `loss_mask` (1 where the label is an answer token), `position_ids` and
`lengths` (real tokens in `tokens`); longer pairs are truncated from the end (counted in `truncated`)."""

from __future__ import annotations

import numpy as np
import torch

from megatron_patch.jsonl import read_jsonl
from megatron_patch.tokenizer import Tokenizer

FIELDS = ("prompt", "chosen", "rejected")


def encode(tokenizer: Tokenizer, prompt, answer, chat: bool) -> tuple[list[int], list[int]]:
    """(ids, answer mask) of one prompt + answer."""
    if chat or isinstance(prompt, list) or isinstance(answer, list):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        turns = answer if isinstance(answer, list) else [{"role": "assistant", "content": answer}]
        enc = tokenizer.apply_chat_template(list(messages) + list(turns))
        return list(enc.ids), list(enc.loss_mask)
    head, tail = tokenizer.tokenize(prompt), tokenizer.tokenize(answer) + [tokenizer.eod]
    return head + tail, [0] * len(head) + [1] * len(tail)


def read_preferences(paths, tokenizer: Tokenizer, chat: bool = False) -> list[tuple]:
    """[(chosen ids, chosen mask, rejected ids, rejected mask)] with every row checked."""
    pairs = []
    for path in paths:
        for n, row in enumerate(read_jsonl(path), 1):
            where = f"{path}, row {n}"
            missing = [k for k in FIELDS if k not in row]
            if missing:
                raise ValueError(f"{where}: missing {', '.join(missing)} (a preference row needs "
                                 f"{', '.join(FIELDS)})")
            for k in ("chosen", "rejected"):
                if not row[k] or (isinstance(row[k], str) and not row[k].strip()):
                    raise ValueError(f"{where}: empty {k!r}")
            c = encode(tokenizer, row["prompt"], row["chosen"], chat)
            r = encode(tokenizer, row["prompt"], row["rejected"], chat)
            pairs.append((*c, *r))
    if not pairs:
        raise ValueError(f"no preference rows in {', '.join(paths)}")
    return pairs


class PreferenceDataset(torch.utils.data.Dataset):
    def __init__(self, pairs: list[tuple], seq_length: int, pad: int, num_samples: int | None = None):
        self.pairs, self.seq_length, self.pad = pairs, seq_length, pad
        self.truncated = sum(len(p[0]) > seq_length + 1 or len(p[2]) > seq_length + 1 for p in pairs)
        self.num_samples = num_samples or len(pairs)
        for i, (_, cm, _, rm) in enumerate(pairs):
            if not any(cm[1: seq_length + 1]) or not any(rm[1: seq_length + 1]):
                raise ValueError(f"preference pair {i}: no answer token fits in --seq-length {seq_length}")

    def __len__(self) -> int:
        return self.num_samples

    def _one(self, ids: list[int], mask: list[int]) -> dict:
        s = self.seq_length
        ids, mask = ids[: s + 1], mask[: s + 1]
        n = len(ids) - 1  # inputs with a label
        buf = np.full(s + 1, self.pad, np.int64)
        buf[: len(ids)] = ids
        loss = np.zeros(s, np.float32)
        loss[:n] = np.asarray(mask[1:], np.float32)
        return {"tokens": buf[:-1], "labels": buf[1:], "loss_mask": loss, "lengths": min(len(ids), s)}

    def __getitem__(self, idx: int) -> dict:
        c_ids, c_mask, r_ids, r_mask = self.pairs[idx % len(self.pairs)]
        c, r = self._one(c_ids, c_mask), self._one(r_ids, r_mask)
        out = {k: torch.from_numpy(np.stack([c[k], r[k]])) for k in ("tokens", "labels", "loss_mask")}
        out["position_ids"] = torch.arange(self.seq_length).expand(2, -1).clone()
        out["lengths"] = torch.tensor([c["lengths"], r["lengths"]])
        return out


def flatten_pairs(batch: dict) -> dict:
    """[b, 2, ...] micro-batch -> [2b, ...] rows ordered chosen_0, rejected_0, chosen_1, ..."""
    return {k: v.reshape(-1, *v.shape[2:]) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
