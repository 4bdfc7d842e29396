"""MoE layers for megatron-core's dynamic inference engine without token drops and without a host
synchronisation: every token goes to its top-k experts, and each expert's rows are multiplied in two grouped GEMMs
(`torch.nn.functional.grouped_mm`, whose group offsets stay on the device), so a step's kernels depend on the
step's token count only and a CUDA graph replays them for any routing.

megatron-core's own dispatchers read each expert's token count on the host (`.tolist()` for the experts' GEMMs:
a stream synchronisation in every MoE layer of every step, and `SequentialMLP` then runs its experts one by one
from Python), except its all-to-all dispatcher in drop-and-pad mode, which CUDA graphs use: every expert takes a
row for every token (`dynamic.moe_graph_dispatch`), so a decode step of one request reads the weights of all
experts, not of its k. Here a token's rows are its k assignments only. megatron-core 0.19's inference-optimised
experts (`InferenceGroupedMLP`, `transformer_impl="inference_optimized"`) take the same grouped GEMMs but only
for squared-ReLU experts and a model built for it; this serves the gated (SwiGLU) experts of Mixtral, Qwen-MoE
and DeepSeek as our models are built, TE or local, `SequentialMLP` or `TEGroupedMLP`.

`dispatch(layers)` swaps, for a call, each MoE layer's token dispatcher for a `DroplessDispatcher` (routing:
the experts of each token sorted by expert, on the device; combine: each token's k rows summed in fp32) and its
experts' forward for the grouped GEMMs over the experts' weights stacked `[experts, out, in]`. Stacking aliases
the parameters: weights already laid out one after the other in one storage are viewed as such; weights that
each own their storage are moved once into one buffer, each parameter keeping its object and pointing at its
slice (as megatron-core's `InferenceGroupedMLP._build_concatenated_weights` does; memory is unchanged after the
move, one layer's experts at a time). Weights that are views into a larger buffer are never moved: at equal
distances (a distributed optimizer's parameter buffer, which holds them in reverse order) they are viewed where they
are, the groups then in reverse expert order; elsewhere `refusal` says why and the engine keeps megatron-core's
dispatchers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _grouped_mm():
    """torch's grouped GEMM with device-side offsets (`torch.nn.functional.grouped_mm`, torch 2.10 on;
    `torch._grouped_mm` before), or None."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def expert_weights(experts) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """The fc1 and fc2 weights ([out, in] each) of an MoE layer's experts, one per local expert in expert order:
    `SequentialMLP` (`local_experts[i].linear_fc{1,2}.weight`) or `TEGroupedMLP` (`linear_fc{1,2}.weight{i}`);
    None for another experts module."""
    if hasattr(experts, "local_experts"):
        return ([e.linear_fc1.weight for e in experts.local_experts],
                [e.linear_fc2.weight for e in experts.local_experts])
    fc1, fc2 = getattr(experts, "linear_fc1", None), getattr(experts, "linear_fc2", None)
    if fc1 is not None and hasattr(fc1, "weight0") and hasattr(fc2, "weight0"):
        n = experts.num_local_experts
        return [getattr(fc1, f"weight{i}") for i in range(n)], [getattr(fc2, f"weight{i}") for i in range(n)]
    return None


def _group_size(group) -> int:
    return 1 if group is None else group.size()


def refusal(layer) -> str | None:
    """Why `layer` (a megatron-core `MoELayer`) cannot run dropless here, or None: no grouped GEMM in this torch,
    experts or tokens spread over ranks (EP, expert TP), routing or experts other than plain top-k to gated or
    plain activations without biases (capacity and drops, probabilities on the input, interleaved or clamped GLU,
    latent projections, shared experts overlapped with the dispatch, FP8 / FP4), or weights that are not plain
    tensors of one shape and dtype, bf16 on a GPU (the dtype of torch's CUTLASS grouped GEMM, which reads the offsets
    on the device; in other dtypes it loops over the groups with the offsets copied to the host), rows of 16-byte
    multiples, aligned to 16 bytes."""
    if _grouped_mm() is None:
        return "no torch.nn.functional.grouped_mm in this torch"
    c, d = layer.config, layer.token_dispatcher
    if (c.expert_model_parallel_size > 1 or (c.expert_tensor_parallel_size or 1) > 1
            or any(_group_size(getattr(d, g, None)) > 1 for g in ("ep_group", "tp_group", "tp_ep_group"))):
        return "experts or tokens spread over ranks (EP or expert TP > 1)"
    unsupported = {"moe_expert_capacity_factor": c.moe_expert_capacity_factor is not None,
                   "moe_pad_expert_input_to_capacity": c.moe_pad_expert_input_to_capacity,
                   "moe_apply_probs_on_input": c.moe_apply_probs_on_input,
                   "moe_mlp_glu_interleave_size": getattr(c, "moe_mlp_glu_interleave_size", None) is not None,
                   "moe_latent_size": bool(getattr(c, "moe_latent_size", None)),
                   "moe_shared_expert_overlap": bool(getattr(layer, "shared_expert_overlap", False)),
                   "add_bias_linear": c.add_bias_linear, "fp8": c.fp8 is not None,
                   "fp4": getattr(c, "fp4", None) is not None}
    named = [k for k, on in unsupported.items() if on]
    if named:
        return f"MoE settings the dropless path does not serve: {', '.join(named)}"
    weights = expert_weights(layer.experts)
    if weights is None:
        return f"experts module {type(layer.experts).__name__}"
    for ws in weights:
        w0 = ws[0]
        if len(ws) != c.num_moe_experts or any(type(w.data) is not torch.Tensor or w.shape != w0.shape
                                               or w.dtype != w0.dtype or w.device != w0.device for w in ws):
            return "expert weights that are not plain tensors of one shape and dtype"
        if w0.is_cuda and w0.dtype != torch.bfloat16:
            return f"{w0.dtype} expert weights on a GPU (its grouped GEMM takes bf16)"
        if any(n * w0.element_size() % 16 for n in w0.shape):
            return f"expert weights of shape {tuple(w0.shape)} (rows of 16-byte multiples)"
    layouts = [stacked(ws) for ws in weights]
    for ws, layout in zip(weights, layouts):
        if layout is None and not _own_storage(ws):
            return "expert weights that are views into a larger buffer at irregular places"
        if layout is not None and (layout[0].data_ptr() % 16 or layout[0].stride(0) * layout[0].element_size() % 16):
            return "expert weights not aligned to 16 bytes (the grouped GEMM's requirement on a GPU)"
    if len({layout[1] if layout else False for layout in layouts}) > 1:  # (own storages: stacked in order)
        return "fc1 and fc2 expert weights laid out in opposite orders"
    return None


def stacked(ws: list[torch.Tensor]) -> tuple[torch.Tensor, bool] | None:
    """The weights `ws` ([out, in] each, one per expert) as one [experts, out, in] tensor over their own storage,
    and whether it holds them in reverse expert order; None unless they lie at equal distances in one storage
    (each contiguous, none overlapping): one after the other as `stack_in_place` leaves them, or as a distributed
    optimizer's parameter buffer holds them (megatron-core's DDP fills its buckets in reverse order, `SequentialMLP`
    interleaving fc1 and fc2: an expert's fc1 every fc1 + fc2 elements)."""
    w0 = ws[0]
    storage = w0.untyped_storage().data_ptr()
    if not all(w.is_contiguous() and w.untyped_storage().data_ptr() == storage for w in ws):
        return None
    offsets = [w.storage_offset() for w in ws]
    step = offsets[1] - offsets[0] if len(ws) > 1 else w0.numel()
    if abs(step) < w0.numel() or any(o != offsets[0] + i * step for i, o in enumerate(offsets)):
        return None
    view = w0.detach().as_strided((len(ws), *w0.shape), (abs(step), w0.shape[1], 1), min(offsets))
    return view, step < 0


