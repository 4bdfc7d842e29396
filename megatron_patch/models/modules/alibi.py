"""ALiBi attention (Bloom, Baichuan-13B, Falcon with `alibi`): no position embedding; each head adds
`slope_h * (j - i)` to the score of query i on key j (Press et al.; the same softmax as Bloom's
`slope_h * j`, which differs by a constant per query row).

Heads are split over tensor parallelism, so each rank builds the slopes of the heads it holds
(`rank_slopes`). Two core-attention classes swap into the layer spec:
- `local`: `AlibiDotProductAttention` wraps megatron-core's scale-mask-softmax so the bias is added to
  the scaled scores before masking (fused or torch softmax alike, prefill and decode);
- `transformer_engine`: `AlibiTEDotProductAttention` hands TE the slopes (`core_attention_bias_type=
  "alibi"`, `alibi_slopes`), whose bias is `-slope * |i - j|` (= `slope * (j - i)` under the causal mask).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Per-head slopes (fp32), as Bloom / Baichuan / the ALiBi paper define them: a geometric sequence
    for the closest power of two, then every other slope of the next power's sequence."""
    closest = 2 ** math.floor(math.log2(num_heads))

    def geometric(n: int) -> torch.Tensor:
        base = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return torch.tensor([base ** (i + 1) for i in range(n)], dtype=torch.float64)

    slopes = geometric(closest)
    if closest != num_heads:
        slopes = torch.cat([slopes, geometric(2 * closest)[0::2][: num_heads - closest]])
    return slopes.float()


def rank_slopes(num_heads: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    per_rank = num_heads // tp_size
    return alibi_slopes(num_heads)[tp_rank * per_rank: (tp_rank + 1) * per_rank]


def alibi_bias(slopes: torch.Tensor, sq: int, sk: int, device=None, dtype=None) -> torch.Tensor:
    """[heads, sq, sk] bias for the last `sq` queries of a length-`sk` sequence."""
    q = torch.arange(sk - sq, sk, device=device, dtype=torch.float32)
    k = torch.arange(sk, device=device, dtype=torch.float32)
    bias = slopes.to(device=device, dtype=torch.float32)[:, None, None] * (k[None, None, :] - q[None, :, None])
    return bias if dtype is None else bias.to(dtype)


class _AlibiSoftmax(torch.nn.Module):
    """Adds the ALiBi bias to [b, np, sq, sk] scores, then runs megatron-core's scale-mask-softmax."""

    def __init__(self, inner, slopes: torch.Tensor):
        super().__init__()
        self.inner = inner
        self.slopes = slopes

    def forward(self, scores, mask, softmax_offset=None):
        bias = alibi_bias(self.slopes, scores.shape[2], scores.shape[3], scores.device, scores.dtype)
        if self.inner.scale is not None:  # query-key layer scaling multiplies the scores later
            bias = bias / self.inner.scale
        return self.inner(scores + bias, mask, softmax_offset)


def layer_slopes(core_attention) -> torch.Tensor | None:
    """The ALiBi slopes of a layer's core attention (this rank's heads, fp32), or None for attention without
    ALiBi: what the dynamic inference engine's paged attention adds, which bypasses the core attention
    (`megatron_patch.patches` `alibi_paged_attention`)."""
    slopes = getattr(core_attention, "alibi_slopes", None)  # AlibiTEDotProductAttention
    if slopes is None and isinstance(getattr(core_attention, "scale_mask_softmax", None), _AlibiSoftmax):
        slopes = core_attention.scale_mask_softmax.slopes
    return slopes


def has_alibi(model) -> bool:
    """Whether any layer of `model` attends with ALiBi."""
    return any(layer_slopes(m) is not None for m in model.modules())


class AlibiDotProductAttention(DotProductAttention):
    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        slopes = rank_slopes(config.num_attention_heads, self.tp_group.size(), self.tp_group.rank())
        self.scale_mask_softmax = _AlibiSoftmax(self.scale_mask_softmax, slopes)


@functools.cache
def te_alibi_attention():
    """The TE core-attention class with ALiBi (built lazily: TE is optional)."""
    import transformer_engine as te
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class _InjectAlibi(te.pytorch.DotProductAttention):
        # sits between megatron-core's TEDotProductAttention and TE in the MRO, so the kwargs
        # megatron-core builds reach TE with the ALiBi ones added
        def forward(self, *args, **kwargs):
            kwargs.update(core_attention_bias_type="alibi", alibi_slopes=self.alibi_slopes)
            return super().forward(*args, **kwargs)

    class AlibiTEDotProductAttention(TEDotProductAttention, _InjectAlibi):
        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            tp = self._tp_group
            self.alibi_slopes = rank_slopes(config.num_attention_heads, tp.size(), tp.rank()).cuda()

    return AlibiTEDotProductAttention


def with_alibi(layer_spec: ModuleSpec, impl: str) -> ModuleSpec:
    """A copy of a GPT layer spec whose core attention adds ALiBi biases."""
    core = te_alibi_attention() if impl == "transformer_engine" else AlibiDotProductAttention
    sub = layer_spec.submodules
    attn = sub.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=core))
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(sub, self_attention=attn))
