"""Deprecated alias: the pipeline helpers moved to `megatron_patch.runtime.pipeline` (2026-12-02), beside the
other runtime-placement code. Code that imports them from here keeps working, with a DeprecationWarning, until a
later release removes this module."""

import warnings

from megatron_patch.runtime.pipeline import (  # noqa: F401 (re-exported)
    clip_grad_norm,
    forward,
    forward_backward,
    forward_everywhere,
    from_last_stage,
    object_from_last_stage,
    share_embedding_grads,
)

warnings.warn("megatron_patch.models.pipeline moved to megatron_patch.runtime.pipeline", DeprecationWarning,
              stacklevel=2)
