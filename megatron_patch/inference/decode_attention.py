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

import torch

from megatron_patch.runtime import kernels

BLOCK_T = 64  # key positions per tile
TARGET_PROGRAMS = 264  # ~2 per SM of an H100 / H200


@functools.cache
def _kernels():
    from megatron_patch.inference import decode_attention_kernels as k

    return k.split_kernel, k.combine_kernel, k.mla_split_kernel


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
    split_kernel = _kernels()[0]
    alibi = slopes is not None
    slopes = slopes.to(q.device, torch.float32).contiguous() if alibi else lse  # (unread without ALiBi)
    split_kernel[(n, kv_heads, splits)](
        q, k_cache, v_cache, block_table, seqlens_k, o_part, lse, slopes, float(scale), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), block_table.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse.stride(0), lse.stride(1), PAGE=page, GROUP=group, G_PAD=max(16, triton.next_power_of_2(group)), D=dim,
        PART=part, BLOCK_T=BLOCK_T, DOT_F32=kernels.interpreted(), ALIBI=alibi, num_warps=4)
    return _combine(o_part, lse, y)


MLA_HEADS_PER_PROGRAM = 16  # query heads a program attends for (the smallest row count of a tensor-core product)


def mla_kernel_takes(dtype: torch.dtype, rank: int, rope: int) -> bool:
    """Whether `mla_decode_attention` takes a model's widths: 16-bit, a latent of 16..512 and a rotated part of
    16..128 dims (powers of two; DeepSeek: 512 and 64)."""
    return (dtype in (torch.bfloat16, torch.float16) and rank & (rank - 1) == 0 and 16 <= rank <= 512
            and rope & (rope - 1) == 0 and 16 <= rope <= 128)


def mla_supports(q: torch.Tensor, latents: torch.Tensor, rank: int) -> bool:
    """Tensors `mla_decode_attention` takes: the widths of `mla_kernel_takes`, one dtype, pages of whole tiles,
    contiguous last dims."""
    return (mla_kernel_takes(q.dtype, rank, latents.shape[-1] - rank) and latents.dtype == q.dtype
            and q.shape[-1] == latents.shape[-1] and latents.shape[1] % BLOCK_T == 0
            and q.stride(-1) == latents.stride(-1) == 1)


def mla_decode_attention(q: torch.Tensor, latents: torch.Tensor, block_table: torch.Tensor, seqlens_k: torch.Tensor,
                         scale: float, rank: int) -> torch.Tensor:
    """Multi-latent attention's absorbed decode over megatron-core's paged latent cache, split-KV as
    `decode_attention`: q [n, heads, rank + rope] (the key up-projection absorbed into the latent part), `latents`
    [blocks, block_size, rank + rope] (one shared key head a token; its first `rank` dims are the value), returns
    softmax(q k^T * scale) k[..., :rank] [n, heads, rank] in q's dtype, fp32 accumulation and softmax. Programs
    attend for `MLA_HEADS_PER_PROGRAM` heads each, so the latent tile is read once for them."""
    n, heads, _ = q.shape
    page = latents.shape[1]
    blocks_of_heads = -(-heads // MLA_HEADS_PER_PROGRAM)
    max_len = block_table.shape[1] * page
    part = part_for(n, blocks_of_heads, max_len)
    splits = -(-max_len // part)
    o_part = torch.empty((n, heads, splits, rank), dtype=torch.float32, device=q.device)
    lse = torch.empty((n, heads, splits), dtype=torch.float32, device=q.device)
    y = q.new_empty((n, heads, rank))
    mla_split_kernel = _kernels()[2]
    mla_split_kernel[(n, blocks_of_heads, splits)](
        q, latents, block_table, seqlens_k, o_part, lse, float(scale), heads, q.stride(0), q.stride(1),
        latents.stride(0), latents.stride(1), block_table.stride(0), o_part.stride(0), o_part.stride(1),
        o_part.stride(2), lse.stride(0), lse.stride(1), PAGE=page, HB=MLA_HEADS_PER_PROGRAM, D=rank,
        DR=latents.shape[-1] - rank, PART=part, BLOCK_T=BLOCK_T, DOT_F32=kernels.interpreted(),
        num_warps=8)
    return _combine(o_part, lse, y)


def _combine(o_part: torch.Tensor, lse: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The splits' partial outputs o_part [n, heads, splits, dim] weighted by their log-sum-exps lse [n, heads,
    splits] into y [n, heads, dim] (the second kernel of both decode attentions)."""
    import triton

    n, heads, splits, dim = o_part.shape
    _kernels()[1][(n, heads)](o_part, lse, y, splits, o_part.stride(0), o_part.stride(1), o_part.stride(2),
                              lse.stride(0), lse.stride(1), y.stride(0), y.stride(1),
                              S_PAD=max(2, triton.next_power_of_2(splits)), D=dim, num_warps=4)
    return y
