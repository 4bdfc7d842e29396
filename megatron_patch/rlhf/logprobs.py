"""Per-token log-probabilities (and entropies) of a batch under a model at any TP x PP, over the model's own
vocabulary (megatron's padded columns masked): what the online-RL trainers (`megatron_patch.rlhf.loop`) compute
the old, reference and new log-probabilities with. `megatron_patch.runtime.pipeline` runs the stages."""

from __future__ import annotations

import torch


def _tp_all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(t, op=op, group=ps.get_tensor_model_parallel_group())
    return t


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the vocabulary at each position, from this TP rank's slice of the
    logits ([..., vocab / TP]); no gradient (a metric)."""
    import torch.distributed as dist

    with torch.no_grad():
        logits = logits.detach().float()
        top = _tp_all_reduce(logits.max(-1, keepdim=True).values, dist.ReduceOp.MAX)
        e = torch.exp(logits - top)
        z = _tp_all_reduce(e.sum(-1), dist.ReduceOp.SUM)
        expected = _tp_all_reduce((e * logits).sum(-1), dist.ReduceOp.SUM) / z
        return torch.log(z) + top.squeeze(-1) - expected


def without_padding(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """This TP rank's slice of the logits [..., padded vocab / TP] with megatron's padded vocabulary columns (ids
    >= `vocab_size`: zero rows in a converted model, so logit 0) at the dtype's lowest value: no token of the
    model, so no share of its softmax (transformers' model has no such columns; measured on an H200: with them,
    a trained tiny LLaMA's log-probabilities were off by 6e-3)."""
    from megatron.core import parallel_state as ps

    width = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * width
    if start + width <= vocab_size:
        return logits
    ids = torch.arange(start, start + width, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, torch.finfo(logits.dtype).min)


def logps_of(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, entropy: bool = False):
    """log p(label) per position [rows, s] from this TP rank's slice of the logits, over the model's
    `vocab_size` tokens (megatron's vocab-parallel cross entropy: the gradient flows at any TP); with
    `entropy`, (log-probs, per-position entropy)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = without_padding(logits.float(), vocab_size)
    spread = vocab_parallel_entropy(logits) if entropy else None  # first: the cross entropy works in place
    logps = -vocab_parallel_cross_entropy(logits, labels)
    return (logps, spread) if entropy else logps


def token_logps(model, tokens: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(label) per position [rows, s] under `model` (over its `vocab_size` tokens), without gradient, on
    every rank at any TP x PP, on the tokens' device."""
    from megatron_patch.runtime import pipeline

    return pipeline.forward_everywhere(model, tokens, tuple(tokens.shape),
                                       lambda logits: logps_of(logits, labels, vocab_size))
