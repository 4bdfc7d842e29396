"""Training on megatron.training (Megatron-LM's loop, shipped in the megatron-core wheel): our model
provider (any registered family, from an HF config.json), dataset providers, forward step and loss,
and the few arguments we add. Entry points: `python -m megatron_patch.pretrain` (and `.sft`)."""
