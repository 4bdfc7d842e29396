"""StarCoder2 (`Starcoder2ForCausalLM`): LayerNorm with bias (`norm_epsilon`), plain GELU-tanh MLP
(`c_fc` -> `c_proj`, not gated), biases on every linear layer (`use_bias`), GQA, rotary, tied
embeddings by default, optional sliding window (megatron-core `window_size`)."""

from typing import Any

from megatron_patch.models.dense import DenseDecoder, DenseNames


class Starcoder2Family(DenseDecoder):
    name = "starcoder2"
    architectures = ("Starcoder2ForCausalLM",)
    model_type = "starcoder2"
    names = DenseNames(mlp_in="mlp.c_fc", mlp_out="mlp.c_proj")
    norm = "LayerNorm"
    gated_mlp = False
    # Starcoder2Config's defaults for keys a config.json may omit
    defaults = {"use_bias": True, "tie_word_embeddings": True, "norm_epsilon": 1e-5,
                "hidden_act": "gelu_pytorch_tanh", "sliding_window": None}

    def translate(self, config: dict) -> dict:
        return {**config, "rms_norm_eps": config["norm_epsilon"], "attention_bias": config["use_bias"],
                "mlp_bias": config["use_bias"]}

    def sliding_window(self, c: Any) -> int | None:
        return c.get("sliding_window")

    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        out = super().hf_config_from_megatron(config, gpt_kwargs, vocab_size)
        for key in ("attention_bias", "mlp_bias", "head_dim"):
            out.pop(key)
        out["norm_epsilon"] = out.pop("rms_norm_eps")
        out["use_bias"] = config.add_bias_linear
        return {"sliding_window": None, **out}


FAMILY = Starcoder2Family()
