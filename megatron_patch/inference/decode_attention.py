"""Decode attention over megatron-core's paged KV cache with the key length split across programs (split-KV,
"flash decoding") as two Triton kernels. FlashAttention-4 has no split-KV kernel on Hopper (SM90), so one decode
token per request attends in one program per (request, KV head) there: 19 us a layer at 8B with ~1k cached tokens,
0.68 ms of a 7.1 ms decode step, while the bytes it reads take ~1 us (docs/benchmarks.md, issue 27).

`decode_attention(q, k_cache, v_cache, block_table, seqlens_k, scale)`: q [n, heads, dim] (one query per request,
at the request's last position), the caches [blocks, block_size, kv heads, dim] as megatron-core keeps them,
`block_table` [n, blocks per request], `seqlens_k` [n] (0 for a padding row: its output is 0); grouped queries
(head h reads KV head h // (heads / kv heads)); ALiBi `slopes` [heads] add slope_h * (j - i) to the scaled scores
(`models/modules/alibi.py`). Returns softmax(q k^T * scale) v [n, heads, dim] in q's dtype,
products in the inputs' dtype with fp32 accumulation and softmax, as flash-attn. The first kernel attends each
(request, KV head, split of `part` positions) with an online softmax and writes its partial output and
log-sum-exp; the second combines the splits. Shapes depend only on the tensors' shapes, so a CUDA graph replays
it for any lengths."""

from __future__ import annotations

import functools
import os

import torch

