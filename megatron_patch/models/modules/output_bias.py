"""A bias on the output layer (GPT-J's `lm_head.bias`), which megatron-core's `GPTModel` builds without
(`bias=False`, outside the layer spec).

`add_output_bias` gives a built model's `output_layer` (last pipeline stage) the bias megatron-core's
`ColumnParallelLinear` itself makes with `bias=True`: one row per vocab entry of this TP rank (the vocab
is split by rows, so the bias follows the weight's split), zero-initialised, marked tensor-parallel on
dim 0, all-reduced over data parallelism. The layer's forward already adds `self.bias` when it is not
None (`skip_bias_add=False`), so nothing else changes. State-dict name: `output_layer.bias`.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes


def add_output_bias(model) -> None:
    layer = getattr(model, "output_layer", None)
    if layer is None:  # not the last pipeline stage
        return
    if type(layer) is not ColumnParallelLinear:
        raise TypeError(f"an output bias expects megatron-core's ColumnParallelLinear output layer, got {type(layer)}")
    config = layer.config
    device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
    bias = torch.nn.Parameter(torch.zeros(layer.output_size_per_partition, dtype=config.params_dtype, device=device))
    set_tensor_model_parallel_attributes(bias, True, 0, 1)
    bias.allreduce = True
    layer.bias = bias
