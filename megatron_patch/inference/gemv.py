"""One-token decode GEMMs (GEMV: y = x W^T for a few tokens x) as a Triton kernel that streams the weight once at
close to HBM bandwidth, with the layer's RMSNorm / LayerNorm and bias folded in. At batch-1 decode an 8B model's
step is its weights read once (14 GB on an H200: 2.9 ms at 4.8 TB/s); cuBLAS's GEMM kernels for one row run at
64-86% of that, half of them split-K with a separate reduce kernel, and TE's norm is a kernel of its own
(docs/benchmarks.md, issue 27). `gemv` reads each weight row block once, keeps fp32 partial sums in registers and
writes x's dtype: one kernel per linear layer.

`gemv(x, weight, bias=None, norm=None)`: x [..., K] with at most `MAX_ROWS` rows in all, weight [N, K] (rows
contiguous), bf16 or fp16 on a CUDA device (or Triton's interpreter, TRITON_INTERPRET=1, on a CPU); returns
norm(x) @ weight.T + bias in x's dtype. `norm`: a `Norm` (RMSNorm or LayerNorm over K): its statistics are
gathered in fp32 in the same pass over x as the products and applied to the sums at the end, so the normalised
input is never rounded to x's dtype (Transformer Engine's norm kernel rounds it before its GEMM: ours is closer
to exact arithmetic by that rounding) and x is read once. The launch configuration is chosen per (N, K) by
`config_for` (no autotuning, so a CUDA graph can capture the first call)."""

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
        # One pass over x and the weight; with a norm, its statistics are gathered in the same pass and applied
        # at the end: sum_k w (g (x - mean) rstd + b) = rstd (sum_k w g x - mean sum_k w g) + sum_k w b.
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        for m in tl.static_range(M):
            x_row = x_ptr + m * stride_xm
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum w x, or sum w g x with a norm
            acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)  # LayerNorm: sum w g
            acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)  # LayerNorm's bias: sum w b
            s1 = tl.zeros((BLOCK_K,), dtype=tl.float32)
            s2 = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + rk
                if EVEN_K:
                    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
                    xv = tl.load(x_row + k).to(tl.float32)
                else:
                    w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0.0,
                                eviction_policy="evict_first")
                    xv = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
                w = w.to(tl.float32)
                if NORM > 0:
                    g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                    if ZERO_CENTERED:
                        g = g + 1.0
                    s1 += xv
                    s2 += xv * xv
                    wg = w * g[None, :]
                    acc += tl.sum(wg * xv[None, :], axis=1)
                    if NORM == 2:
                        acc_g += tl.sum(wg, axis=1)
                        if HAS_NORM_BIAS:
                            acc_b += tl.sum(w * tl.load(gb_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :],
                                            axis=1)
                else:
                    acc += tl.sum(w * xv[None, :], axis=1)
            if NORM == 2:
                mean = tl.sum(s1, axis=0) / K
                acc = (acc - mean * acc_g) / tl.sqrt(tl.sum(s2, axis=0) / K - mean * mean + eps) + acc_b
            elif NORM == 1:
                acc = acc / tl.sqrt(tl.sum(s2, axis=0) / K + eps)
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + m * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)

    return gemv_kernel


def config_for(n: int, k: int, norm: bool = False) -> dict:
    """Launch configuration for a weight of N rows and K columns: one weight row per program (N programs fill
    the GPU many times over at every decode shape), streamed in tiles of up to 4096 columns (the largest power
    of two up to 4096 that divides K: unmasked loads), 8 warps for 4096-wide tiles, 4 below: for every Llama-3-8B
    decode GEMM the best of `benchmarks/gemv_probe.py --sweep` on an H200 (docs/benchmarks.md). With a norm
    folded in, every program also reads x's norm weight: two rows per program halve those reads."""
    block_k = min(4096, 1 << (k - 1).bit_length())
    while block_k > 1024 and k % block_k:
        block_k //= 2
    return dict(BLOCK_N=2 if norm else 1, BLOCK_K=block_k, num_warps=8 if block_k >= 4096 else 4, num_stages=2)


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
    cfg = dict(config or config_for(n, k, norm is not None))
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
