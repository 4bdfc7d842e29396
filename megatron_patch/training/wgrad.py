"""Weight-gradient accumulation into the fp32 `main_grad` inside the GEMM for megatron-core's own linear layers,
without Apex (`--wgrad-fusion-without-apex`, issue 28).

With `--gradient-accumulation-fusion` (Megatron's default), Transformer Engine's layers accumulate their weight
gradients straight into the optimizer's fp32 `main_grad` buffer (`training.model.fuse_te_wgrad`). megatron-core's
own `ColumnParallelLinear` / `RowParallelLinear` (the output layer; every layer under `--transformer-impl local`)
do it only through Apex's `fused_weight_gradient_mlp_cuda` extension; without Apex they compute the gradient in
bf16 and the DDP hook adds it into `main_grad` afterwards. At LLaMA-3-8B's output layer (128,256 × 4096) that is a
1 GiB bf16 gradient per micro-batch, rounded once more, then an add reading 3 GiB and writing 2 GiB (profile of
2026-12-05: the adds were 2.7% of an fp8 step).

`WgradAccumulation` stands in for that extension (its two calls, the same arguments): main_grad += dyᵀ·x, on a
GPU through Transformer Engine's cuBLAS GEMM with an fp32 output and beta = 1 (the call TE's own layers make for
their fused accumulation), elsewhere through torch in `main_grad`'s dtype. `accumulate_fp8` makes the same call
with FP8 operands (the torch FP8 output layer, `training.fp8_head`).

The word embedding (`VocabParallelEmbedding`, same size as the output layer at 8B) has the same add: its backward
(`F.embedding`'s) writes a dense bf16 [vocabulary, hidden] gradient, zeros but for a micro-batch's rows, which the
DDP hook then adds into main_grad. `FUNCTIONAL` (torch.nn.functional with another `embedding`) scatters the
micro-batch's rows of the gradient into main_grad instead (`index_put_` with accumulation, sorted, deterministic)
and hands autograd a dummy gradient, as megatron-core's fused linear layers do (`grad_added_to_main_grad`).

The `apex_free_wgrad_fusion` patch binds both into megatron-core's `tensor_parallel.layers`."""

from __future__ import annotations

import functools

import torch


def _te_general_gemm():
    try:
        from transformer_engine.pytorch.cpp_extensions import general_gemm
    except ImportError:
        return None
    try:  # Transformer Engine releases before get_workspace left the module take the cuBLAS workspace as an argument
        from transformer_engine.pytorch.module.base import get_workspace
    except ImportError:
        return general_gemm
    return functools.partial(general_gemm, workspace=get_workspace())


def accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] += grad_outputᵀ [out, N] · total_input [N, in] (leading dimensions flattened into N),
    accumulated in main_grad's dtype."""
    x = total_input.reshape(-1, total_input.shape[-1])
    dy = grad_output.reshape(-1, grad_output.shape[-1])
    if tuple(main_grad.shape) != (dy.shape[1], x.shape[1]):
        raise ValueError(f"weight-gradient accumulation: main_grad {tuple(main_grad.shape)} is not "
                         f"[{dy.shape[1]}, {x.shape[1]}]")
    gemm = _te_general_gemm() if main_grad.is_cuda else None
    if gemm is not None and main_grad.is_contiguous():
        gemm(x.contiguous(), dy.contiguous(), out_dtype=main_grad.dtype, accumulate=True, layout="NT",
             out=main_grad, grad=True)
    else:
        main_grad.addmm_(dy.t().to(main_grad.dtype), x.to(main_grad.dtype))


def _fp8_columnwise(q_t: torch.Tensor, scale_inv: torch.Tensor):
    """Transformer Engine's FP8 tensor for an FP8 operand held only transposed (`q_t` [n, m] of a logical [m, n],
    its `columnwise` data, as TE's layers keep what they save for the backward) with its scale inverse; None where
    this Transformer Engine has no such storage (not installed, or a release before `tensor.storage`)."""
    try:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage
    except ImportError:
        return None
    formats = {torch.float8_e4m3fn: tex.DType.kFloat8E4M3, torch.float8_e5m2: tex.DType.kFloat8E5M2}
    return Float8TensorStorage(data=None, fp8_scale_inv=scale_inv.reshape(1), fp8_dtype=formats[q_t.dtype],
                               data_transpose=q_t, quantizer=None)


