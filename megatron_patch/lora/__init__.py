"""LoRA on megatron-core: adapters on the linear layers of any registered family at any TP / PP layout
(`adapters`), PEFT folders and merged HF weights in and out (`peft`, `export`), and the `--lora-*` options of
the training entry points (`training`). See docs/lora.md."""

from megatron_patch.lora.adapters import TARGETS, LoRAConfig, LoRAError, apply_lora

__all__ = ["TARGETS", "LoRAConfig", "LoRAError", "apply_lora"]
