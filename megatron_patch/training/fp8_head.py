"""The output layer's three GEMMs in FP8 where Transformer Engine's output layer cannot take them
(`--fp8-output-layer` with `--fp8-output-layer-impl torch`, which `auto` picks for tied embeddings and for
megatron-core < 0.19).

megatron-core's FP8 output layer (`TELMHeadColumnParallelLinear`, which the `fp8_output_layer` patch opens to every
recipe) owns its weight: it refuses an output layer that shares the word embedding's (`tie_word_embeddings`:
LLaMA-3.2 1B / 3B, Qwen2.5 0.5B-3B, Gemma), where megatron-core hands the embedding's weight to the output layer at
each forward. The models that tie are the small ones, where the vocabulary's GEMMs weigh most (a fifth of a 1B
LLaMA's matrix FLOPs). Here megatron-core's own output layer (`ColumnParallelLinear`, the weight handed in or its
own) keeps everything (tying, its state dict, tensor and sequence parallelism) but its matrix multiply
(`_forward_impl`, the seam it calls), which becomes:

- forward: the input [tokens, hidden] and the weight [V, hidden] cast to FP8 E4M3, each with one scale of its own
  measured as it is cast (current scaling: amax over the tensor, scale = the format's largest / amax), one
  `torch._scaled_mm` with bf16 output;
- backward: the output's gradient cast to E5M2 the same way (Transformer Engine's hybrid format), the input's
  gradient = grad_out(E5M2) x weight(E4M3), the weight's = grad_out^T(E5M2) x input(E4M3) (the GEMMs'
  partial sums promoted to fp32 at intervals, `use_fast_accum=False`: Hopper's FP8 tensor cores keep about 14 bits
  as they add, 2^-12.7 of the sum of the products' magnitudes at most on an H100); the weight's gradient is added
  to its fp32 `main_grad` where megatron-core fuses weight-gradient accumulation (inside the GEMM where Transformer
  Engine is installed, `training.wgrad.accumulate_fp8`; with megatron-core's dummy-gradient protocol,
  `zero_out_wgrad` for a tied weight), or returned in the weight's dtype otherwise.

Whatever the run's recipe (delayed scaling included), this layer scales each tensor as it is cast: nothing is kept
between steps. Shapes the FP8 GEMM does not take (a dimension not a multiple of 16: decode steps, odd vocabularies)
go through megatron-core's bf16 path unchanged. The casts: one Triton kernel on a CUDA device, which writes each
tensor in its own layout and in the transposed one the backward's GEMMs take (x^T, w^T, grad_out^T: Hopper's FP8
GEMM wants the reduced dimension contiguous in both operands) in the same pass; torch operations over chunks
elsewhere (the same arithmetic: fp32 multiply, clamp, round once to nearest even)."""

from __future__ import annotations

import functools

import torch

from megatron_patch.runtime import kernels
from megatron_patch.training import wgrad

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CHUNK_ELEMENTS = 1 << 26  # the torch path's fp32 working set: 256 MB
TILE = 64  # the kernel's tile: TILE x TILE elements a program


@functools.cache
def _cast_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cast_kernel(x_ptr, out_ptr, out_t_ptr, scale_ptr, m, n, fmax, TILE: tl.constexpr, TRANSPOSE: tl.constexpr):
        # one tile of x [m, n]: cast, stored in x's layout and, with TRANSPOSE, in the transposed one [n, m]
        tiles_n = tl.cdiv(n, TILE)
        pid = tl.program_id(0).to(tl.int64)
        rows = (pid // tiles_n) * TILE + tl.arange(0, TILE)
        cols = (pid % tiles_n) * TILE + tl.arange(0, TILE)
        ok = (rows[:, None] < m) & (cols[None, :] < n)
        x = tl.load(x_ptr + rows[:, None] * n + cols[None, :], mask=ok, other=0.0).to(tl.float32) * tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x, -fmax), fmax)
        tl.store(out_ptr + rows[:, None] * n + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=ok)
        if TRANSPOSE:  # the fp32 tile transposed, then cast: the same rounding of the same values
            ok_t = (cols[:, None] < n) & (rows[None, :] < m)
            tl.store(out_t_ptr + cols[:, None] * m + rows[None, :], tl.trans(x).to(out_t_ptr.dtype.element_ty),
                     mask=ok_t)

    return cast_kernel


