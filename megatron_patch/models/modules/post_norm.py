"""Post-sublayer norms (GLM-4-0414's `post_self_attn_layernorm` / `post_mlp_layernorm`): the attention
output and the MLP output are each normalised before they join the residual stream.

megatron-core's `TransformerLayer` has pre-norms only, so the norm is added to the sublayers: the
spec's `SelfAttention` / `MLP` modules are swapped for subclasses that build a `post_layernorm` (the
implementation's norm: torch/Apex for `local`, TE for `transformer_engine`) and apply it to their
output. Parameters: `decoder.layers.N.self_attention.post_layernorm.weight` and
`decoder.layers.N.mlp.post_layernorm.weight`. Works under TP (the norm sees the all-reduced output)
and PP (nothing crosses stages).
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_patch.models.modules import norm_class, replace_mlp


@dataclasses.dataclass
class PostNormSelfAttentionSubmodules(SelfAttentionSubmodules):
    post_layernorm: object = None


@dataclasses.dataclass
class PostNormMLPSubmodules(MLPSubmodules):
    post_layernorm: object = None


class _PostNorm:
    def _build_post_norm(self, submodules) -> None:
        self.post_layernorm = build_module(submodules.post_layernorm, config=self.config,
                                           hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)

    def _post_norm(self, out):
        output, bias = out[0], out[1]
        if bias is not None:
            output = output + bias
        return (self.post_layernorm(output), None, *out[2:])


class PostNormSelfAttention(_PostNorm, SelfAttention):
    def __init__(self, config, submodules: PostNormSelfAttentionSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self._build_post_norm(submodules)

    def forward(self, *args, **kwargs):
        return self._post_norm(super().forward(*args, **kwargs))


class PostNormMLP(_PostNorm, MLP):
    def __init__(self, config, submodules: PostNormMLPSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self._build_post_norm(submodules)

    def forward(self, *args, **kwargs):
        return self._post_norm(super().forward(*args, **kwargs))


def _with_norm(submodules, cls, norm):
    fields = {f.name: getattr(submodules, f.name) for f in dataclasses.fields(submodules)}
    return cls(**fields, post_layernorm=norm)


def with_post_norms(layer_spec: ModuleSpec, impl: str) -> ModuleSpec:
    """A copy of a GPT layer spec whose attention and MLP normalise their outputs."""
    sub = layer_spec.submodules
    norm = norm_class(impl)
    attn = dataclasses.replace(
        sub.self_attention, module=PostNormSelfAttention,
        submodules=_with_norm(sub.self_attention.submodules, PostNormSelfAttentionSubmodules, norm))
    mlp = replace_mlp(sub.mlp, module=PostNormMLP,
                      submodules=lambda m: _with_norm(m, PostNormMLPSubmodules, norm))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(sub, self_attention=attn, mlp=mlp))
