"""megatron-core's paged attention in torch: `flash_decode_and_prefill`, the method of the same name of
`megatron.core.transformer.attention.Attention` (the dynamic inference engine's attention over its paged KV
cache, which megatron-core runs with flash-attn's GPU-only kernels), written with torch operations. The
`paged_attention_in_torch` patch (`megatron_patch/patches.py`) puts it in place where no flash-attn kernel runs:
every CPU, a GPU without flash-attn, fp32 models."""

from __future__ import annotations

import torch


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_len: torch.Tensor,
           scale: float, window: tuple[int, int] | None, sink: torch.Tensor | None,
           slopes: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of queries [n, s, h, d] at positions `q_pos` [n, s] over keys [n, L, hk, d] and values [n, L,
    hk, dv] (dv may differ from d: multi-latent attention) of which the first `kv_len` [n] are real: key j is seen
    by a query at position i when j <= i, j < kv_len and, with a sliding `window` (left, right), j >= i - left.
    Grouped queries: head g * (h / hk) + r reads KV head g (megatron-core's layout), without copying K and V per
    head. softmax(q k^T * scale) v with the softmax in fp32 (products in the inputs' dtype, as flash-attn); a
    per-head `sink` logit [h] joins each softmax's denominator (megatron-core's off-by-one / learnable softmax).
    ALiBi `slopes` [h] (fp32) add slope_h * (j - i) to the scaled score of query i on key j
    (`models/modules/alibi.py`). Keys past `kv_len` may be any bits (unwritten cache): they are masked and their
    values zeroed. A query that sees nothing gets 0."""
    n, s, h, d = q.shape
    hk = k.shape[2]
    k_pos = torch.arange(k.shape[1], device=q.device)
    real = k_pos[None, :] < kv_len[:, None]  # [n, L]
    seen = (k_pos[None, None, :] <= q_pos[:, :, None]) & real[:, None, :]  # [n, s, L]
    if window is not None and window[0] >= 0:
        seen &= k_pos[None, None, :] >= q_pos[:, :, None] - window[0]
    groups = q.reshape(n, s, hk, h // hk, d)
    scores = torch.einsum("nskgd,nlkd->nkgsl", groups, k).float() * scale
    if slopes is not None:
        distance = (k_pos[None, None, :] - q_pos[:, :, None]).float()  # [n, s, L]
        scores = scores + slopes.to(q.device, torch.float32).view(hk, h // hk)[None, :, :, None, None] * \
            distance[:, None, None]
    scores = scores.masked_fill(~seen[:, None, None], float("-inf"))
    if sink is not None:
        logits = sink.float().view(hk, h // hk)[None, :, :, None, None].expand(n, hk, h // hk, s, 1)
        scores = torch.cat([scores, logits], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sink is not None:
        probs = probs[..., :-1]
    probs = torch.nan_to_num(probs, nan=0.0).to(v.dtype)  # (rows that see no key: padding)
    values = v.masked_fill(~real[:, :, None, None], 0.0)
    return torch.einsum("nkgsl,nlkd->nskgd", probs, values).reshape(n, s, h, v.shape[-1])


def flash_decode_and_prefill(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                             block_table, is_decode_only, softmax_offset=None):
    """`Attention.flash_decode_and_prefill` of megatron-core 0.18.2 / 0.19 (same arguments and result; 0.18.2
    passes no `softmax_offset`) in torch:
    queries q [tokens, 1, heads, dim] of the active requests, laid out request after request
    (`cu_seqlens_q`), over the paged KV cache k / v [blocks, block_size, kv heads, dim] through
    `block_table` [requests, blocks per request]; `seqlens_k` [requests]: each request's cached length,
    its new tokens included (they are its last `query length` positions). Decode-only steps (one query
    per request, or several with speculative tokens) run as one batched gather with fixed shapes (no
    host synchronisation: CUDA-graph capturable); other steps attend request by request."""
    from megatron.core.transformer.utils import is_layer_window_attention

    from megatron_patch.models.modules.alibi import layer_slopes

    slopes = layer_slopes(self.core_attention)
    window = (self.config.window_size if is_layer_window_attention(
        self.config.window_size, self.config.window_attn_skip_freq, self.layer_number) else None)
    scale = getattr(self, "softmax_scale", None) or q.shape[-1] ** -0.5
    if is_decode_only:
        n = seqlens_k.shape[0]
        s = q.shape[0] // n
        keys, values = k[block_table].flatten(1, 2), v[block_table].flatten(1, 2)  # [n, blocks * size, hk, d]
        q_pos = seqlens_k[:, None] - s + torch.arange(s, device=q.device)[None, :]
        out = attend(q.reshape(n, s, *q.shape[2:]), keys, values, q_pos, seqlens_k, scale, window, softmax_offset,
                     slopes)
        return out.reshape(n * s, 1, *out.shape[2:])
    block_size = k.shape[1]

    def keys_values(r: int, kv_len: int):
        blocks = block_table[r, : -(-kv_len // block_size)]
        return k[blocks].flatten(0, 1)[None, :kv_len], v[blocks].flatten(0, 1)[None, :kv_len]

    return prefill_by_request(q, cu_seqlens_q, seqlens_k, v.shape[-1], keys_values, scale, window, softmax_offset,
                              slopes)


def prefill_by_request(q, cu_seqlens_q, seqlens_k, dv: int, keys_values, scale: float, window, sink, slopes=None):
    """A prefill / mixed step's attention request by request: queries q [tokens, 1, h, d] laid out request after
    request (`cu_seqlens_q`), each request's new tokens the last positions of its `seqlens_k`; `keys_values(r,
    kv_len)` gives request r's keys and values [1, kv_len, hk, d | dv]. Returns [tokens, 1, h, dv] (padding
    tokens past the last request 0)."""
    q = q.squeeze(1)
    out = q.new_zeros(*q.shape[:-1], dv)
    starts, lengths = cu_seqlens_q.tolist(), seqlens_k.tolist()
    for r, kv_len in enumerate(lengths):
        first, last = starts[r], starts[r + 1]
        if last == first:
            continue
        keys, values = keys_values(r, kv_len)
        q_pos = (kv_len - (last - first) + torch.arange(last - first, device=q.device))[None]
        out[first:last] = attend(q[None, first:last], keys, values, q_pos, seqlens_k[r: r + 1], scale, window, sink,
                                 slopes)[0]
    return out.unsqueeze(1)


def mla_decode(self, q, latents, block_table, seqlens_k, softmax_offset=None):
    """Multi-latent attention's decode-only step over the paged latent cache, in torch (megatron-core's
    cached-latent path, `cache_mla_latents`; the `mla_latent_cache` patch calls this): `latents` [blocks,
    block_size, kv_lora_rank + qk_pos_emb_head_dim] hold one row a token (its normed KV latent and its rotated key
    part); the queries [tokens, 1, h, kv_lora_rank + qk_pos_emb_head_dim] have the key up-projection absorbed.
    One shared key head, the latent part of each row its value: returns [tokens, 1, h, kv_lora_rank], which the
    layer up-projects to the values."""
    n = seqlens_k.shape[0]
    s = q.shape[0] // n
    rows = latents[block_table].flatten(1, 2)[:, :, None]  # [n, blocks * size, 1, rank + rope]
    q_pos = seqlens_k[:, None] - s + torch.arange(s, device=q.device)[None, :]
    out = attend(q.reshape(n, s, *q.shape[2:]), rows, rows[..., : self.config.kv_lora_rank], q_pos, seqlens_k,
                 self.softmax_scale, None, softmax_offset)
    return out.reshape(n * s, 1, *out.shape[2:])


def mla_prefill(self, q, latents, cu_seqlens_q, seqlens_k, block_table, uncompress, softmax_offset=None):
    """Multi-latent attention's prefill / mixed step over the paged latent cache, in torch, request by request:
    each request's latents (its blocks only) up-projected to keys and values by `uncompress(self, latents)`
    (megatron-core's `uncompress_kv_from_cache`, which as shipped up-projects the layer's whole cache every such
    step), and its queries [tokens, 1, h, qk_head_dim + qk_pos_emb_head_dim] attending over them causally.
    Returns [tokens, 1, h, v_head_dim] (padding tokens past the last request 0)."""
    page = latents.shape[1]

    def keys_values(r: int, kv_len: int):  # [1, kv_len, h, qk + rope], [1, kv_len, h, v]
        return uncompress(self, latents[block_table[r, : -(-kv_len // page)]].flatten(0, 1)[None, :kv_len])

    return prefill_by_request(q, cu_seqlens_q, seqlens_k, self.config.v_head_dim, keys_values, self.softmax_scale,
                              None, softmax_offset)
