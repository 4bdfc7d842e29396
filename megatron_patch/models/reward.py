"""Reward models: any family's decoder with a scalar head instead of the LM head, the layout of HF's
`<Family>ForSequenceClassification` with `num_labels=1` (backbone names unchanged, head `score.weight`
[1, hidden], no bias, never tied to the embedding). The value of a sequence is the head's output at its
last non-pad token, as HF computes it (`score_positions`), in training and after export alike.

`reward_family(base)` wraps a registered family: the registry returns it for a `...ForSequenceClassification`
architecture, so building, conversion (every layout) and export work unchanged; the head is megatron's
`output_layer.weight`, replicated on every TP rank."""

from __future__ import annotations

from typing import Any

import torch

from megatron_patch.models.family import ModelFamily, cfg_get
from megatron_patch.models.mappings import Drop, Replicated, VocabParallel

SUFFIX = "ForSequenceClassification"
SCORE = "score.weight"


def is_reward_architecture(arch: str) -> bool:
    return arch.endswith(SUFFIX)


def causal_lm_architecture(arch: str) -> str:
    return arch[: -len(SUFFIX)] + "ForCausalLM"


def as_reward_config(hf_config: dict) -> dict:
    """An HF causal-LM config.json -> the same model as a one-label sequence classifier."""
    out = dict(hf_config)
    out["architectures"] = [a[: -len("ForCausalLM")] + SUFFIX if a.endswith("ForCausalLM") else a
                            for a in hf_config.get("architectures", [])]
    if not all(is_reward_architecture(a) for a in out["architectures"]):
        raise ValueError(f"no {SUFFIX} class for {hf_config.get('architectures')}")
    out["num_labels"] = 1
    out.pop("id2label", None), out.pop("label2id", None)
    out["tie_word_embeddings"] = False
    if out.get("pad_token_id") is None:  # HF finds the last real token through pad_token_id
        eos = out.get("eos_token_id")
        out["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    return out


class ScalarHead(torch.nn.Module):
    """megatron's output layer slot -> one value per position ([s, b, 1]); replicated over TP. It carries
    the config's `pad_token_id`, which decides the scored token (`score_positions`), for the loss to read."""

    def __init__(self, hidden_size: int, config, pad_token_id: int | None = None):
        super().__init__()
        self.pad_token_id = pad_token_id
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=config.params_dtype))
        config.init_method(self.weight)
        self.sequence_parallel = config.sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # every TP rank then holds the whole sequence and computes the same values and head gradient
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight.to(hidden.dtype)), None


def score_positions(tokens: torch.Tensor, lengths: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """[b] index of the token each sequence is scored at, chosen as HF's `ForSequenceClassification`
    chooses it: the last of the first `lengths` tokens that is not the config's `pad_token_id`. So an
    exported model scores what training scored, also when the end-of-document token doubles as the pad
    token (Llama-3, Qwen2.5: `pad_token_id` = `eos_token_id` = the tokenizer's eod), where both read the
    token before it. A sequence of pad tokens only is scored at 0, as HF does."""
    index = torch.arange(tokens.shape[1], device=tokens.device)
    real = index[None, :] < lengths.to(tokens.device)[:, None]
    if pad_token_id is not None:
        real = real & (tokens != pad_token_id)
    return (index * real).argmax(-1)


def scored_values(values: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                  pad_token_id: int | None) -> torch.Tensor:
    """[b, s, 1] per-position values -> [b]: each sequence's value at its `score_positions` token."""
    positions = score_positions(tokens, lengths, pad_token_id).to(values.device)
    return values[torch.arange(values.shape[0], device=values.device), positions, 0]



class RewardFamily(ModelFamily):
    """A family's decoder with the scalar head; everything else delegated to the base family."""

    def __init__(self, base: ModelFamily):
        self.base = base
        self.name = base.name + "_reward"
        self.architectures = tuple(a[: -len("ForCausalLM")] + SUFFIX for a in base.architectures
                                   if a.endswith("ForCausalLM"))

    def __getattr__(self, item):  # config_kwargs, shapes, layer_spec, ... of the base family
        return getattr(self.base, item)

    def config_kwargs(self, hf_config: Any) -> dict:
        return self.base.config_kwargs(hf_config)

    def gpt_kwargs(self, hf_config: Any) -> dict:
        return {**self.base.gpt_kwargs(hf_config), "share_embeddings_and_output_weights": False}

    def shapes(self, hf_config, layout):
        return self.base.shapes(hf_config, layout)

    def layer_spec(self, hf_config: Any, impl):
        return self.base.layer_spec(hf_config, impl)

    def decoder_spec(self, hf_config: Any, config, vp_stage: int | None = None):
        return self.base.decoder_spec(hf_config, config, vp_stage)

    def config_class(self):
        return self.base.config_class()

    def max_sequence_length(self, hf_config: Any) -> int:
        return self.base.max_sequence_length(hf_config)

    def tied_embeddings(self, hf_config: Any) -> bool:
        return False

    def weight_map(self, hf_config: Any):
        out = []
        for m in self.base.weight_map(hf_config):
            head = isinstance(m, VocabParallel) and m.megatron.startswith("output_layer.")  # weight (and bias: GPT-J)
            tied_drop = isinstance(m, Drop) and "{layer}" not in m.hf and m.hf.endswith("lm_head.weight")
            if not (head or tied_drop):
                out.append(m)
        out.append(Replicated(SCORE, "output_layer.weight"))
        return out

    def finalize(self, model, hf_config: Any) -> None:
        self.base.finalize(model, hf_config)
        if model.post_process:
            model.output_layer = ScalarHead(model.config.hidden_size, model.config, cfg_get(hf_config, "pad_token_id"))
            if not model.config.use_cpu_initialization and torch.cuda.is_available():
                model.output_layer.cuda(torch.cuda.current_device())

    def hf_config_from_megatron(self, config: Any, gpt_kwargs: dict, vocab_size: int) -> dict:
        return as_reward_config(self.base.hf_config_from_megatron(config, gpt_kwargs, vocab_size))


_WRAPPED: dict[str, RewardFamily] = {}


def reward_family(base: ModelFamily) -> RewardFamily:
    if base.name not in _WRAPPED:
        _WRAPPED[base.name] = RewardFamily(base)
    return _WRAPPED[base.name]


def is_reward_config(hf_config: Any) -> bool:
    return any(is_reward_architecture(a) for a in (cfg_get(hf_config, "architectures") or []))