BLOCK_T = 64  # key positions per tile
TARGET_PROGRAMS = 264  # ~2 per SM of an H100 / H200


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, slopes_ptr, scale,
                     stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                     stride_btn, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                     PAGE: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                     PART: tl.constexpr, BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr, ALIBI: tl.constexpr):
        r = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        kv_len = tl.load(len_ptr + r)
        start = sp * PART
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        heads = kh * GROUP + g
        g_ok = g < GROUP
        m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        if start < kv_len:
            q = tl.load(q_ptr + r * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None],
                        other=0.0)
            for t0 in range(0, PART, BLOCK_T):
                t = start + t0 + tl.arange(0, BLOCK_T)
                t_ok = t < kv_len
                page = tl.load(bt_ptr + r * stride_btn + t // PAGE, mask=t_ok, other=0).to(tl.int64)
                slot = t % PAGE
                k = tl.load(k_ptr + (page * stride_kb + slot * stride_kt + kh * stride_kh)[:, None] + d[None, :],
                            mask=t_ok[:, None], other=0.0)
                if DOT_F32:  # Triton's interpreter (no bf16 arithmetic in numpy): the same exact products in fp32
                    s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
                else:
                    s = tl.dot(q, tl.trans(k)) * scale
                if ALIBI:  # slope_h * (j - i), the query at position kv_len - 1
                    slope = tl.load(slopes_ptr + heads, mask=g_ok, other=0.0)
                    s = s + slope[:, None] * (t - (kv_len - 1)).to(tl.float32)[None, :]
                s = tl.where(t_ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(v_ptr + (page * stride_vb + slot * stride_vt + kh * stride_vh)[:, None] + d[None, :],
                            mask=t_ok[:, None], other=0.0)
                if DOT_F32:
                    pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(o_ptr + r * stride_on + heads[:, None] * stride_oh + sp * stride_os + d[None, :], out,
                 mask=g_ok[:, None])
        tl.store(lse_ptr + r * stride_ln + heads * stride_lh + sp, lse, mask=g_ok)

    @triton.jit
    def combine_kernel(o_ptr, lse_ptr, y_ptr, splits, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                       stride_yn, stride_yh, S_PAD: tl.constexpr, D: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, S_PAD)
        d = tl.arange(0, D)
        s_ok = s < splits
        lse = tl.load(lse_ptr + r * stride_ln + h * stride_lh + s, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m_safe)
        total = tl.sum(w, 0)
        o = tl.load(o_ptr + r * stride_on + h * stride_oh + s[:, None] * stride_os + d[None, :], mask=s_ok[:, None],
                    other=0.0)
        y = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(y_ptr + r * stride_yn + h * stride_yh + d, y.to(y_ptr.dtype.element_ty))

    @triton.jit
    def mla_split_kernel(q_ptr, c_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, scale, heads_total,
                         stride_qn, stride_qh, stride_cb, stride_ct, stride_btn, stride_on, stride_oh, stride_os,
                         stride_ln, stride_lh, PAGE: tl.constexpr, HB: tl.constexpr, D: tl.constexpr,
                         DR: tl.constexpr, PART: tl.constexpr, BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr):
        r = tl.program_id(0)
        hb = tl.program_id(1)
        sp = tl.program_id(2)
        kv_len = tl.load(len_ptr + r)
        start = sp * PART
        heads = hb * HB + tl.arange(0, HB)
        h_ok = heads < heads_total
        d = tl.arange(0, D)
        dr = tl.arange(0, DR)
        m_i = tl.full((HB,), float("-inf"), tl.float32)
        l_i = tl.zeros((HB,), tl.float32)
        acc = tl.zeros((HB, D), tl.float32)
        if start < kv_len:
            q_row = q_ptr + r * stride_qn + heads[:, None] * stride_qh
            qn = tl.load(q_row + d[None, :], mask=h_ok[:, None], other=0.0)
            qr = tl.load(q_row + D + dr[None, :], mask=h_ok[:, None], other=0.0)
            for t0 in range(0, PART, BLOCK_T):
                t = start + t0 + tl.arange(0, BLOCK_T)
                t_ok = t < kv_len
                page = tl.load(bt_ptr + r * stride_btn + t // PAGE, mask=t_ok, other=0).to(tl.int64)
                row = c_ptr + page * stride_cb + (t % PAGE) * stride_ct
                kn = tl.load(row[:, None] + d[None, :], mask=t_ok[:, None], other=0.0)  # the latent: key and value
                kr = tl.load(row[:, None] + D + dr[None, :], mask=t_ok[:, None], other=0.0)  # the rotated part
                if DOT_F32:  # Triton's interpreter: the same exact products in fp32
                    s = (tl.dot(qn.to(tl.float32), tl.trans(kn.to(tl.float32)), input_precision="ieee")
                         + tl.dot(qr.to(tl.float32), tl.trans(kr.to(tl.float32)), input_precision="ieee")) * scale
                else:
                    s = (tl.dot(qn, tl.trans(kn)) + tl.dot(qr, tl.trans(kr))) * scale
                s = tl.where(t_ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                if DOT_F32:
                    pv = tl.dot(p.to(kn.dtype).to(tl.float32), kn.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(p.to(kn.dtype), kn)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(o_ptr + r * stride_on + heads[:, None] * stride_oh + sp * stride_os + d[None, :], out,
                 mask=h_ok[:, None])
        tl.store(lse_ptr + r * stride_ln + heads * stride_lh + sp, lse, mask=h_ok)

    return split_kernel, combine_kernel, mla_split_kernel


def part_for(requests: int, kv_heads: int, max_len: int) -> int:
    """Key positions per split: enough splits that requests x KV heads x splits reaches `TARGET_PROGRAMS`, each
    at least one tile (`BLOCK_T`)."""
    splits = max(1, -(-TARGET_PROGRAMS // (requests * kv_heads)))
    per_split = -(-max_len // splits)
    return max(BLOCK_T, -(-per_split // BLOCK_T) * BLOCK_T)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes the kernels take: 16-bit inputs, a power-of-two head dim of 16..256, pages of whole tiles."""
    dim = q.shape[-1]
    return (q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype and dim & (dim - 1) == 0
            and 16 <= dim <= 256 and k_cache.shape[1] % BLOCK_T == 0 and q.shape[-2] % k_cache.shape[2] == 0
            and q.shape[-2] // k_cache.shape[2] <= 64 and q.stride(-1) == k_cache.stride(-1) == 1)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seqlens_k: torch.Tensor, scale: float, slopes: torch.Tensor | None = None) -> torch.Tensor:
    import triton

    n, heads, dim = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    max_len = block_table.shape[1] * page
    part = part_for(n, kv_heads, max_len)
    splits = -(-max_len // part)
    o_part = torch.empty((n, heads, splits, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((n, heads, splits), dtype=torch.float32, device=q.device)
    y = torch.empty_like(q)
    split_kernel, combine_kernel, _ = _kernels()
    alibi = slopes is not None
    slopes = slopes.to(q.device, torch.float32).contiguous() if alibi else lse  # (unread without ALiBi)
    split_kernel[(n, kv_heads, splits)](
        q, k_cache, v_cache, block_table, seqlens_k, o_part, lse, slopes, float(scale), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_table.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse.stride(0), lse.stride(1), PAGE=page, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=dim,
        PART=part, BLOCK_T=BLOCK_T, DOT_F32=os.environ.get("TRITON_INTERPRET") == "1", ALIBI=alibi, num_warps=4)
    combine_kernel[(n, heads)](o_part, lse, y, splits, o_part.stride(0), o_part.stride(1), o_part.stride(2),
                               lse.stride(0), lse.stride(1), y.stride(0), y.stride(1),
                               S_PAD=max(2, triton.next_power_of_2(splits)), D=dim, num_warps=4)
    return y


MLA_HEADS_PER_PROGRAM = 16  # query heads a program attends for (the smallest row count of a tensor-core product)


def mla_supports(q: torch.Tensor, latents: torch.Tensor, rank: int) -> bool:
    """Shapes `mla_decode_attention` takes: 16-bit inputs, a latent of 16..512 and a rotated part of 16..128
    dims (powers of two; DeepSeek: 512 and 64), pages of whole tiles."""
    rope = latents.shape[-1] - rank
    return (q.dtype in (torch.bfloat16, torch.float16) and latents.dtype == q.dtype and q.shape[-1] == latents.shape[-1]
            and rank & (rank - 1) == 0 and 16 <= rank <= 512 and rope & (rope - 1) == 0 and 16 <= rope <= 128
            and latents.shape[1] % BLOCK_T == 0 and q.stride(-1) == latents.stride(-1) == 1)


def mla_decode_attention(q: torch.Tensor, latents: torch.Tensor, block_table: torch.Tensor, seqlens_k: torch.Tensor,
                         scale: float, rank: int) -> torch.Tensor:
    """Multi-latent attention's absorbed decode over megatron-core's paged latent cache, split-KV as
    `decode_attention`: q [n, heads, rank + rope] (the key up-projection absorbed into the latent part), `latents`
    [blocks, block_size, rank + rope] (one shared key head a token; its first `rank` dims are the value), returns
    softmax(q k^T * scale) k[..., :rank] [n, heads, rank] in q's dtype, fp32 accumulation and softmax. Programs
    attend for `MLA_HEADS_PER_PROGRAM` heads each, so the latent tile is read once for them."""
    import triton

    n, heads, _ = q.shape
    page = latents.shape[1]
    blocks_of_heads = -(-heads // MLA_HEADS_PER_PROGRAM)
    max_len = block_table.shape[1] * page
    part = part_for(n, blocks_of_heads, max_len)
    splits = -(-max_len // part)
    o_part = torch.empty((n, heads, splits, rank), dtype=torch.float32, device=q.device)
    lse = torch.empty((n, heads, splits), dtype=torch.float32, device=q.device)
    y = q.new_empty((n, heads, rank))
    _, combine_kernel, mla_split_kernel = _kernels()
    mla_split_kernel[(n, blocks_of_heads, splits)](
        q, latents, block_table, seqlens_k, o_part, lse, float(scale), heads, q.stride(0), q.stride(1),
        latents.stride(0), latents.stride(1), block_table.stride(0), o_part.stride(0), o_part.stride(1),
        o_part.stride(2), lse.stride(0), lse.stride(1), PAGE=page, HB=MLA_HEADS_PER_PROGRAM, D=rank,
        DR=latents.shape[-1] - rank, PART=part, BLOCK_T=BLOCK_T, DOT_F32=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=8)
    combine_kernel[(n, heads)](o_part, lse, y, splits, o_part.stride(0), o_part.stride(1), o_part.stride(2),
                               lse.stride(0), lse.stride(1), y.stride(0), y.stride(1),
                               S_PAD=max(2, triton.next_power_of_2(splits)), D=rank, num_warps=4)
    return y
