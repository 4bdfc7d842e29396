"""Attention projections biased independently of the MLP.

megatron-core derives the attention biases from two switches: `linear_qkv` has a bias when
`add_bias_linear or add_qkv_bias`, `linear_proj` when `add_bias_linear` — the switch that also biases the
MLP. Checkpoints bias them otherwise: LLaMA `attention_bias: true` with `mlp_bias: false` (InternLM-1,
"llamafied" checkpoints: q/k/v/o biased, MLP not), GPT-J (MLP biased, attention not), GPT-NeoX with
`attention_bias: false`. `with_attention_biases` swaps the spec's `linear_qkv` / `linear_proj` class for a
subclass built with the bias the family states; everything else (TP split, TE fusion, bias-dropout-add of
a returned bias) is megatron-core's own, so parameter names stay megatron-core's (`linear_proj.bias`).
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.transformer.spec_utils import ModuleSpec


@functools.cache
def with_bias(cls: type, bias: bool) -> type:
    """`cls` (a megatron-core / TE linear layer) always built with `bias`, whatever the config says."""

    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **{**kwargs, "bias": bias})

    name = f"{cls.__name__}{'WithBias' if bias else 'NoBias'}"
    return type(name, (cls,), {"__init__": __init__, "__module__": __name__, "__qualname__": name})


def _forced(entry, bias: bool):
    if isinstance(entry, ModuleSpec):
        return dataclasses.replace(entry, module=with_bias(entry.module, bias))
    return with_bias(entry, bias)


def with_attention_biases(layer_spec: ModuleSpec, qkv: bool | None = None, proj: bool | None = None) -> ModuleSpec:
    """A copy of a GPT layer spec whose `linear_qkv` / `linear_proj` have a bias iff `qkv` / `proj`
    (None: megatron-core's rule)."""
    sub = layer_spec.submodules
    attn = sub.self_attention
    changes = {}
    if qkv is not None:
        changes["linear_qkv"] = _forced(attn.submodules.linear_qkv, qkv)
    if proj is not None:
        changes["linear_proj"] = _forced(attn.submodules.linear_proj, proj)
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, **changes))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(sub, self_attention=attn))