def _own_storage(ws: list[torch.Tensor]) -> bool:
    return all(w.is_contiguous() and w.storage_offset() == 0
               and w.untyped_storage().nbytes() == w.numel() * w.element_size() for w in ws)


def stack_in_place(ws: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """`stacked(ws)`, moving weights that each own their storage into one buffer first (each parameter keeps its
    object and now views its slice; the old storages are freed)."""
    layout = stacked(ws)
    if layout is not None:
        return layout
    with torch.no_grad(), torch.inference_mode(False):
        buffer = torch.empty((len(ws), *ws[0].shape), dtype=ws[0].dtype, device=ws[0].device)
        for i, w in enumerate(ws):
            buffer[i].copy_(w)
            w.data = buffer[i]
    return stacked(ws)


class DroplessDispatcher:
    """A token dispatcher (megatron-core's interface: `dispatch_preprocess`, `token_dispatch`,
    `dispatch_postprocess`, `combine_preprocess`, `token_combine`, `combine_postprocess`) for one rank holding
    every expert: each token's k experts (from the router's `routing_map`), its rows sorted by expert (stable;
    `reverse`: in reverse expert order, as the weights lie), the count per expert on the device; the combine puts
    the rows back in token order and sums each token's k rows in fp32 (in a fixed order: the same sums under CUDA
    graphs and eagerly)."""

    def __init__(self, topk: int, num_experts: int, reverse: bool = False):
        self.topk, self.num_experts, self.reverse = topk, num_experts, reverse

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        experts = torch.topk(routing_map.to(torch.float32), self.topk, dim=1).indices  # [tokens, k]
        # (weights held in reverse expert order: groups in that order)
        flat = (self.num_experts - 1 - experts if self.reverse else experts).reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        self.counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        self.rows = torch.div(self.order, self.topk, rounding_mode="floor")  # each sorted row's token
        self.row_probs = probs.gather(1, experts).reshape(-1)[self.order]
        return hidden_states, probs

    def token_dispatch(self, hidden_states, probs):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        tokens = hidden_states.reshape(-1, self.hidden_shape[-1])
        return tokens.index_select(0, self.rows), self.counts, self.row_probs

    def combine_preprocess(self, hidden_states):
        by_token = torch.empty_like(hidden_states).index_copy_(0, self.order, hidden_states)
        summed = by_token.view(-1, self.topk, by_token.shape[-1]).sum(1, dtype=torch.float32)
        return summed.to(hidden_states.dtype)

    def token_combine(self, hidden_states):
        return hidden_states

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)

    def get_expert_zero_copy_buffers(self):  # (megatron-core 0.19 asks; none here)
        return None, None


