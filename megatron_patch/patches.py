"""The one registry of runtime patches (the last resort of the non-invasive rule).

Each patch is named, states the megatron-core versions it targets and why it exists, is safe to
apply twice, can be undone, and has a test (tests/unit/test_patches.py). Library code asks for a
patch by name; nothing is patched at import time.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch.overrides import TorchFunctionMode


@dataclass
class Patch:
    name: str
    versions: SpecifierSet
    why: str
    apply: Callable[[], Callable[[], None] | None]  # returns an undo function, or None if nothing was done


_REGISTRY: dict[str, Patch] = {}
_ACTIVE: dict[str, Callable[[], None]] = {}


def register(name: str, versions: str) -> Callable:
    def deco(fn: Callable[[], Callable[[], None] | None]) -> Callable:
        _REGISTRY[name] = Patch(name, SpecifierSet(versions), (fn.__doc__ or "").strip(), fn)
        return fn

    return deco


def megatron_core_version() -> Version:
    from megatron.core.package_info import __version__

    return Version(__version__)


def apply(name: str) -> bool:
    """Apply patch `name` if megatron-core's version is in its range; True if it is active."""
    if name in _ACTIVE:
        return True
    p = _REGISTRY[name]
    if megatron_core_version() not in p.versions:
        return False
    undo = p.apply()
    if undo is None:
        return False
    _ACTIVE[name] = undo
    return True


def revert(name: str) -> None:
    undo = _ACTIVE.pop(name, None)
    if undo is not None:
        undo()


@contextlib.contextmanager
def applied(name: str) -> Iterator[bool]:
    """Apply `name` for the duration of a block (left in place if it was active before)."""
    was_active = name in _ACTIVE
    active = apply(name)
    try:
        yield active
    finally:
        if active and not was_active:
            revert(name)


def registry() -> dict[str, Patch]:
    return dict(_REGISTRY)


class _NoTimingEvent:
    """A CUDA event that records nothing (timings read as 0 ms)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


def _is_cuda(dev) -> bool:
    return dev is not None and not isinstance(dev, int) and str(dev).startswith("cuda")


class CudaTensorsOnCpu(TorchFunctionMode):
    """Tensors megatron-core puts on "cuda" stay on the CPU: `.cuda()`, `.to("cuda")` and
    `device="cuda"` (the inference controller's token buffers, the pipeline schedules' counters, the
    tied output weight before its all-reduce). `report_cuda_types`: `Tensor.type()` answers
    torch.cuda.* (megatron.training's optimizer checks it; set by the CPU test harness)."""

    report_cuda_types = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and self.report_cuda_types and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _sliding_window_mask_on_cpu(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """True = masked: keys outside [i - left, i + right] (offset by skv - sq), as megatron-core's."""
    keep = torch.ones(sq, skv, dtype=torch.bool).triu(skv - sq - window_size[0]).tril(skv - sq + window_size[1])
    return ~keep


@register("cpu_cuda_calls", ">=0.17,<0.20")
def _cpu_cuda_calls() -> Callable[[], None] | None:
    """Let megatron-core run forward passes and write/read torch_dist checkpoints without a GPU.

    Two unconditional CUDA calls stand in the way on a CPU-only machine (the converter and
    `verify` run there):
    - `megatron/core/models/common/embeddings/rotary_pos_embedding.py` (`RotaryEmbedding.get_emb`)
      moves `inv_freq` to `torch.cuda.current_device()` on every forward, even for a model built
      with `use_cpu_initialization=True`: here `current_device()` answers "cpu". Multi-latent
      attention (`transformer/multi_latent_attention.py`) builds its rotary embedding without passing
      `use_cpu_initialization`, so the same call is made at construction (DeepSeek; `build_model`).
    - `megatron/core/dist_checkpointing/strategies/filesystem_async.py` (`preload_tensors`) calls
      `torch.cuda.synchronize()` before writing: with no GPU there is nothing to wait for, so it
      becomes a no-op.
    - `megatron/core/transformer/utils.py` (`get_sliding_window_causal_mask`, used by the local
      attention's softmax for sliding-window models such as Mistral) builds its mask on "cuda": the
      name imported by `megatron/core/fusions/fused_softmax.py` is pointed at the same mask built on
      the CPU.
    - `megatron/core/inference/text_generation_controllers/text_generation_controller.py` times every
      generation step with `torch.cuda.Event(enable_timing=True)`: a no-op event stands in; and it
      moves its token buffers with `.cuda()`: `CudaTensorsOnCpu` (a torch function mode, entered for
      as long as the patch is active) keeps every tensor megatron-core sends to "cuda" on the CPU.
    Does nothing when CUDA is available."""
    if torch.cuda.is_available():
        return None
    from megatron.core.fusions import fused_softmax

    originals = (torch.cuda.current_device, torch.cuda.synchronize, fused_softmax.get_sliding_window_causal_mask,
                 torch.cuda.Event)
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    fused_softmax.get_sliding_window_causal_mask = _sliding_window_mask_on_cpu
    torch.cuda.Event = _NoTimingEvent  # type: ignore[assignment,misc]
    mode = CudaTensorsOnCpu()
    mode.__enter__()

    def undo() -> None:
        mode.__exit__(None, None, None)
        (torch.cuda.current_device, torch.cuda.synchronize, fused_softmax.get_sliding_window_causal_mask,
         torch.cuda.Event) = originals

    return undo


@register("prebuilt_dataset_helpers", ">=0.17,<0.20")
def _prebuilt_dataset_helpers() -> Callable[[], None] | None:
    """Skip the runtime build of megatron-core's C++ dataset helpers, which the wheel already ships.

    `megatron/training/initialize.py` (`_compile_dependencies`, rank 0) calls
    `megatron.core.datasets.utils.compile_helpers()`, which runs `make` in the installed package
    folder; the PyPI wheel ships `helpers_cpp*.so` but no Makefile, so `make` fails and the process
    exits. Here `compile_helpers` only imports the prebuilt extension (a clear error if it is missing)."""
    from megatron.core.datasets import utils

    original = utils.compile_helpers

    def use_prebuilt() -> None:
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError as e:
            raise RuntimeError(f"megatron-core's prebuilt dataset helpers are missing ({e}); "
                               "reinstall megatron-core from its wheel") from e

    utils.compile_helpers = use_prebuilt

    def undo() -> None:
        utils.compile_helpers = original

    return undo
