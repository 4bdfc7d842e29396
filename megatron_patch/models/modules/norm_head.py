"""Baichuan2's NormHead: the output layer multiplies by L2-normalised rows of its weight, in every
forward (training included), so the stored `lm_head.weight` stays as trained and converts bitwise.

megatron-core builds `GPTModel.output_layer` itself (not from the layer spec), so after the model is
built its class is narrowed to `NormHeadColumnParallelLinear`, which only changes which weight the
forward uses. Rows are whole on each TP rank (the vocab is split by rows), so the normalisation is
rank-local and exact under TP.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear


class NormHeadColumnParallelLinear(ColumnParallelLinear):
    def forward(self, input_, weight=None, **kwargs):
        return super().forward(input_, weight=F.normalize(self.weight if weight is None else weight, dim=-1),
                               **kwargs)


def use_norm_head(model) -> None:
    layer = model.output_layer
    if type(layer) is not ColumnParallelLinear:
        raise TypeError(f"NormHead expects megatron-core's ColumnParallelLinear output layer, got {type(layer)}")
    layer.__class__ = NormHeadColumnParallelLinear
    # the fused weight-gradient kernel accumulates into `weight.main_grad`; the normalised weight is
    # computed, so its gradient must flow back through F.normalize the ordinary way
    layer.gradient_accumulation_fusion = False
