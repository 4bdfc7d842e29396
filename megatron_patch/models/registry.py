"""Registry: HF `architectures` name or family name -> ModelFamily, each family imported on first use.

Outside code adds families with `register("mymodel", "my_pkg.my_family", ("MyForCausalLM",))`:
the module must define `FAMILY`, a `ModelFamily` instance (or name another attribute:
"my_pkg.my_family:OTHER", for a file holding several related families).
"""

from __future__ import annotations

import importlib
import json
import math
import os
from typing import Any

from megatron_patch.models.family import ModelFamily, cfg_get
from megatron_patch.models.reward import causal_lm_architecture, is_reward_architecture, reward_family

# family name -> (module defining FAMILY, HF architectures it serves)
_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "llama": ("megatron_patch.models.families.llama", ("LlamaForCausalLM",)),
    "qwen2": ("megatron_patch.models.families.qwen:QWEN2", ("Qwen2ForCausalLM",)),
    "qwen3": ("megatron_patch.models.families.qwen:QWEN3", ("Qwen3ForCausalLM",)),
    "qwen1": ("megatron_patch.models.families.qwen:QWEN1", ("QWenLMHeadModel",)),
    "yi": ("megatron_patch.models.families.llama:YI", ("YiForCausalLM",)),
    "mistral": ("megatron_patch.models.families.mistral", ("MistralForCausalLM",)),
    "baichuan": ("megatron_patch.models.families.baichuan", ("BaiChuanForCausalLM", "BaichuanForCausalLM")),
    "internlm2": ("megatron_patch.models.families.internlm2", ("InternLM2ForCausalLM",)),
    "starcoder2": ("megatron_patch.models.families.starcoder2", ("Starcoder2ForCausalLM",)),
    "glm": ("megatron_patch.models.families.glm:GLM", ("GlmForCausalLM",)),
    "glm4": ("megatron_patch.models.families.glm:GLM4", ("Glm4ForCausalLM",)),
    "bloom": ("megatron_patch.models.families.bloom", ("BloomForCausalLM",)),
    "falcon": ("megatron_patch.models.families.falcon", ("FalconForCausalLM", "RWForCausalLM")),
    "gpt_bigcode": ("megatron_patch.models.families.gpt_bigcode", ("GPTBigCodeForCausalLM",)),
    "gptj": ("megatron_patch.models.families.gptj", ("GPTJForCausalLM",)),
    "gpt_neox": ("megatron_patch.models.families.gpt_neox", ("GPTNeoXForCausalLM",)),
    "chatglm": ("megatron_patch.models.families.glm:CHATGLM", ("ChatGLMModel", "ChatGLMForConditionalGeneration")),
    "mixtral": ("megatron_patch.models.families.moe:MIXTRAL", ("MixtralForCausalLM",)),
    "qwen2_moe": ("megatron_patch.models.families.moe:QWEN2_MOE", ("Qwen2MoeForCausalLM",)),
    "qwen3_moe": ("megatron_patch.models.families.moe:QWEN3_MOE", ("Qwen3MoeForCausalLM",)),
    "deepseek_v2": ("megatron_patch.models.families.deepseek:DEEPSEEK_V2", ("DeepseekV2ForCausalLM",)),
    "deepseek_v3": ("megatron_patch.models.families.deepseek:DEEPSEEK_V3", ("DeepseekV3ForCausalLM",)),
}
_LOADED: dict[str, ModelFamily] = {}