def experts_forward(config, fc1: torch.Tensor, fc2: torch.Tensor):
    """The experts' forward over `DroplessDispatcher`'s rows: fc1 and fc2 ([experts, out, in], `stacked`) as two
    grouped GEMMs at the device-side offsets of the counts, megatron-core's activation between them (gated:
    `activation(gate) * (linear + glu_linear_offset)`), each row weighted by its routing probability there (in
    fp32, then the rows' dtype, as megatron-core's experts weight it)."""
    grouped_mm = _grouped_mm()
    offset = getattr(config, "glu_linear_offset", 0.0) or 0.0

    def forward(rows, counts, probs, *args, **kwargs):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = grouped_mm(rows, fc1.transpose(1, 2), offs=offs)
        if config.gated_linear_unit:
            gate, linear = torch.chunk(h, 2, dim=-1)
            h = config.activation_func(gate) * (linear + offset)
        else:
            h = config.activation_func(h)
        h = (h * probs.unsqueeze(-1)).to(rows.dtype)
        return grouped_mm(h, fc2.transpose(1, 2), offs=offs), None

    return forward


def refusals(layers: list) -> str | None:
    """Why the MoE layers `layers` cannot all run dropless (the first layer refused), or None."""
    for i, layer in enumerate(layers):
        why = refusal(layer)
        if why is not None:
            return f"MoE layer {i}: {why}"
    return None


@contextlib.contextmanager
def dispatch(layers: list) -> Iterator[None]:
    """The MoE layers `layers` dropless for the duration (each one's dispatcher and experts' forward swapped; its
    expert weights stacked in place, which stays), then as they were. Every layer must pass `refusal`."""
    saved = [(m, m.token_dispatcher) for m in layers]
    try:
        for m in layers:
            (fc1, reverse), (fc2, _) = (stack_in_place(ws) for ws in expert_weights(m.experts))
            m.token_dispatcher = DroplessDispatcher(m.config.moe_router_topk, m.config.num_moe_experts, reverse)
            m.experts.forward = experts_forward(m.config, fc1, fc2)
        yield
    finally:
        for m, d in saved:
            m.token_dispatcher = d
            m.experts.__dict__.pop("forward", None)
