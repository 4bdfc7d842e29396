"""Running a megatron-core model at any pipeline-parallel size outside megatron.training (verification, the
RLHF trainers that drive their own loop): megatron-core's pipeline schedule between the stages, the last
stage's result sent to every stage, and what a training step needs around it (the tied embedding's gradient
shared by the first and last stages, a gradient norm over all model-parallel ranks).

At PP = 1 the model runs directly; at PP > 1 through `megatron.core.pipeline_parallel.get_forward_backward_func`
with one micro-batch (every rank of the TP x PP group calls with the same batch). A virtual pipeline's list of
model chunks runs forward only, stage after stage (`_forward_chunks`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def _pp() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def _schedule(model, tokens: torch.Tensor, pos, mask, loss_fn, forward_only: bool) -> list:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    captured: list = []

    def forward_step(_data_iterator, m):
        def loss_func(output):
            loss, result = loss_fn(output)
            captured.append(result)
            return loss, {}

        return m(tokens, pos, mask), loss_func

    model.config.variable_seq_lengths = False
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
        seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=forward_only)
    return captured


def _positions(tokens: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
    return pos if pos is not None else torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)


def _forward_chunks(chunks: list, tokens: torch.Tensor, pos, mask):
    """A virtual pipeline's forward pass (VPP: chunk v of pipeline rank p is virtual stage v * PP + p): each
    stage runs on its rank and its hidden states go to the next stage's rank (a broadcast in the pipeline group,
    in which every rank takes part). The last stage's output on the last rank, None elsewhere."""
    from megatron.core import parallel_state as ps

    group, pp, me = ps.get_pipeline_model_parallel_group(), _pp(), ps.get_pipeline_model_parallel_rank()
    config, param = chunks[0].config, next(chunks[0].parameters())
    seq = tokens.shape[1] // (ps.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1)
    hidden, last = None, pp * len(chunks) - 1
    for stage in range(last + 1):
        owner, out = stage % pp, None
        if owner == me:
            chunk = chunks[stage // pp]
            if stage > 0:
                chunk.set_input_tensor(hidden)
            out = chunk(tokens, pos, mask)
        if stage == last:
            return out
        hidden = out.contiguous() if out is not None else torch.empty(
            (seq, tokens.shape[0], config.hidden_size), dtype=param.dtype, device=param.device)
        dist.broadcast(hidden, dist.get_global_rank(group, owner), group=group)
    return None


def forward(model, tokens: torch.Tensor, pos: torch.Tensor | None = None, mask: torch.Tensor | None = None):
    """The model's output on the last pipeline stage (logits [b, s, vocab / TP], or what its head gives);
    None on the other stages. Gradients are the caller's choice (`torch.no_grad()` around it, or not at PP = 1).
    `model` may be a virtual pipeline's list of chunks (forward only)."""
    from megatron_patch import patches

    pos = _positions(tokens, pos)
    with patches.applied("cpu_cuda_calls"):
        if isinstance(model, (list, tuple)):
            return _forward_chunks(list(model), tokens, pos, mask)
        if _pp() == 1:
            return model(tokens, pos, mask)
        captured = _schedule(model, tokens, pos, mask, lambda out: (out.sum() * 0, out.detach()), forward_only=True)
    return captured[0] if captured else None


def forward_everywhere(model, tokens: torch.Tensor, shape: tuple[int, ...], fn: Callable | None = None,
                       pos: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """`fn(output)` (default: the output itself) without gradient: computed on the last pipeline stage and
    returned on every rank of the pipeline, float32 of shape `shape`, on `device` (default: the tokens', i.e.
    the caller's device; at PP = 1 as at PP > 1)."""
    from megatron_patch import patches

    with torch.no_grad():
        out = forward(model, tokens, pos, mask)
        if out is not None and fn is not None:
            with patches.applied("cpu_cuda_calls"):
                out = fn(out)
    return from_last_stage(out, shape, device=device or tokens.device)


def forward_backward(model, tokens: torch.Tensor, loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, dict]],
                     pos: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> dict:
    """One forward and backward pass: `loss_fn(output)` runs on the last stage with its output and returns
    (the scalar loss to backpropagate, {name: float} metrics); the gradient reaches every stage's weights
    (accumulated into `.grad`). Returns the metrics on every rank. `loss_fn` must not raise (a stage
    waiting for the gradient would wait forever): check the returned metrics instead."""
    from megatron_patch import patches

    if isinstance(model, (list, tuple)):
        raise ValueError("forward_backward takes one model per rank: a virtual pipeline's chunks train under "
                         "megatron-core's interleaved schedule (get_forward_backward_func, >= PP micro-batches)")
    pos = _positions(tokens, pos)
    with patches.applied("cpu_cuda_calls"):
        if _pp() == 1:
            loss, metrics = loss_fn(model(tokens, pos, mask))
            loss.backward()
            return metrics
        captured = _schedule(model, tokens, pos, mask, loss_fn, forward_only=False)
    return object_from_last_stage(captured[0] if captured else None)


def from_last_stage(t: torch.Tensor | None, shape: tuple[int, ...], dtype=torch.float32,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The last pipeline stage's tensor (None elsewhere) on every rank of the pipeline, as `dtype` on
    `device` (default: where it was, or the CPU), at every pipeline size alike."""
    from megatron.core import parallel_state as ps

    if _pp() == 1:
        return t.to(device or t.device, dtype)
    group = ps.get_pipeline_model_parallel_group()
    where = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    buf = t.detach().to(where, dtype).contiguous() if t is not None else torch.empty(shape, dtype=dtype, device=where)
    dist.broadcast(buf, ps.get_pipeline_model_parallel_last_rank(), group=group)
    return buf.to(device or (t.device if t is not None else "cpu"))


def object_from_last_stage(obj):
    """A picklable value of the last pipeline stage on every rank of the pipeline."""
    from megatron.core import parallel_state as ps

    if _pp() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return box[0]


def share_embedding_grads(model) -> None:
    """At PP > 1 a model whose output layer is its word embedding holds the weight twice, on the first stage
    and on the last: their gradients are summed (as megatron.training's `finalize_model_grads` does), so that
    both copies take the same step."""
    from megatron.core import parallel_state as ps

    if _pp() == 1 or not getattr(model, "share_embeddings_and_output_weights", False):
        return
    if not ps.is_rank_in_embedding_group():
        return
    weight = model.shared_embedding_or_output_weight()
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    dist.all_reduce(grad, group=ps.get_embedding_group())
    weight.grad = grad


def clip_grad_norm(model, max_norm: float) -> float:
    """Scale the gradients so that their global norm is at most `max_norm`; returns the norm before.
    Each rank holds a slice of the TP-sharded weights, copies of the replicated ones and its own stage's
    layers; the norm counts every slice, every stage and every copied weight once (megatron's
    `get_grad_norm_fp32` rule: TP duplicates and the last stage's copy of a tied embedding are skipped), over
    all TP x PP ranks, so every rank scales alike. Call after `share_embedding_grads`."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    params = [p for p in model.parameters() if p.grad is not None]
    device = params[0].grad.device if params else next(model.parameters()).device
    square = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            square += p.grad.detach().float().pow(2).sum()
    if ps.get_model_parallel_group() is not None and dist.get_world_size(ps.get_model_parallel_group()) > 1:
        dist.all_reduce(square, group=ps.get_model_parallel_group())
    norm = float(square.sqrt())
    scale = max_norm / (norm + 1e-6)
    if scale < 1:
        for p in params:
            p.grad.detach().mul_(scale)
    return norm