class UnknownArchitecture(KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


def register(name: str, module: str, architectures: tuple[str, ...]) -> None:
    """Register (or replace) a family implemented in `module` (which defines `FAMILY`)."""
    _FAMILIES[name] = (module, tuple(architectures))
    _LOADED.pop(name, None)


def families() -> dict[str, tuple[str, ...]]:
    """Family name -> the HF architectures it serves."""
    return {name: archs for name, (_, archs) in _FAMILIES.items()}


def _load(name: str) -> ModelFamily:
    if name not in _LOADED:
        module, _, attr = _FAMILIES[name][0].partition(":")
        family = getattr(importlib.import_module(module), attr or "FAMILY")
        if not isinstance(family, ModelFamily):
            raise TypeError(f"{_FAMILIES[name][0]} is not a ModelFamily")
        _LOADED[name] = family
    return _LOADED[name]


def get_family(hf_config_or_name: Any) -> ModelFamily:
    """Resolve a family from an HF config (object, dict, folder or config.json path), an
    architecture name (`LlamaForCausalLM`) or a family name (`llama`)."""
    if isinstance(hf_config_or_name, (str, os.PathLike)):
        key = str(hf_config_or_name)
        if key in _FAMILIES:
            return _load(key)
        if os.path.exists(key):
            return get_family(load_hf_config(key))
        for name, (_, archs) in _FAMILIES.items():
            if key in archs:
                return _load(name)
        if is_reward_architecture(key):
            return reward_family(get_family(causal_lm_architecture(key)))
        raise UnknownArchitecture(f"unsupported architecture or family {key!r}; supported: {_supported()}")
    archs = cfg_get(hf_config_or_name, "architectures") or []
    for arch in archs:
        for name, (_, served) in _FAMILIES.items():
            if arch in served:
                return _load(name)
        if is_reward_architecture(arch):  # a reward model: the causal LM's family with a scalar head
            return get_family(arch)
    raise UnknownArchitecture(
        f"unsupported architecture {archs or '(config has no architectures field)'}; supported: {_supported()}"
    )


def vocab_size(hf_config: dict) -> int:
    """The model's vocabulary as its family reads the HF config: token ids 0 .. vocab_size - 1, without the
    padding megatron adds (`padded_vocab_size`), whose logits are no token's."""
    from megatron_patch.models.family import Layout

    return get_family(hf_config).shapes(hf_config, Layout()).vocab_size


def _supported() -> str:
    return ", ".join(a for _, archs in _FAMILIES.values() for a in archs)


# Size fields of the families' configs: when present and not null, a positive integer.
_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "intermediate_size", "head_dim", "n_embd", "n_layer", "n_head", "num_layers", "ffn_hidden_size",
          "kv_channels", "multi_query_group_num", "max_position_embeddings", "num_local_experts",
          "num_experts_per_tok", "moe_intermediate_size", "n_routed_experts", "kv_lora_rank", "q_lora_rank",
          "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rotary_dim", "n_inner", "n_positions")


def load_hf_config(path: str | os.PathLike) -> dict:
    """Read `config.json` from a folder (or the file itself) as a dict, checked: valid JSON, an object,
    size fields positive integers, every number finite, norm epsilons and rope bases > 0. Errors name
    the file and the field."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json in {path}")
    with open(file, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            where = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
            raise ValueError(f"{file} is not valid JSON{where}: {getattr(e, 'msg', e)}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(cfg).__name__}")
    problem = config_problem(cfg)
    if problem:
        raise ValueError(f"{file}: {problem}")
    return cfg


def config_problem(cfg: dict) -> str | None:
    """What is wrong with an HF config dict's numbers, naming the field; None if nothing."""
    for key in _SIZES:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return f"{key} must be a positive integer, got {json.dumps(value)}"

    def numbers(value: Any, name: str):
        if isinstance(value, dict):
            for k, v in value.items():
                yield from numbers(v, f"{name}.{k}" if name else k)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                yield from numbers(v, f"{name}[{i}]")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield name, value

    for name, value in numbers(cfg, ""):
        if not math.isfinite(value):
            return f"{name} must be a finite number, got {value}"
        leaf = name.rsplit(".", 1)[-1]
        if (leaf.endswith(("eps", "epsilon")) or leaf == "rope_theta") and value <= 0:
            return f"{name} must be > 0, got {value}"
    return None
