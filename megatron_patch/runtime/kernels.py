"""Whether our Triton kernels can run here: the one check the kernels' callers share (training's cross entropy and
FP8 output layer, the inference patches)."""

from __future__ import annotations

import functools
import os


@functools.cache
def triton_installed() -> bool:
    """Whether Triton imports (it ships with CUDA builds of torch, not with every CPU build)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (TRITON_INTERPRET=1: on a CPU, for tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
