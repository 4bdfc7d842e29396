"""The training loss's cross-entropy over the vocabulary without an fp32 copy of the logits (`--lean-cross-entropy`,
issue 28).

megatron-core's cross-entropy (fused, `fusions.fused_cross_entropy`, and unfused, `tensor_parallel.cross_entropy`)
first casts the logits [s, b, V] to fp32, turns that copy into the softmax in place and keeps it for the backward:
4 bytes a token a vocabulary entry (3.9 GiB at seq 8192 and the 128,256 entries of LLaMA-3), held from the loss to
the backward, where the peak is; under torch.compile (megatron-core's `jit_fuser`) the in-place steps become
copies, and the default throughput profile's step held another 3.9 GiB (docs/benchmarks.md, issue 28). Its
passes over the fp32 copy (cast, max, subtract, exp, sum, divide, the gradient's update and cast) read and write
~9 times its size.

Here the forward reads the logits as they are (bf16) once, in one Triton kernel per row that keeps a running
maximum and sum of exponentials in fp32 (the online softmax) and picks the target's logit; only the logits
themselves (already there, 2 bytes an entry) and three fp32 numbers a token are kept. The backward recomputes the
softmax from them and writes the gradient, in the logits' dtype, in one more pass. Vocabulary-parallel like
megatron-core's: each rank holds its slice [V / tp]; the maxima are all-reduced (max), then each rank's sum
rescaled to the global maximum and the target logit (zero where the target is another rank's) are all-reduced
(sum). loss = log(Σ exp(x - M)) + M - x[target], as megatron-core's, in fp32; the gradient (softmax − one-hot) ×
grad_output, in fp32, rounded once to the logits' dtype (megatron-core's fused version rounds to bf16 whatever
the logits' dtype).

On a CUDA device with Triton: the kernels (or on a CPU under Triton's interpreter, TRITON_INTERPRET=1); elsewhere
torch operations over row chunks of `CHUNK_ROWS` (the same arithmetic, a bounded fp32 working set)."""

from __future__ import annotations

import functools

import torch

from megatron_patch.runtime import kernels

