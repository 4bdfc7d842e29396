"""InternLM2 / InternLM2.5 (`InternLM2ForCausalLM`, remote code) on the LLaMA math (GQA, SwiGLU,
RMSNorm, rotary).

Accepted checkpoint names: `model.tok_embeddings`, `model.layers.N.{attention_norm, attention.wqkv,
attention.wo, ffn_norm, feed_forward.w1 (gate), feed_forward.w3 (up), feed_forward.w2 (down)}`,
`model.norm`, `output`. `wqkv` is already laid out as megatron-core's `linear_qkv`: per kv head,
[its q heads, k, v] (the remote code reshapes it to (kv_heads, groups + 2, head_dim)), so it is
split over TP by whole groups and otherwise copied. Accepted config keys: LLaMA's, plus `bias`
(biases on wqkv and wo only; every release has false, and megatron-core cannot bias the attention
output without the MLP, so true is refused). `rope_scaling` `dynamic` (InternLM2-chat) is plain rope
up to `max_position_embeddings`.
"""

from typing import Any

from megatron_patch.models.dense import DenseDecoder, DenseNames
from megatron_patch.models.family import UnsupportedConfig


class InternLM2Family(DenseDecoder):
    name = "internlm2"
    architectures = ("InternLM2ForCausalLM",)
    model_type = "internlm2"
    remote_code = True
    names = DenseNames(
        embed="model.tok_embeddings", input_norm="attention_norm", qkv="attention.wqkv", qkv_grouped=True,
        attn_out="attention.wo", pre_mlp_norm="ffn_norm", mlp_in=("feed_forward.w1", "feed_forward.w3"),
        mlp_out="feed_forward.w2", lm_head="output", layer_drops=("attention.rotary_emb.inv_freq",),
    )

    def linear_bias(self, c: Any) -> bool:
        if c.get("bias", False):
            raise UnsupportedConfig("InternLM2 bias=true (wqkv and wo biased, MLP not): megatron-core "
                                    "switches attention-output and MLP biases together")
        return False


FAMILY = InternLM2Family()
