"""Full-vocab logits of a megatron-core GPTModel at any TP x PP (the converter's `verify`, `evaluate`, the lm-eval
adapter, RLHF log-probabilities and the Bridge all score with it)."""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(seq: int) -> Tensor:
    """megatron-core's boolean mask convention: True = masked out."""
    return torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1)


def megatron_logits(model, input_ids: Tensor, vocab_size: int) -> Tensor | None:
    """Full-vocab logits [batch, seq, vocab] (float32) from a megatron-core GPTModel at any TP x PP, on the
    device of `input_ids` (the caller's: CPU ids give CPU logits, ids on the model's GPU keep them there).

    Every rank of the model-parallel group calls this; the result is returned on all ranks. `model` may be a
    virtual pipeline's list of model chunks."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_patch.runtime import pipeline

    device = next((model[0] if isinstance(model, (list, tuple)) else model).parameters()).device
    ids = input_ids.to(device)
    b, s = ids.shape
    pos = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)
    return pipeline.forward_everywhere(
        model, ids, (b, s, vocab_size), lambda out: gather_from_tensor_model_parallel_region(out)[..., :vocab_size],
        pos, causal_mask(s).to(device), device=input_ids.device)