def accumulate_fp8(x_t: torch.Tensor, x_inv: torch.Tensor, dy_t: torch.Tensor, dy_inv: torch.Tensor,
                   main_grad: torch.Tensor) -> bool:
    """main_grad [out, in] += dy [N, out]ᵀ · x [N, in] for FP8 operands given transposed (`dy_t` [out, N],
    `x_t` [in, N], each with its fp32 scale inverse). On a GPU inside Transformer Engine's cuBLAS GEMM (fp32 output,
    beta = 1, partial sums promoted to fp32 at intervals: TE's own weight-gradient GEMM for its FP8 layers), so no
    [out, in] fp32 temporary is written and read back; elsewhere (no Transformer Engine, or main_grad not a
    contiguous fp32 CUDA tensor) `torch._scaled_mm` to fp32 and an add. Returns whether TE's GEMM took it."""
    if main_grad.is_cuda and main_grad.dtype == torch.float32 and main_grad.is_contiguous():
        gemm = _te_general_gemm()
        x, dy = _fp8_columnwise(x_t, x_inv), _fp8_columnwise(dy_t, dy_inv)
        if gemm is not None and x is not None:
            gemm(x, dy, out_dtype=torch.float32, accumulate=True, layout="NT", out=main_grad, grad=True,
                 use_split_accumulator=True)
            return True
    main_grad.add_(torch._scaled_mm(dy_t, x_t.t(), scale_a=dy_inv, scale_b=x_inv, out_dtype=torch.float32))
    return False


class WgradAccumulation:
    """Apex's `fused_weight_gradient_mlp_cuda` calls (fp32 and half-precision main_grad alike)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        accumulate(total_input, grad_output, main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        accumulate(total_input, grad_output, main_grad)


def scatter_into_main_grad(main_grad: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor) -> None:
    """main_grad[ids[i]] += grad[i] for every token i (repeated ids summed), in main_grad's dtype."""
    main_grad.index_put_((ids.reshape(-1),), grad.reshape(-1, grad.shape[-1]).to(main_grad.dtype), accumulate=True)


def _dummy_wgrad(weight: torch.Tensor) -> torch.Tensor:
    try:  # one buffer for every layer and micro-batch, as megatron-core's fused linear layers take it
        from transformer_engine.pytorch.module.base import get_dummy_wgrad
    except ImportError:
        return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    return get_dummy_wgrad(list(weight.shape), weight.dtype)


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,), weight = ctx.saved_tensors, ctx.weight
        scatter_into_main_grad(weight.main_grad, ids, grad)
        weight.grad_added_to_main_grad = True  # the DDP hook skips its add (and runs, for the bucket's count)
        return None, _dummy_wgrad(weight)


def embedding(input: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`F.embedding`, whose weight gradient goes straight into `weight.main_grad` where megatron-core's DDP gave
    the weight one (and asks for no zeroed dummy); anywhere else (no DDP, inference, Megatron-FSDP, extra
    arguments) `F.embedding` itself."""
    if (args or kwargs or not torch.is_grad_enabled() or not weight.requires_grad
            or getattr(weight, "main_grad", None) is None or not hasattr(weight, "grad_added_to_main_grad")
            or getattr(weight, "zero_out_wgrad", False) or hasattr(weight, "__fsdp_param__")):
        return torch.nn.functional.embedding(input, weight, *args, **kwargs)
    return _EmbeddingIntoMainGrad.apply(input, weight)


class _Functional:
    """torch.nn.functional with `embedding` above."""

    @staticmethod
    def embedding(*args, **kwargs) -> torch.Tensor:
        return embedding(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch.nn.functional, name)


FUNCTIONAL = _Functional()
