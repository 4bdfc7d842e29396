"""Rotary position embedding of the dynamic engine's tokens in one Triton kernel that reads each token's position
itself. megatron-core's dynamic context (`apply_rotary_emb_query` / `apply_rotary_emb_key`) first gathers every
token's angles from the rotary table (one index kernel each for the queries and the keys), runs Transformer
Engine's fused RoPE, and copies the rotated queries back into the query tensor: five kernels a layer, each a few
microseconds of launch-bound work on one decode token (8B, one request: ~0.3 ms of a ~5 ms step; docs/
benchmarks.md, issue 27). `rope_(t, freqs, positions)` rotates in place in one kernel each for queries and keys.

t [n, heads, d] (strided: last dim contiguous), freqs [positions, 1, 1, r] (megatron-core's table of angles, fp32,
the non-interleaved layout `cat(f, f)`, r ≤ d even), positions [n] (int). For each token i and pair j < r/2, with
a = freqs[positions[i], j] and b = freqs[positions[i], j + r/2]: t[i, :, j] = x1·cos a − x2·sin a and
t[i, :, j + r/2] = x2·cos b + x1·sin b (x1, x2 the old values), in fp32, rounded to t's dtype: Transformer Engine's
fused RoPE (`fused_apply_rotary_pos_emb`, bshd) arithmetic. Dimensions ≥ r pass through."""

from __future__ import annotations

import functools
import os

import torch

try:  # precise sine and cosine (angles reach thousands of radians); a module global, as Triton's JIT resolves it
    from triton.language.extra import libdevice
except ImportError:  # no Triton: `rope_` is not called (the patch needs it)
    libdevice = None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(t_ptr, f_ptr, pos_ptr, stride_tn, stride_th, stride_fp, HEADS: tl.constexpr,
                    H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, NUMPY_TRIG: tl.constexpr):
        i = tl.program_id(0)
        h = tl.arange(0, H_PAD)
        j = tl.arange(0, HALF_PAD)
        ok = (h[:, None] < HEADS) & (j[None, :] < HALF)
        pos = tl.load(pos_ptr + i).to(tl.int64)
        a = tl.load(f_ptr + pos * stride_fp + j, mask=j < HALF, other=0.0).to(tl.float32)
        b = tl.load(f_ptr + pos * stride_fp + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
        base = t_ptr + i * stride_tn + h[:, None] * stride_th + j[None, :]
        x1 = tl.load(base, mask=ok, other=0.0)
        x2 = tl.load(base + HALF, mask=ok, other=0.0)
        if NUMPY_TRIG:  # Triton's interpreter (no libdevice there): numpy's fp32 sine and cosine
            cos_a, sin_a, cos_b, sin_b = tl.cos(a), tl.sin(a), tl.cos(b), tl.sin(b)
        else:
            cos_a, sin_a, cos_b, sin_b = libdevice.cos(a), libdevice.sin(a), libdevice.cos(b), libdevice.sin(b)
        y1 = x1.to(tl.float32) * cos_a[None, :] - x2.to(tl.float32) * sin_a[None, :]
        y2 = x2.to(tl.float32) * cos_b[None, :] + x1.to(tl.float32) * sin_b[None, :]
        tl.store(base, y1.to(x1.dtype), mask=ok)
        tl.store(base + HALF, y2.to(x2.dtype), mask=ok)

    return triton, rope_kernel


def serves(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether `rope_` takes these tensors: t [n, heads, d] or [n, 1, heads, d] with a contiguous last dim, freqs
    [positions, 1, 1, r] fp32 with r even and ≤ d, on the same device."""
    if t.dim() == 4 and t.shape[1] == 1:
        t = t[:, 0]
    return (t.dim() == 3 and t.stride(-1) == 1 and freqs.dim() == 4 and freqs.shape[1:3] == (1, 1)
            and freqs.dtype == torch.float32 and freqs.stride(-1) == 1 and freqs.shape[-1] % 2 == 0
            and freqs.shape[-1] <= t.shape[-1] and t.device == freqs.device)


def rope_(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate t's first `freqs.shape[-1]` dimensions in place by the angles at `positions` (module docstring);
    returns t."""
    if not serves(t, freqs):
        raise ValueError(f"rope_: unsupported tensors t {tuple(t.shape)} / {t.stride()}, freqs "
                         f"{tuple(freqs.shape)} {freqs.dtype}")
    v = t[:, 0] if t.dim() == 4 else t
    n, heads, _ = v.shape
    if n == 0:
        return t
    half = freqs.shape[-1] // 2
    triton, kernel = _kernel()
    kernel[(n,)](v, freqs, positions, v.stride(0), v.stride(1), freqs.stride(0), HEADS=heads,
                 H_PAD=triton.next_power_of_2(heads), HALF=half, HALF_PAD=triton.next_power_of_2(half),
                 NUMPY_TRIG=os.environ.get("TRITON_INTERPRET") == "1", num_warps=4)
    return t