CHUNK_ROWS = 1024  # rows of the torch path's fp32 working set: 0.5 GB at a 128k vocabulary
BLOCK = 4096  # vocabulary entries a kernel program reads per step (8 KB of bf16)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def forward_kernel(x_ptr, stride_x, target_ptr, max_ptr, sum_ptr, picked_ptr, V, start,
                       BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_x
        m = float("-inf")
        d = 0.0
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        t = tl.load(target_ptr + row) - start
        inside = (t >= 0) & (t < V)
        picked = tl.load(base + tl.where(inside, t, 0)).to(tl.float32)
        tl.store(max_ptr + row, m)
        tl.store(sum_ptr + row, d)
        tl.store(picked_ptr + row, tl.where(inside, picked, 0.0))

    @triton.jit
    def backward_kernel(x_ptr, stride_x, grad_ptr, stride_g, target_ptr, max_ptr, sum_ptr, scale_ptr, V, start,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        m = tl.load(max_ptr + row)
        d = tl.load(sum_ptr + row)
        g = tl.load(scale_ptr + row)
        t = tl.load(target_ptr + row) - start
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            ok = cols < V
            x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
            softmax = tl.exp(x.to(tl.float32) - m) / d
            softmax = tl.where(cols == t, softmax - 1.0, softmax)
            tl.store(grad_ptr + row * stride_g + cols, (softmax * g).to(x.dtype), mask=ok)

    return forward_kernel, backward_kernel


def _in_kernels(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take x (2-D, rows contiguous): a CUDA tensor with Triton installed, or any
    tensor under Triton's interpreter."""
    return x.stride(-1) == 1 and (x.is_cuda or kernels.interpreted()) and kernels.triton_installed()


def _block(vocab: int) -> int:
    """The kernels' block: `BLOCK` entries, or the vocabulary rounded up to a power of two where smaller."""
    return min(BLOCK, 1 << (vocab - 1).bit_length())


def local_statistics(x: torch.Tensor, target: torch.Tensor, start: int) -> tuple[torch.Tensor, ...]:
    """Per row of x [n, V] (this rank's vocabulary slice, entries start .. start + V - 1): the maximum, the sum of
    exp(x - maximum) and x[target - start] (0 where the target is outside the slice), each fp32 [n]."""
    n, vocab = x.shape
    out = [torch.empty(n, dtype=torch.float32, device=x.device) for _ in range(3)]
    if n == 0:
        return tuple(out)
    if _in_kernels(x):
        forward_kernel, _ = _kernels()
        forward_kernel[(n,)](x, x.stride(0), target, *out, vocab, start, BLOCK=_block(vocab), num_warps=8)
        return tuple(out)
    maximum, sums, picked = out
    for lo in range(0, n, CHUNK_ROWS):
        xf = x[lo:lo + CHUNK_ROWS].float()
        m = xf.max(dim=-1).values
        maximum[lo:lo + CHUNK_ROWS] = m
        sums[lo:lo + CHUNK_ROWS] = torch.exp(xf - m[:, None]).sum(dim=-1)
        t = target[lo:lo + CHUNK_ROWS] - start
        inside = (t >= 0) & (t < vocab)
        p = xf.gather(1, torch.where(inside, t, 0)[:, None])[:, 0]
        picked[lo:lo + CHUNK_ROWS] = torch.where(inside, p, 0.0)
    return tuple(out)


def softmax_gradient(x: torch.Tensor, target: torch.Tensor, start: int, maximum: torch.Tensor, sums: torch.Tensor,
                     scale: torch.Tensor) -> torch.Tensor:
    """(softmax(x) − one-hot(target − start)) × scale per row, in x's dtype, with the global `maximum` and `sums`
    of the rows (fp32 [n]); x [n, V]."""
    grad = torch.empty_like(x, memory_format=torch.contiguous_format)
    n, vocab = x.shape
    if n == 0:
        return grad
    if _in_kernels(x):
        _, backward_kernel = _kernels()
        backward_kernel[(n,)](x, x.stride(0), grad, grad.stride(0), target, maximum, sums, scale, vocab, start,
                              BLOCK=_block(vocab), num_warps=8)
        return grad
    for lo in range(0, n, CHUNK_ROWS):
        hi = min(lo + CHUNK_ROWS, n)
        softmax = torch.exp(x[lo:hi].float() - maximum[lo:hi, None]) / sums[lo:hi, None]
        t = target[lo:hi] - start
        inside = (t >= 0) & (t < vocab)
        rows = torch.arange(hi - lo, device=x.device)[inside]
        softmax[rows, t[inside]] -= 1.0
        grad[lo:hi] = softmax * scale[lo:hi, None]
    return grad


class _LeanCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group):
        vocab = logits.shape[-1]
        x = logits.reshape(-1, vocab)
        flat_target = target.reshape(-1).contiguous()
        rank, size = (tp_group.rank(), tp_group.size()) if tp_group is not None else (0, 1)
        start = rank * vocab
        maximum, sums, picked = local_statistics(x, flat_target, start)
        if size > 1:
            local_max = maximum.clone()
            torch.distributed.all_reduce(maximum, op=torch.distributed.ReduceOp.MAX, group=tp_group)
            sums *= torch.exp(local_max - maximum)
            both = torch.cat((picked, sums))
            torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.SUM, group=tp_group)
            picked, sums = both.split(x.shape[0])
        loss = torch.log(sums) + maximum - picked
        ctx.save_for_backward(logits, flat_target, maximum, sums)
        ctx.start = start
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_output):
        logits, flat_target, maximum, sums = ctx.saved_tensors
        x = logits.reshape(-1, logits.shape[-1])
        scale = grad_output.reshape(-1).float().contiguous()
        grad = softmax_gradient(x, flat_target, ctx.start, maximum, sums, scale)
        return grad.view(logits.shape), None, None


def lean_vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                      tp_group=None) -> torch.Tensor:
    """megatron-core's `fused_vocab_parallel_cross_entropy(logits [s, b, V / tp], target [s, b], tp_group)` ->
    loss [s, b] (fp32), computed as the module docstring says."""
    return _LeanCrossEntropy.apply(vocab_parallel_logits, target, tp_group)
