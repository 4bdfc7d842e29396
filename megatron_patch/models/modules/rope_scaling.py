"""LLaMA-3.1-style rope scaling (`rope_type: llama3`) with any `low_freq_factor`, `high_freq_factor` and
`original_max_position_embeddings`.

megatron-core's `RotaryEmbedding._apply_scaling` takes all four parameters, but `GPTModel` passes only
`factor` (`rope_scaling_factor`), so the others are its defaults (1, 4, 8192). For a checkpoint with other
values (`original_max_position_embeddings: 4096`, e.g.), `use_llama3_scaling` recomputes the built
model's `rotary_pos_emb.inv_freq` with megatron-core's own function and the checkpoint's parameters,
from the unscaled frequencies of a fresh megatron-core `RotaryEmbedding` (same head size, rotary
fraction and base). Called right after the model is built, before the first forward fills the rotary
embedding's cache. The frequencies are not parameters: nothing changes in checkpoints.
"""

from __future__ import annotations

from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


def use_llama3_scaling(model, *, rotary_base: float, rotary_percent: float, factor: float, low_freq_factor: float,
                       high_freq_factor: float, original_max_position_embeddings: float) -> None:
    rope = getattr(model, "rotary_pos_emb", None)
    if type(rope) is not RotaryEmbedding:
        raise TypeError(f"llama3 rope scaling expects megatron-core's RotaryEmbedding, got {type(rope)}")
    unscaled = RotaryEmbedding(kv_channels=model.config.kv_channels, rotary_percent=rotary_percent,
                               rotary_base=rotary_base, use_cpu_initialization=True).inv_freq
    scaled = rope._apply_scaling(unscaled, factor=factor, low_freq_factor=low_freq_factor,
                                 high_freq_factor=high_freq_factor,
                                 original_max_position_embeddings=original_max_position_embeddings)
    rope.inv_freq = scaled.to(rope.inv_freq.device)
