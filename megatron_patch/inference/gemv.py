"""One-token decode GEMMs (GEMV: y = x W^T for a few tokens x) as a Triton kernel that streams the weight once at
close to HBM bandwidth, with the layer's RMSNorm / LayerNorm and bias folded in. At batch-1 decode an 8B model's
step is its weights read once (14 GB on an H200: 2.9 ms at 4.8 TB/s); cuBLAS's GEMM kernels for one row run at
64-86% of that, half of them split-K with a separate reduce kernel, and TE's norm is a kernel of its own
(docs/benchmarks.md, issue 27). `gemv` reads each weight row block once, keeps fp32 partial sums in registers and
writes x's dtype: one kernel per linear layer.

`gemv(x, weight, bias=None, norm=None)`: x [..., K] with at most `MAX_ROWS` rows in all, weight [N, K] (rows
contiguous), bf16 or fp16 on a CUDA device (or Triton's interpreter, TRITON_INTERPRET=1, on a CPU); returns
norm(x) @ weight.T + bias in x's dtype. `norm`: a `Norm` (RMSNorm or LayerNorm over K, computed in fp32 as
Transformer Engine does). The launch configuration is chosen per (N, K) by `config_for` (no autotuning, so a CUDA
graph can capture the first call)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MAX_ROWS = 4
# Rows per call the decode patch hands to the kernel: it reads the weight once per row, so at 4 rows it runs at a
# third of cuBLAS's speed (8B: 10.3 vs 4.0 ms a step's GEMMs, `gemv_probe.py --rows 4`, 2026-12-03); at one row it
# beats cuBLAS (3.6 vs 4.0 ms).
SERVED_ROWS = 1
NORMS = {"RMSNorm": 1, "LayerNorm": 2}


@dataclass
class Norm:
    kind: str  # "RMSNorm" or "LayerNorm"
    weight: torch.Tensor  # [K]
    bias: torch.Tensor | None
    eps: float
    zero_centered_gamma: bool = False  # y = norm(x) * (1 + weight)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, g_ptr, gb_ptr, N, K, eps, stride_xm, stride_wn, stride_ym,
                    M: tl.constexpr, NORM: tl.constexpr, ZERO_CENTERED: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_NORM_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        for m in tl.static_range(M):
            x_row = x_ptr + m * stride_xm
            mean = 0.0
            rstd = 1.0
            if NORM > 0:  # the row's statistics (x is K values, read from L2 by every program)
                s1 = tl.zeros((BLOCK_K,), dtype=tl.float32)
                s2 = tl.zeros((BLOCK_K,), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    k = k0 + rk
                    xv = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
                    s1 += xv
                    s2 += xv * xv
                if NORM == 2:
                    mean = tl.sum(s1, axis=0) / K
                    rstd = 1.0 / tl.sqrt(tl.sum(s2, axis=0) / K - mean * mean + eps)
                else:
                    rstd = 1.0 / tl.sqrt(tl.sum(s2, axis=0) / K + eps)
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + rk
                if EVEN_K:
                    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
                    xv = tl.load(x_row + k).to(tl.float32)
                else:
                    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0.0,
                                eviction_policy="evict_first")
                    xv = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
                if NORM > 0:
                    g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                    if ZERO_CENTERED:
                        g = g + 1.0
                    xn = (xv - mean) * rstd * g
                    if HAS_NORM_BIAS:
                        xn += tl.load(gb_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                    # the normalised input in x's precision, as the norm kernel would hand it to the GEMM
                    xv = xn.to(x_ptr.dtype.element_ty).to(tl.float32)
                acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + m * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)

    return gemv_kernel


def config_for(n: int, k: int) -> dict:
    """Launch configuration for a weight of N rows and K columns: one row per program (N programs fill the GPU
    many times over at every decode shape), streamed in tiles of up to 4096 columns (the largest power of two up
    to 4096 that divides K, for unmasked loads) by 8 warps. The best of `benchmarks/gemv_probe.py --sweep` for
    Llama-3-8B's decode GEMMs on an H200, within 1% (docs/benchmarks.md)."""
    block_k = min(4096, 1 << (k - 1).bit_length())
    while block_k > 1024 and k % block_k:
        block_k //= 2
    return dict(BLOCK_N=1, BLOCK_K=block_k, num_warps=8, num_stages=2)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, norm: Norm | None = None,
         config: dict | None = None) -> torch.Tensor:
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"gemv: x has {x.shape[-1]} features, the weight {k}")
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv: {m} rows (1..{MAX_ROWS})")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("gemv: the weight's rows must be contiguous")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = dict(config or config_for(n, k))
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    gamma = norm.weight if norm is not None else None
    norm_bias = norm.bias if norm is not None else None
    _kernel()[((n + block_n - 1) // block_n,)](
        rows, weight, bias if bias is not None else y, y, gamma if gamma is not None else y,
        norm_bias if norm_bias is not None else y, n, k, float(norm.eps) if norm is not None else 0.0,
        rows.stride(0), weight.stride(0), y.stride(0), M=m, NORM=NORMS[norm.kind] if norm is not None else 0,
        ZERO_CENTERED=bool(norm is not None and norm.zero_centered_gamma), HAS_BIAS=bias is not None,
        HAS_NORM_BIAS=norm_bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, **cfg)
    return y.reshape(*x.shape[:-1], n)
