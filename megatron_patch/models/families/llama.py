"""LLaMA family: HF `LlamaForCausalLM` (LLaMA-1/2/3/3.1/3.2, CodeLLaMA, Yi as re-released, InternLM-1 and
other "llamafied" checkpoints, any LLaMA-layout model) -> megatron-core `GPTModel`, on the shared dense
decoder (`dense.py`).

Pre-norm decoder with RMSNorm, rotary embeddings (rotate-half), gated MLP (SwiGLU; GeGLU with
`hidden_act: gelu`), MHA/GQA/MQA, optional tied embeddings. Biases as transformers has them:
`attention_bias` on q/k/v/o, `mlp_bias` on gate/up/down, each on its own (megatron-core ties the
attention output's bias to the MLP's; `modules/attn_bias.py` unties them). `rope_scaling` of type
`llama3` (Llama-3.1/3.2; any `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`:
`modules/rope_scaling.py` where they are not megatron-core's 1 / 4 / 8192), `linear` (CodeLLaMA-style
interpolation) and `dynamic` (plain rope up to `max_position_embeddings`) are supported; anything else
raises `UnsupportedConfig`.
"""

from typing import Any

from megatron_patch.models.dense import DenseDecoder, DenseNames


class LlamaFamily(DenseDecoder):
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_type = "llama"

    def qkv_bias(self, c: Any) -> bool:
        return bool(c.get("attention_bias", False))

    def attn_out_bias(self, c: Any) -> bool:
        return bool(c.get("attention_bias", False))

    def linear_bias(self, c: Any) -> bool:
        return bool(c.get("mlp_bias", False))


class YiFamily(LlamaFamily):
    """Yi as first released (`YiForCausalLM`, remote code): the LLaMA model and config with the two
    block norms named `ln1` / `ln2` (re-released checkpoints use `LlamaForCausalLM` names)."""

    name = "yi"
    architectures = ("YiForCausalLM",)
    model_type = "Yi"
    remote_code = True
    names = DenseNames(input_norm="ln1", pre_mlp_norm="ln2")


FAMILY = LlamaFamily()
YI = YiFamily()