def _in_kernel(x: torch.Tensor) -> bool:
    """A CUDA tensor with Triton installed. Not under Triton's interpreter: its fp8 stores drop the carry of a
    rounding into the exponent (126.5 stored as 64 in E4M3, triton 3.8), so the kernel is checked against the torch
    path on a GPU (tests/gpu) and the CPU tests take the torch path."""
    return x.is_cuda and kernels.triton_installed()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize(x: torch.Tensor, dtype: torch.dtype,
             transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x (2-D) in FP8 `dtype` with one scale measured now: (q, scale_inv, q_t), q = round(x * scale) clamped to
    the format, scale = the format's largest / amax(|x|) (1 where x is all zeros), scale_inv = 1 / scale as fp32 [];
    q_t None, or with `transpose` q^T laid out row by row ([n, m], contiguous: Hopper's FP8 GEMM takes
    each operand with the reduced dimension contiguous, so the backward's GEMMs need the transposed layouts), written
    by the same pass over x where the kernel runs (as Transformer Engine's cast-transpose) rather than by a strided
    copy of q. No host synchronisation (the scale stays on the device)."""
    x = x.contiguous()
    fmax = torch.finfo(dtype).max
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dtype=torch.float32)
    # one IEEE division (a Python number over a tensor would be a reciprocal and a product: two roundings)
    scale = torch.where(amax > 0, torch.full_like(amax, fmax) / amax, torch.ones_like(amax))
    m, n = x.shape
    q = torch.empty((m, n), dtype=dtype, device=x.device)
    q_t = torch.empty((n, m), dtype=dtype, device=x.device) if transpose else None
    if x.numel() and _in_kernel(x):
        _cast_kernel()[(_cdiv(m, TILE) * _cdiv(n, TILE),)](x, q, q if q_t is None else q_t, scale, m, n, fmax,
                                                            TILE=TILE, TRANSPOSE=transpose)
    else:
        flat, out = x.view(-1), q.view(-1)
        for lo in range(0, flat.numel(), CHUNK_ELEMENTS):
            out[lo:lo + CHUNK_ELEMENTS] = (flat[lo:lo + CHUNK_ELEMENTS].float() * scale).clamp(-fmax, fmax).to(dtype)
        if transpose:
            q_t.copy_(q.t())
    return q, scale.reciprocal(), q_t


class _Fp8Linear(torch.autograd.Function):
    """y = x @ w^T with the three GEMMs in FP8 (the module's docstring); x [..., hidden], w [V, hidden]."""

    @staticmethod
    def forward(ctx, x, weight, fuse_main_grad: bool):
        lead, hidden = x.shape[:-1], x.shape[-1]
        # the backward takes both in the transposed layout (x^T for the weight's gradient, w^T for the input's)
        xq, x_inv, xq_t = quantize(x.reshape(-1, hidden), E4M3, transpose=True)
        wq, w_inv, wq_t = quantize(weight, E4M3, transpose=True)
        y = torch._scaled_mm(xq, wq.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype)
        ctx.save_for_backward(xq_t, x_inv, wq_t, w_inv)
        # the weight itself only for its main_grad (megatron-core keeps it on ctx too: one output layer may serve
        # several forwards, MTP)
        ctx.weight, ctx.fuse_main_grad, ctx.lead, ctx.dtype = weight, fuse_main_grad, lead, x.dtype
        return y.view(*lead, weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        xq_t, x_inv, wq_t, w_inv = ctx.saved_tensors
        weight = ctx.weight
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gq, g_inv, gq_t = quantize(grad_y.reshape(-1, weight.shape[0]), E5M2, transpose=need_w)
        grad_x = grad_w = None
        if need_x:  # [tokens, V] x [V, hidden], the second operand column by column (w^T's rows)
            grad_x = torch._scaled_mm(gq, wq_t.t(), scale_a=g_inv, scale_b=w_inv, out_dtype=ctx.dtype)
            grad_x = grad_x.view(*ctx.lead, weight.shape[1])
        if need_w:  # [V, tokens] x [tokens, hidden]: g^T's rows, x^T's rows as the second operand's columns
            if ctx.fuse_main_grad and hasattr(weight, "main_grad"):
                wgrad.accumulate_fp8(xq_t, x_inv, gq_t, g_inv, weight.main_grad)
                grad_w = _dummy_wgrad(weight, ctx.dtype)
            else:
                grad_w = torch._scaled_mm(gq_t, xq_t.t(), scale_a=g_inv, scale_b=x_inv, out_dtype=weight.dtype)
        return grad_x, grad_w, None


def _dummy_wgrad(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """megatron-core's protocol once a weight's gradient went into `main_grad` (its
    `LinearWithGradAccumulationAndAsyncCommunication`): where its DDP tracks `grad_added_to_main_grad`, a gradient
    tensor for autograd (zeros where the weight is tied, `zero_out_wgrad`: the DDP hook then adds the embedding's own
    gradient, which autograd sums into the same tensor, to main_grad) and the flag set; elsewhere none. The tensor
    is Transformer Engine's one reused dummy buffer (`get_dummy_wgrad`, as megatron-core takes it) where TE is
    installed, not a fresh [V, hidden] allocation each backward."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    zero = getattr(weight, "zero_out_wgrad", False)
    try:
        from transformer_engine.pytorch.module.base import get_dummy_wgrad
    except ImportError:
        return (torch.zeros if zero else torch.empty)(weight.main_grad.shape, dtype=dtype, device=weight.device)
    return get_dummy_wgrad(list(weight.main_grad.shape), dtype, zero=zero)


def fp8_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._scaled_mm` takes the three GEMMs: every dimension (tokens, hidden, V) a multiple of 16."""
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return tokens > 0 and all(d % 16 == 0 for d in (tokens, x.shape[-1], weight.shape[0]))


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, fuse_main_grad: bool = False) -> torch.Tensor:
    """x @ weight^T with its three GEMMs in FP8 (autograd included)."""
    return _Fp8Linear.apply(x, weight, fuse_main_grad)


def _forward_impl(original, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                  sequence_parallel=False, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None,
                  **rest):
    """`ColumnParallelLinear._forward_impl`'s signature; megatron-core's own for what FP8 does not take."""
    if grad_output_buffer is not None or rest.get("gtp_remat_size", 1) > 1 or not fp8_takes(input, weight):
        return original(input=input, weight=weight, bias=bias,
                        gradient_accumulation_fusion=gradient_accumulation_fusion, allreduce_dgrad=allreduce_dgrad,
                        sequence_parallel=sequence_parallel, grad_output_buffer=grad_output_buffer,
                        wgrad_deferral_limit=wgrad_deferral_limit, tp_group=tp_group, **rest)
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    # the communication megatron-core's linear does inside its autograd function, as its autograd mappings:
    # sequence parallel gathers the input (its gradient reduce-scattered), otherwise the input's gradient is
    # all-reduced over the tensor-parallel group
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    out = fp8_matmul(input, weight, fuse_main_grad=gradient_accumulation_fusion and weight.requires_grad)
    return out if bias is None else out + bias


def install(output_layer) -> None:
    """megatron-core's output layer (`ColumnParallelLinear`) with its matrix multiply in FP8 (this instance only);
    `installed` says so afterwards."""
    output_layer._forward_impl = functools.partial(_forward_impl, output_layer._forward_impl)
    output_layer.fp8_head = True


def installed(output_layer) -> bool:
    return bool(getattr(output_layer, "fp8_head", False))
