"""Parallel attention + MLP blocks (Falcon, GPT-J style): both sublayers read the layer input and their
outputs are summed into the residual, `out = x + attn(ln_attn(x)) + mlp(ln_mlp(x))`.

megatron-core's `TransformerLayer` is sequential (the MLP reads `x + attn(...)`), so the spec's layer
class is swapped for `ParallelAttentionMLPLayer`, which runs megatron-core's own attention path
(`_forward_attention`: norm, attention, bias-dropout-add onto `x`) and then adds the MLP of the *layer
input* (`_forward_pre_mlp_layernorm(x)`, the MLP, megatron-core's `_forward_post_mlp` bias-dropout-add).
Everything else (TP, sequence parallelism, recompute, inference) is megatron-core's.

Two norms (Falcon-40B/180B `new_decoder_architecture`: `ln_attn`, `ln_mlp`) are megatron-core's
`input_layernorm` and `pre_mlp_layernorm` (TE: fused into `linear_qkv` / `linear_fc1`, as usual). One
shared norm (Falcon-7B) is `input_layernorm` (TE: `linear_qkv.layer_norm_*`) applied again for the MLP
by `SharedNormParallelLayer`, whose MLP input projection is a plain column-parallel linear; there is no
`pre_mlp_layernorm` parameter, so the norm stays one tensor in training too.
"""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_patch.models.modules import replace_mlp


class ParallelAttentionMLPLayer(TransformerLayer):
    def _mlp_input(self, x):
        return self._forward_pre_mlp_layernorm(x)

    def forward(self, *args, **kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        hidden_states, context = self._forward_attention(*args, **kwargs)  # x + attn(ln(x))
        mlp_out = self.mlp(self._mlp_input(x))
        return self._forward_post_mlp(mlp_out, hidden_states), context  # + mlp(ln(x))


class SharedNormParallelLayer(ParallelAttentionMLPLayer):
    def _mlp_input(self, x):
        if not isinstance(self.input_layernorm, IdentityOp):
            return self.input_layernorm(x)
        qkv = self.self_attention.linear_qkv  # TE: the norm lives in the fused LayerNorm-linear
        return F.layer_norm(x, (x.shape[-1],), qkv.layer_norm_weight, qkv.layer_norm_bias,
                            self.config.layernorm_epsilon)


def with_parallel_attention(layer_spec: ModuleSpec, impl: str, shared_norm: bool) -> ModuleSpec:
    """A copy of a GPT layer spec whose attention and MLP run side by side on the layer input."""
    if not shared_norm:
        return dataclasses.replace(layer_spec, module=ParallelAttentionMLPLayer)
    sub = dataclasses.replace(layer_spec.submodules, pre_mlp_layernorm=IdentityOp)
    if impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

        sub = dataclasses.replace(sub, mlp=replace_mlp(sub.mlp, submodules=lambda m: dataclasses.replace(
            m, linear_fc1=TEColumnParallelLinear)))
    return dataclasses.replace(layer_spec, module=SharedNormParallelLayer, submodules=sub)
