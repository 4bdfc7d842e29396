"""LLaMA family: HF `LlamaForCausalLM` (LLaMA-1/2/3/3.1/3.2, CodeLLaMA, Yi as re-released, and any
LLaMA-layout model) -> megatron-core `GPTModel`, on the shared dense decoder (`dense.py`).

Pre-norm decoder with RMSNorm, rotary embeddings (rotate-half), gated MLP (SwiGLU; GeGLU with
`hidden_act: gelu`), MHA/GQA/MQA, optional tied embeddings and biases (`attention_bias` and `mlp_bias`
together). `rope_scaling` of type `llama3` (Llama-3.1/3.2), `linear` (CodeLLaMA-style interpolation) and
`dynamic` (plain rope up to `max_position_embeddings`) are supported; anything else raises
`UnsupportedConfig`.
"""

from megatron_patch.models.dense import DenseDecoder, DenseNames


class LlamaFamily(DenseDecoder):
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_type = "llama"


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
