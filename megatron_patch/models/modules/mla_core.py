"""Core attention for multi-latent attention in the `local` implementation.

megatron-core's MLA builds its core attention with separate query/key and value head sizes
(`k_channels`, `v_channels`: DeepSeek's q/k heads are nope + rope dims, its v heads another size), which
Transformer Engine's DotProductAttention takes and megatron-core's own (local) DotProductAttention does
not (0.19.2: "unexpected keyword argument 'k_channels'"). This is the local equivalent: causal (or
masked) softmax(q k^T * scale) v in fp32, heads of this TP rank, [sq, b, n, d] in, [sq, b, n * dv] out."""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.module import MegatronModule


class MLACoreAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection=None, **_):
        super().__init__(config=config)
        # (the generic Attention base builds a core attention without head sizes; MLA then rebuilds it)
        self.softmax_scale = softmax_scale
        self.hidden_size_per_attention_head_v = v_channels
        self.dropout = torch.nn.Dropout(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences with multi-latent attention need Transformer Engine")
        sq, b, n, _ = query.shape
        q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))  # [b, n, s, d]
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if attention_mask is None:
            sk = k.shape[2]
            attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
        scores = scores.masked_fill(attention_mask, float("-inf"))
        probs = self.dropout(torch.softmax(scores, dim=-1))
        out = torch.matmul(probs, v).to(value.dtype)  # [b, n, sq, dv]
        return out.permute(2, 0, 1, 3).reshape(sq, b, n * v.shape[-1])


def with_local_mla_core(block_spec, q_lora: bool):
    """A block spec whose MLA layers use MLACoreAttention (local implementation only), and no q norm
    without a q LoRA rank (megatron-core refuses a norm it would not use)."""
    from megatron.core.transformer.identity_op import IdentityOp

    for layer in block_spec.layer_specs:
        attn = layer.submodules.self_attention
        if hasattr(attn.submodules, "linear_kv_down_proj"):
            attn.submodules.core_attention = MLACoreAttention
            if not q_lora:
                attn.submodules.q_layernorm = IdentityOp
    return block_spec
