"""Where a model runs, apart from what it is (`megatron_patch.models`): ranks and process groups
(`parallel`), forward and backward passes through the pipeline stages (`pipeline`), full-vocab logits
at any TP x PP (`logits`), and whether our Triton kernels can run (`kernels`)."""
