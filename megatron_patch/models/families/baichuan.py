"""Baichuan-7B (`BaiChuanForCausalLM`), Baichuan2-7B, Baichuan-13B and Baichuan2-13B
(`BaichuanForCausalLM`), remote code, on the LLaMA math (MHA, SwiGLU, RMSNorm, no biases, untied);
the 7B models use rotary embeddings (base 10000), the 13B models ALiBi (`modules/alibi.py`).

Accepted checkpoint names: LLaMA's, except the fused `model.layers.N.self_attn.W_pack` = [q; k; v].
Accepted config keys: LLaMA's (`hidden_size`, `intermediate_size`, `num_attention_heads`,
`num_hidden_layers`, `rms_norm_eps`, `vocab_size`, `max_position_embeddings`, `tie_word_embeddings`).

Baichuan2's NormHead (`lm_head` rows L2-normalised in every forward) is `modules/norm_head.py`: the
stored weight is converted as is (bitwise both ways) and normalised at run time, as the original
does. It is on for Baichuan2: `vocab_size` 125696 or a `z_loss_weight` key (both only in Baichuan2
configs), or an explicit `"norm_head": true/false`.

`BaichuanForCausalLM` names both the 7B (rotary) and 13B (ALiBi) models: the 13B configs carry no
`max_position_embeddings` (their modeling files read `model_max_length`), which is how they are told
apart; `"position_embedding": "rope" | "alibi"` in config.json overrides that rule.
"""

from typing import Any

from megatron_patch.models.dense import DenseDecoder, DenseNames
from megatron_patch.models.family import UnsupportedConfig

_BAICHUAN2_VOCAB = 125696


class BaichuanFamily(DenseDecoder):
    name = "baichuan"
    architectures = ("BaiChuanForCausalLM", "BaichuanForCausalLM")
    model_type = "baichuan"
    remote_code = True
    names = DenseNames(qkv="self_attn.W_pack")

    def translate(self, config: dict) -> dict:
        alibi = "max_position_embeddings" not in config
        position = config.get("position_embedding", "alibi" if alibi else "rope")
        if position not in ("rope", "alibi"):
            raise UnsupportedConfig(f"Baichuan position_embedding={position!r}: expected 'rope' or 'alibi'")
        return {**config, "num_key_value_heads": config["num_attention_heads"], "rope_theta": 10000.0,
                "rope_scaling": None, "position_embedding": position,
                "max_position_embeddings": config.get("max_position_embeddings") or config.get("model_max_length")}

    def positions(self, c: Any) -> str:
        return c["position_embedding"]

    def linear_bias(self, c: Any) -> bool:
        return False

    def norm_head(self, c: Any) -> bool:
        if "norm_head" in c:
            return bool(c["norm_head"])
        return int(c["vocab_size"]) == _BAICHUAN2_VOCAB or "z_loss_weight" in c


FAMILY = BaichuanFamily()
