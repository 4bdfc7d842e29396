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
fused RoPE (`fused_apply_rotary_pos_emb`, bshd) arithmetic. Dimensions ≥ r pass through.

`mla_rope(t, freqs, positions, mscale)`: multi-latent attention's rotation (DeepSeek; `MLA_ROPE`, below) in one
kernel, with megatron-core's unfused arithmetic."""

from __future__ import annotations

import functools

import torch

from megatron_patch.runtime import kernels

try:  # precise sine and cosine (angles reach thousands of radians); a module global, as Triton's JIT resolves it
    from triton.language.extra import libdevice
except ImportError:  # no Triton: `rope_` is not called (the patch needs it)
    libdevice = None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(t_ptr, o_ptr, f_ptr, pos_ptr, mscale, stride_tn, stride_th, stride_on, stride_oh, stride_fp,
                    HEADS: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                    NUMPY_TRIG: tl.constexpr, MLA: tl.constexpr):
        i = tl.program_id(0)
        h = tl.arange(0, H_PAD)
        j = tl.arange(0, HALF_PAD)
        ok = (h[:, None] < HEADS) & (j[None, :] < HALF)
        pos = tl.load(pos_ptr + i).to(tl.int64)
        a = tl.load(f_ptr + pos * stride_fp + j, mask=j < HALF, other=0.0).to(tl.float32)
        b = tl.load(f_ptr + pos * stride_fp + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
        src = t_ptr + i * stride_tn + h[:, None] * stride_th
        if MLA:  # the even dimensions, then the odd ones: MLA's de-interleave
            x1 = tl.load(src + 2 * j[None, :], mask=ok, other=0.0)
            x2 = tl.load(src + 2 * j[None, :] + 1, mask=ok, other=0.0)
        else:
            x1 = tl.load(src + j[None, :], mask=ok, other=0.0)
            x2 = tl.load(src + HALF + j[None, :], mask=ok, other=0.0)
        if NUMPY_TRIG:  # Triton's interpreter (no libdevice there): numpy's fp32 sine and cosine
            cos_a, sin_a, cos_b, sin_b = tl.cos(a), tl.sin(a), tl.cos(b), tl.sin(b)
        else:
            cos_a, sin_a, cos_b, sin_b = libdevice.cos(a), libdevice.sin(a), libdevice.cos(b), libdevice.sin(b)
        dt = x1.dtype
        if MLA:  # megatron-core's unfused rounding: cos / sin x mscale to t's dtype, each product, the sum
            cos_a, sin_a = (cos_a * mscale).to(dt).to(tl.float32), (sin_a * mscale).to(dt).to(tl.float32)
            cos_b, sin_b = (cos_b * mscale).to(dt).to(tl.float32), (sin_b * mscale).to(dt).to(tl.float32)
            y1 = ((x1.to(tl.float32) * cos_a[None, :]).to(dt).to(tl.float32)
                  - (x2.to(tl.float32) * sin_a[None, :]).to(dt).to(tl.float32))
            y2 = ((x2.to(tl.float32) * cos_b[None, :]).to(dt).to(tl.float32)
                  + (x1.to(tl.float32) * sin_b[None, :]).to(dt).to(tl.float32))
        else:  # Transformer Engine's: fp32 throughout, one rounding
            y1 = x1.to(tl.float32) * cos_a[None, :] - x2.to(tl.float32) * sin_a[None, :]
            y2 = x2.to(tl.float32) * cos_b[None, :] + x1.to(tl.float32) * sin_b[None, :]
        dst = o_ptr + i * stride_on + h[:, None] * stride_oh + j[None, :]
        tl.store(dst, y1.to(dt), mask=ok)
        tl.store(dst + HALF, y2.to(dt), mask=ok)

    return triton, rope_kernel


def _launch(t: torch.Tensor, out: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, mscale: float,
            mla: bool) -> None:
    v, o = (t[:, 0], out[:, 0]) if t.dim() == 4 else (t, out)
    n, heads, _ = v.shape
    if n == 0:
        return
    half = freqs.shape[-1] // 2
    triton, kernel = _kernel()
    kernel[(n,)](v, o, freqs, positions, float(mscale), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
                 freqs.stride(0), HEADS=heads, H_PAD=triton.next_power_of_2(heads), HALF=half,
                 HALF_PAD=triton.next_power_of_2(half), NUMPY_TRIG=kernels.interpreted(),
                 MLA=mla, num_warps=4)


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
    _launch(t, t, freqs, positions, 1.0, mla=False)
    return t


# Multi-latent attention's RoPE (DeepSeek) through the same patch: megatron-core rotates MLA's rope part unfused
# (TE's fused RoPE takes neither its interleaved layout nor YaRN's mscale), ~29 kernels a layer for the queries and
# the keys (de-interleave, cos, sin, scale, casts, rotate-half, products, sum, concatenations, the angle gathers
# and the copy back; the CPU count in docs/benchmarks.md), ~700 a step at DeepSeek-V2-Lite's 27 layers, which
# decodes at 8.2 ms a token under CUDA graphs against a 1.0 ms bandwidth bound (docs/benchmarks.md). `mla_rope`
# does the same arithmetic in one kernel. On since the H200 of 2026-12-05: within megatron-core's bf16 roundings of
# its result (75% of elements bitwise equal, the rest one unit apart) and HF's greedy tokens but at a near-tie
# (`test_mla_rope_kernel_equals_megatron_core`); v2-lite at one request 8.28 -> 6.97 ms a token
# (`generate_bench.py --no-mla-rope` is the row without it). The engine's plan records it (`EnginePlan.mla_rope`).
MLA_ROPE: bool = True


def mla_serves(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether `mla_rope` takes these tensors: as `serves`, with t's last dimension all rotated (MLA's rope part:
    `freqs.shape[-1] == t.shape[-1]`)."""
    return serves(t, freqs) and freqs.shape[-1] == t.shape[-1]


def mla_rope(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor, mscale: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """megatron-core's unfused RoPE of multi-latent attention (`_apply_rotary_pos_emb_bshd` with
    `mla_rotary_interleaved`) at each token's position: t [n, heads, d] or [n, 1, heads, d] (last dim contiguous),
    de-interleaved (even dimensions, then odd) and rotated by `freqs[positions]` (fp32 angles, r = d) scaled by
    `mscale`, written to `out` (same shape; default: t itself, in place). Arithmetic as megatron-core's: cos and
    sin x mscale rounded to t's dtype, each product and the sum rounded to it."""
    if not mla_serves(t, freqs):
        raise ValueError(f"mla_rope: unsupported tensors t {tuple(t.shape)} / {t.stride()}, freqs "
                         f"{tuple(freqs.shape)} {freqs.dtype}")
    out = t if out is None else out
    if out.shape != t.shape or out.dtype != t.dtype or out.stride(-1) != 1:
        raise ValueError(f"mla_rope: out {tuple(out.shape)} {out.dtype} does not match t {tuple(t.shape)} {t.dtype}")
    _launch(t, out, freqs, positions, mscale, mla=True)
    return out
