"""The one registry of runtime patches (the last resort of the non-invasive rule). Longer than most
modules on purpose: every patch lives here, so the whole of what we change in megatron-core at run time
can be read in one file.

Each patch is named, states the megatron-core versions it targets (inside the supported range,
`megatron_patch.compat.SUPPORTED`) and why it exists, is safe to apply twice, can be undone, and has a test
(tests/unit/test_patches.py, run under the oldest and the newest supported megatron-core by .ci/run). Outside
its range `apply` does nothing. Library code asks for a patch by name; nothing is patched at import time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import os
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from packaging.specifiers import SpecifierSet
from torch.overrides import TorchFunctionMode

from megatron_patch import compat
from megatron_patch.runtime import kernels


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


def covers(name: str) -> bool:
    """Whether megatron-core's version is in patch `name`'s range (where `apply` would try it)."""
    return compat.megatron_core_version() in _REGISTRY[name].versions


def apply(name: str) -> bool:
    """Apply patch `name` if megatron-core's version is in its range; True if it is active."""
    if name in _ACTIVE:
        return True
    p = _REGISTRY[name]
    if not covers(name):
        return False
    undo = p.apply()
    if undo is None:
        return False
    _ACTIVE[name] = undo
    return True


def require(name: str, flag: str) -> None:
    """Apply patch `name`, which option `flag` needs, or say in one ValueError why it cannot be."""
    if apply(name):
        return
    p, version = _REGISTRY[name], compat.megatron_core_version()
    if not covers(name):
        raise ValueError(f"{flag} needs megatron-core {p.versions}, not {version}")
    raise ValueError(f"{flag}: megatron-core {version} lacks what patch {name} changes ({p.why.splitlines()[0]})")


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


def is_active(name: str) -> bool:
    return name in _ACTIVE


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


class _DummyStream:
    """A CUDA stream with nothing to wait for (the CPU runs in order)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, _stream) -> None:
        pass

    def wait_event(self, _event) -> None:
        pass

    def record_event(self, event=None):
        return event or _NoTimingEvent()


def _swap(targets: list[tuple[object, str, object]]) -> Callable[[], None]:
    """Set each (owner, attribute, value); returns the undo."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    for owner, name, value in targets:
        setattr(owner, name, value)

    def undo() -> None:
        for owner, name, value in reversed(originals):
            setattr(owner, name, value)

    return undo


def _exists(tensor) -> None:
    assert tensor is not None


def _is_cuda(dev) -> bool:
    return dev is not None and not isinstance(dev, int) and str(dev).startswith("cuda")


class CudaTensorsOnCpu(TorchFunctionMode):
    """Tensors megatron-core puts on "cuda" stay on the CPU: `.cuda()`, `.to("cuda")` and
    `device="cuda"` (the inference controller's token buffers, the pipeline schedules' counters, the
    tied output weight before its all-reduce); pinned host memory (`pin_memory=True`, `.pin_memory()`:
    the dynamic inference context's bookkeeping, staged there for fast copies to the GPU) is plain
    memory. `report_cuda_types`: `Tensor.type()` answers torch.cuda.* (megatron.training's optimizer
    checks it; set by the CPU test harness)."""

    report_cuda_types = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
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


@register("cpu_cuda_calls", ">=0.18.2,<0.20")
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
    - The dynamic inference engine (`inference/engines/dynamic_engine.py`, `DynamicInferenceContext`
      in `inference/contexts/dynamic_context.py`, the controller's `_init_dynamic_sampling_tensors`):
      the context pins its bookkeeping tensors (`pin_memory=True`, which needs a CUDA driver; plain
      memory here, through `CudaTensorsOnCpu`) and marks their copies with `torch.cuda.Event()` (the
      no-op event); the controller creates a copy stream, `torch.cuda.Stream(device=...)`: a stream
      with nothing to wait for; the context appends keys and values to its paged KV cache with a
      Triton kernel when Triton is importable (`triton_append_key_value_cache`, GPU-only): the name
      the context calls is set to None, which selects its own indexing path.
    - `megatron/core/inference/communication_utils.py` (`broadcast_from_last_pipeline_stage`, the
      engine's logits at PP > 1) asserts the broadcast tensor `is_cuda` (`_is_cuda`): here it only has
      to exist.
    Does nothing when CUDA is available."""
    if torch.cuda.is_available():
        return None
    from megatron.core.fusions import fused_softmax
    from megatron.core.inference import communication_utils
    from megatron.core.inference.contexts import dynamic_context

    undo_swaps = _swap([
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda device=None: None),
        (fused_softmax, "get_sliding_window_causal_mask", _sliding_window_mask_on_cpu),
        (torch.cuda, "Event", _NoTimingEvent),
        (torch.cuda, "Stream", _DummyStream),
        (communication_utils, "_is_cuda", _exists),
        *([(dynamic_context, "triton_append_key_value_cache", None)]
          if hasattr(dynamic_context, "triton_append_key_value_cache") else []),
    ])
    mode = CudaTensorsOnCpu()
    mode.__enter__()

    def undo() -> None:
        mode.__exit__(None, None, None)
        undo_swaps()

    return undo


@register("prebuilt_dataset_helpers", ">=0.18.2,<0.20")
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


class _StandInCudaRng:
    """The "CUDA" generator state of a machine without one: a CPU generator state kept apart, so forking
    it (the tensor-parallel RNG tracker) never moves the CPU generator that CPU initialisation draws from."""

    def __init__(self) -> None:
        self.state = torch.Generator().manual_seed(0).get_state()

    def get(self, device="cuda", *args, **kwargs) -> torch.Tensor:
        return self.state.clone()

    def set(self, new_state: torch.Tensor, device="cuda", *args, **kwargs) -> None:
        self.state = new_state.clone()

    def seed(self, seed: int) -> None:
        self.state = torch.Generator().manual_seed(seed).get_state()


_CUDA_RNG = _StandInCudaRng()


@register("cpu_parallel_state", ">=0.18.2,<0.20")
def _cpu_parallel_state() -> Callable[[], None] | None:
    """Let megatron-core set up model parallelism, wrap models in its DDP and keep its RNG tracker on a
    machine without a GPU (gloo worlds; the CPU test harness and `--cpu` training):
    - `torch.cuda.device_count` answers 1: `megatron/training/initialize.py` (`_initialize_distributed`)
      silently skips `initialize_model_parallel` when it is 0; `torch.cuda.set_device` is a no-op.
    - `torch.cuda.current_stream` (`distributed/distributed_data_parallel.py`,
      `param_and_grad_buffer.py`): a stream with nothing to wait for.
    - the CUDA RNG state (`torch.cuda.get_rng_state` / `set_rng_state`, `tensor_parallel/random.py`'s
      `_set_cuda_rng_state`; the TP RNG tracker's forks, checkpoint save/load in
      `training/checkpointing.py`): a separate CPU generator state stands in for the GPU's, so forks never
      touch the generator CPU initialisation draws from.
    - `CUDA_DEVICE_MAX_CONNECTIONS=1` (megatron asserts it for TP/CP > 1), unless set.
    Does nothing when CUDA is available."""
    if torch.cuda.is_available():
        return None
    from megatron.core.tensor_parallel import random as mc_random

    undo_swaps = _swap([
        (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "set_device", lambda device: None),
        (torch.cuda, "current_stream", lambda device=None: _DummyStream()),
        (torch.cuda, "get_rng_state", _CUDA_RNG.get),
        (torch.cuda, "set_rng_state", _CUDA_RNG.set),
        (mc_random, "_set_cuda_rng_state", lambda new_state, device=-1, graph_safe=False: _CUDA_RNG.set(new_state)),
    ])
    set_env = "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    if set_env:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"

    def undo() -> None:
        undo_swaps()
        if set_env:
            os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)

    return undo


def _cpu_device_properties(device=None) -> types.SimpleNamespace:
    return types.SimpleNamespace(major=9, minor=0, name="cpu", total_memory=0, multi_processor_count=1)


@register("cpu_training", ">=0.18.2,<0.20")
def _cpu_training() -> Callable[[], None] | None:
    """Run megatron.training's loop (`pretrain`) on a machine without a GPU: `--cpu` of our training entry
    points, for tiny models (debugging a recipe on a laptop; the CPU tests). On top of `cpu_cuda_calls`
    and `cpu_parallel_state` (applied with it):
    - `megatron/training/training.py` (`pretrain`) calls `initialize_megatron()`, which asserts
      `torch.cuda.is_available()` unless given `allow_no_cuda=True`: the name `pretrain` calls is
      pointed at `initialize_megatron(allow_no_cuda=True)`.
    - `megatron/training/arguments.py` (`validate_args`) reads `torch.cuda.get_device_properties` for
      TP > 1 (sequence-parallel and communication-overlap rules): a stand-in device answers.
    - the training RNG tracker (`tensor_parallel/random.py`: `model_parallel_cuda_manual_seed`,
      `_get_cuda_rng_state`) seeds and forks the CUDA generator: `torch.cuda.manual_seed[_all]` and
      `_get_cuda_rng_state` use the stand-in state of `cpu_parallel_state`.
    - `training.get_model` builds DDP under a dedicated `torch.cuda.Stream()` (`torch.cuda.stream`):
      streams with nothing to wait for.
    - the optimizer (`core/optimizer`) and gradient clipping check `Tensor.type()` for `torch.cuda.*`:
      `CudaTensorsOnCpu` answers with the CUDA type name of the CPU tensor.
    Does nothing when CUDA is available."""
    if torch.cuda.is_available():
        return None
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.training import training

    dependencies = [name for name in ("cpu_cuda_calls", "cpu_parallel_state") if not is_active(name)]
    for name in dependencies:
        apply(name)
    init = functools.partial(training.initialize_megatron, allow_no_cuda=True)
    undo_swaps = _swap([
        (training, "initialize_megatron", init),
        (torch.cuda, "get_device_properties", _cpu_device_properties),
        (torch.cuda, "manual_seed", _CUDA_RNG.seed),
        (torch.cuda, "manual_seed_all", _CUDA_RNG.seed),
        (mc_random, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False: _CUDA_RNG.get()),
        (torch.cuda, "Stream", _DummyStream),
        (torch.cuda, "stream", lambda stream=None: contextlib.nullcontext()),
        (CudaTensorsOnCpu, "report_cuda_types", True),
    ])

    def undo() -> None:
        undo_swaps()
        for name in reversed(dependencies):
            revert(name)

    return undo


_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # what every flash-attn generation's paged kernels take


def _flash_importable() -> bool:
    from megatron.core.transformer import attention

    return bool(attention.HAVE_FA3 or attention.HAVE_FA4 or attention.flash_attn_varlen_func is not None)


def attends_in_torch(dtype: torch.dtype) -> bool:
    """Whether the dynamic engine's attention for a model of `dtype` runs in torch (`paged_attention_in_torch`,
    while it is applied): with no flash-attn kernel, or for a dtype none takes (fp32)."""
    return is_active("paged_attention_in_torch") and (not _flash_importable() or dtype not in _FLASH_DTYPES)


@register("paged_attention_in_torch", ">=0.18.2,<0.20")
def _paged_attention_in_torch_patch() -> Callable[[], None] | None:
    """Run megatron-core's dynamic inference engine without flash-attn (every CPU machine; a GPU where
    the flash-attn package is not installed), and in fp32 (no flash-attn kernel takes fp32: FA4 asserts
    "inputs must be float16, bfloat16, fp8", seen on an H200 on 2026-12-01).

    `megatron/core/transformer/attention.py` (`Attention.forward`, dynamic batching) asserts that
    flash-attn >= 2.7.3 (or FlashAttention 3 / 4) is installed and attends through its paged-KV kernels
    in `Attention.flash_decode_and_prefill` (`flash_attn_varlen_func` for prefill,
    `flash_attn_with_kvcache` for decode, both GPU-only). Here `flash_decode_and_prefill` is a torch
    implementation of the same function (`inference/paged_attention.py`: same arguments and output, exact
    fp32 softmax(q k^T * scale) v, grouped queries, sliding windows, sink logits; 0.18.2's own kernels
    ignore a sliding window, this one applies it as 0.19 does) and the version check
    (`is_fa_min_version` as attention.py names it) passes. Multi-latent attention with cached latents
    (FlashMLA) has its own patch, `mla_latent_cache`. On a GPU it is a correctness fallback, not a fast path: install
    flash-attn there for speed. When a flash-attn kernel is importable, only calls whose queries are not
    fp16 / bf16 take the torch implementation; the others go to megatron-core's own method."""
    from megatron.core.transformer import attention

    from megatron_patch.inference import paged_attention

    if not _flash_importable():
        return _swap([
            (attention.Attention, "flash_decode_and_prefill", paged_attention.flash_decode_and_prefill),
            (attention, "is_fa_min_version", lambda version, check_equality=True: True),
        ])
    flash = attention.Attention.flash_decode_and_prefill

    @functools.wraps(flash)
    def by_dtype(self, q, *args, **kwargs):
        in_torch = paged_attention.flash_decode_and_prefill
        return (flash if q.dtype in _FLASH_DTYPES else in_torch)(self, q, *args, **kwargs)

    return _swap([(attention.Attention, "flash_decode_and_prefill", by_dtype)])


def _cuda_capability() -> tuple[int, int] | None:
    """The current GPU's compute capability (major, minor), or None without a GPU."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


@register("fa4_no_split_kv_on_sm90", ">=0.19,<0.20")
def _fa4_no_split_kv_on_sm90() -> Callable[[], None] | None:
    """Run megatron-core's dynamic inference engine with FlashAttention-4 on Hopper (compute capability 9.x).

    `megatron/core/transformer/attention.py` (`Attention.flash_decode_and_prefill`, 0.19.0 to 0.19.2) calls
    FA4's paged kernel, the module-level name `flash_attn4_varlen_func` (`flash_attn.cute.flash_attn_varlen_func`),
    for prefill / mixed steps and for decode-only steps, both with `num_splits=0 if not self.batch_invariant_mode
    else 1`. FA4 reads 0 as "choose": its split heuristic (`flash_attn/cute/interface.py`,
    `_get_fwd_config` / `num_splits_heuristic`) splits the KV length whenever it spans more than 4 KV tiles and
    there are at most half as many query tiles as SMs (decoding a few requests over a long cache; in CUDA graphs
    megatron passes `max_seqlen_k` = the context's `max_sequence_length`), and its SM90 forward has no split-KV kernel:
    `AssertionError: SplitKV not supported on SM 9.0` (4.0.0b36). megatron-core 0.18.2 passed `num_splits=1`
    there. Here the name attention.py calls passes `num_splits=1` (one split: the kernel megatron's batch-invariant
    mode runs). Applies only when FA4 is what megatron-core selected (`attention.HAVE_FA4`) and the GPU is
    compute capability 9.x; elsewhere (Blackwell splits the KV natively) it does nothing."""
    from megatron.core.transformer import attention

    capability = _cuda_capability()
    if not getattr(attention, "HAVE_FA4", False) or capability is None or capability[0] != 9:
        return None
    original = attention.flash_attn4_varlen_func

    @functools.wraps(original)
    def one_split(*args, **kwargs):
        kwargs["num_splits"] = 1
        return original(*args, **kwargs)

    return _swap([(attention, "flash_attn4_varlen_func", one_split)])


TE_FLASH_BACKENDS = "transformer_engine.pytorch.attention.dot_product_attention.backends"


def _fa4_side(side: int | None) -> int | None:
    """One side of a Transformer Engine attention window as FlashAttention-4 reads it: TE (written for FA2 / FA3,
    which read any negative side as unbounded) marks an unbounded side -1; FA4 marks it None and reads a negative
    bound as an offset."""
    return None if side is not None and side < 0 else side


def fa4_window(window):
    """A TE window (left, right) as FA4 reads one (`_fa4_side`): TE's causal mask `(-1, 0)` is FA4's `(None, 0)`."""
    return None if window is None else tuple(_fa4_side(side) for side in window)


# The names TE's attention looks up in its `backends` module to call FA4: the public functions (TE's
# FlashAttention backend: `window_size=(left, right)`) and the raw ones its context-parallel code imports from
# there at call time (`window_size_left=`, `window_size_right=`)
TE_FA4_NAMES = ("flash_attn_func_v4", "flash_attn_varlen_func_v4", "_flash_attn_fwd_v4", "_flash_attn_bwd_v4")


def te_flash_backends():
    """Transformer Engine's attention backends module (`TE_FLASH_BACKENDS`, where TE looks up FA4's functions,
    `TE_FA4_NAMES`: None where TE found no FA4), or None: no TE, TE without its CUDA libraries, an older layout."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        return importlib.import_module(TE_FLASH_BACKENDS)
    except Exception:
        return None


@register("te_fa4_causal_window", ">=0.18.2,<0.20")
def _te_fa4_causal_window() -> Callable[[], None] | None:
    """Transformer Engine's FlashAttention-4 calls with FA4's window sentinel, so that causal attention attends.

    TE's FlashAttention backend (`transformer_engine/pytorch/attention/dot_product_attention/backends.py`,
    `FlashAttention.forward`, TE 2.20.x) calls FA4 through the module-level names `flash_attn_func_v4` /
    `flash_attn_varlen_func_v4` (FA4's `flash_attn.cute` functions) with `window_size=(-1, 0)` for a causal mask
    (`check_set_window_size`: -1 is TE's "unbounded"); its context-parallel attention (`context_parallel.py`)
    imports `_flash_attn_fwd_v4` / `_flash_attn_bwd_v4` from there and passes `window_size_left=-1,
    window_size_right=0`. FA4 marks an unbounded side None; since flash-attention #2490 (in 4.0.0b36:
    `_resolve_causal_local_window` widens a window to "none" only where both sides are negative) it reads
    `(-1, 0)` as the local window [i + 1, i]: empty, so every output row is zero, silently (TE issue #3528; fix
    proposed in TE PR #3532). Training then runs fast and learns nothing through attention: on one H200 the
    8B step's losses parted from cuDNN attention's by 8.17 in 20 iterations (docs/benchmarks.md, issue 28).
    Here those four names map each negative side to None (`fa4_window`), which every FA4 version reads as
    unbounded; sliding windows (sides >= 0) pass unchanged. Applies where TE is installed and found FA4 (its
    names not None), for as long as the process builds models (`models.build.model_class_parts`); elsewhere it
    does nothing. megatron-core's own FA4 calls (the dynamic engine's paged attention) pass no window."""
    backends = te_flash_backends()
    if backends is None:  # nothing of ours to fix
        return None

    def with_fa4_window(original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            if "window_size" in kwargs:
                kwargs["window_size"] = fa4_window(kwargs["window_size"])
            for side in ("window_size_left", "window_size_right"):
                if side in kwargs:
                    kwargs[side] = _fa4_side(kwargs[side])
            return original(*args, **kwargs)

        return call

    targets = [(backends, name, with_fa4_window(fn)) for name in TE_FA4_NAMES
               if (fn := getattr(backends, name, None)) is not None]
    return _swap(targets) if targets else None


# where TE's `set_extra_state`s ask whether to unpickle (modules, fusible ops)
TE_EXTRA_STATE_MODULES = ("transformer_engine.pytorch.module.base", "transformer_engine.pytorch.ops.op")


@register("te_extra_state_safe_load", ">=0.18.2,<0.20")
def _te_extra_state_safe_load() -> Callable[[], None] | None:
    """Checkpoints of FP8 delayed-scaling runs load again, safely (resuming `--fp8-recipe delayed`, converting
    such a checkpoint).

    Transformer Engine pickles a module's delayed-scaling state (the recipe, scales and amax histories) into its
    `_extra_state`. TE 2.20.x (`transformer_engine/pytorch/_extra_state.py`, `should_load_extra_state_pickle`,
    called by `TransformerEngineBaseModule.set_extra_state` in `module/base.py`) refuses to unpickle it, since a
    pickle can run code, unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 allows every pickle: so a delayed-scaling
    run saved by megatron-core could not be resumed (`error: Refusing to load pickled Transformer Engine extra
    state for TERowParallelLinear`, the FP8 convergence run of 2026-12-04). megatron-core reads such state
    safely only for its grouped linear layers (`TEGroupedLinear._decode_extra_state`, with its restricted
    `megatron.core.safe_globals.SafeUnpickler`: tensors, their storages under `weights_only=True`, TE's recipe
    classes, plain containers). Here, where TE refuses, the payload is read first by that same unpickler: one
    that holds nothing else is let through to TE's own loader (the same bytes); any other raises a
    `RuntimeError` naming the module and the global at fault. TE's other answers (nothing to load, the
    user's NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1) are unchanged; the same holds for TE's fusible ops
    (`ops/op.py`). Applies where TE has that check (TE 2.20), for as long as the process builds models
    (`models.build.model_class_parts`)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    from megatron.core.safe_globals import SafeUnpickler

    def metadata_only(original):
        @functools.wraps(original)
        def should_load(data: bytes, context: str) -> bool:
            try:
                return original(data, context)
            except RuntimeError:  # TE's refusal: let it through if it holds nothing but FP8 scaling metadata
                try:
                    SafeUnpickler(io.BytesIO(data)).load()
                except Exception as e:
                    why = (str(e).splitlines() or [type(e).__name__])[0]
                    raise RuntimeError(f"{context}: Transformer Engine's extra state holds more than FP8 scaling "
                                       f"metadata ({why}); not loaded (NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 "
                                       "loads it: only for a checkpoint you trust)") from e
                return True

        return should_load

    targets = []
    for where in TE_EXTRA_STATE_MODULES:
        try:
            module = importlib.import_module(where)
        except Exception:  # TE without its CUDA libraries, an older layout
            continue
        if (original := getattr(module, "should_load_extra_state_pickle", None)) is not None:  # TE >= 2.20
            targets.append((module, "should_load_extra_state_pickle", metadata_only(original)))
    return _swap(targets) if targets else None


def _fp8_autocast_probe() -> Callable[[], bool]:
    """A call that says whether a Transformer Engine FP8 (or other quantized) autocast is active, resolved once:
    TE 2.x's `quantization.FP8GlobalStateManager` (older: `fp8`), or "never" without TE."""
    for where in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            return importlib.import_module(where).FP8GlobalStateManager.is_fp8_enabled
        except (ImportError, AttributeError):
            continue
    return lambda: False


def _gpu_with_triton() -> bool:
    """Whether our Triton kernels can run here: a CUDA GPU and Triton importable."""
    return torch.cuda.is_available() and kernels.triton_installed()


def _gemv_serves(x: torch.Tensor, weight, tp_size: int, fp8_on: Callable[[], bool]) -> bool:
    """Whether a linear layer's call is a decode-sized inference call `inference.gemv` serves: no autograd, at
    most `gemv.SERVED_ROWS` tokens, bf16 / fp16 on a GPU, a plain (not quantized) weight of x's dtype, one
    tensor-parallel rank, no FP8 autocast (`fp8_on()`)."""
    from megatron_patch.inference import gemv

    return (not torch.is_grad_enabled() and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.stride(-1) == 1 and x.shape[-1] == weight.shape[1]
            and 0 < x.numel() // weight.shape[1] <= gemv.SERVED_ROWS and tp_size == 1 and not fp8_on())


@register("decode_gemv", ">=0.18.2,<0.20")
def _decode_gemv() -> Callable[[], None] | None:
    """Batch-1 decode's linear layers as one Triton GEMV kernel each (`megatron_patch.inference.gemv`), with
    the layer's RMSNorm / LayerNorm folded in, instead of cuBLAS's GEMM kernels (64-86% of HBM bandwidth for one
    token, half of them split-K plus a reduce kernel) and TE's separate norm kernel (docs/benchmarks.md, issue 27).

    Wraps the `forward` of megatron-core's `TELinear` (`TEColumnParallelLinear`, `TERowParallelLinear`),
    `TELayerNormColumnParallelLinear` (`megatron/core/extensions/transformer_engine.py`, 0.18.2 to 0.19.x) and
    `tensor_parallel.ColumnParallelLinear` (the output layer): a call with at most `gemv.SERVED_ROWS` tokens under
    no autograd, bf16 / fp16, a plain weight, TP = 1, no FP8 autocast and (for the norm) no
    `return_layernorm_output` takes the kernel; any other call runs the original forward. The return values
    are the originals' (`(output, bias)`, the bias returned instead of added where the layer skips the bias
    add). Needs a GPU and Triton; applied by the dynamic engine (`inference.dynamic.DECODE_GEMV`)."""
    if not _gpu_with_triton():
        return None
    from megatron.core.tensor_parallel import layers

    from megatron_patch.inference.gemv import NORMS, Norm, gemv

    fp8_on = _fp8_autocast_probe()
    targets = []
    column = layers.ColumnParallelLinear.forward

    @functools.wraps(column)
    def column_forward(self, input_, weight=None, runtime_gather_output=None):
        w = self.weight if weight is None else weight
        if w is None or not _gemv_serves(input_, w, layers.get_pg_size(self.tp_group), fp8_on):
            return column(self, input_, weight, runtime_gather_output)
        if self.skip_bias_add:
            return gemv(input_, w), self.bias
        return gemv(input_, w, self.bias), None

    targets.append((layers.ColumnParallelLinear, "forward", column_forward))
    try:
        from megatron.core.extensions import transformer_engine as te_ext
    except ImportError:
        te_ext = None
    if te_ext is not None and hasattr(te_ext, "TELinear"):
        linear = te_ext.TELinear.forward
        ln_linear = te_ext.TELayerNormColumnParallelLinear.forward

        def bias_of(self):
            return self.bias if getattr(self, "use_bias", False) else None

        @functools.wraps(linear)
        def linear_forward(self, x):
            if not _gemv_serves(x, self.weight, getattr(self, "tp_size", 1), fp8_on):
                return linear(self, x)
            if self.te_return_bias:
                return gemv(x, self.weight), bias_of(self)
            return gemv(x, self.weight, bias_of(self)), None

        @functools.wraps(ln_linear)
        def ln_linear_forward(self, x):
            if (not _gemv_serves(x, self.weight, getattr(self, "tp_size", 1), fp8_on)
                    or getattr(self, "normalization", None) not in NORMS or self.return_layernorm_output):
                return ln_linear(self, x)
            norm = Norm(self.normalization, self.layer_norm_weight,
                        getattr(self, "layer_norm_bias", None) if self.normalization == "LayerNorm" else None,
                        self.eps, bool(getattr(self, "zero_centered_gamma", False)))
            if self.te_return_bias:
                return gemv(x, self.weight, None, norm), bias_of(self)
            return gemv(x, self.weight, bias_of(self), norm), None

        targets += [(te_ext.TELinear, "forward", linear_forward),
                    (te_ext.TELayerNormColumnParallelLinear, "forward", ln_linear_forward)]
    return _swap(targets)


@register("split_kv_decode_attention", ">=0.18.2,<0.20")
def _split_kv_decode_attention() -> Callable[[], None] | None:
    """Decode-only steps of megatron-core's dynamic engine attend through our split-KV Triton kernels
    (`megatron_patch.inference.decode_attention`) instead of FlashAttention-4, which has no split-KV kernel on
    Hopper: one decode token per request then attends in one program per (request, KV head), 19 us a layer at 8B
    over ~1k cached tokens whose bytes take ~1 us (docs/benchmarks.md, issue 27).

    Wraps `Attention.flash_decode_and_prefill` (`megatron/core/transformer/attention.py`, 0.18.2 to 0.19.x, same
    arguments; 0.19 adds `softmax_offset`): a decode-only call with one query per request, 16-bit inputs the
    kernels take (`decode_attention.supports`), no sink logits, no sliding window for the layer, not
    batch-invariant mode and not multi-latent attention runs the kernels; every other call the original. Needs a
    GPU and Triton; applied by the dynamic engine (`inference.dynamic.DECODE_ATTENTION`)."""
    if not _gpu_with_triton():
        return None
    from megatron.core.transformer import attention

    from megatron_patch.inference import decode_attention as da

    original = attention.Attention.flash_decode_and_prefill

    @functools.wraps(original)
    def flash_decode_and_prefill(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                                 block_table, is_decode_only, softmax_offset=None):
        if _split_kv_serves(self, q, k, seqlens_k, is_decode_only, softmax_offset):
            scale = getattr(self, "softmax_scale", None) or q.shape[-1] ** -0.5
            return da.decode_attention(q[:, 0], k, v, block_table, seqlens_k, scale)[:, None]
        extra = {} if softmax_offset is None else {"softmax_offset": softmax_offset}
        return original(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                        block_table, is_decode_only, **extra)

    return _swap([(attention.Attention, "flash_decode_and_prefill", flash_decode_and_prefill)])


def _split_kv_serves(layer, q: torch.Tensor, k: torch.Tensor, seqlens_k: torch.Tensor, is_decode_only: bool,
                     softmax_offset) -> bool:
    """Whether our split-KV decode kernels take this call of `Attention.flash_decode_and_prefill`: decode-only
    with one query per request on the GPU, 16-bit inputs the kernels take (`decode_attention.supports`), no sink
    logits, no sliding window for the layer, not batch-invariant mode and not multi-latent attention."""
    da, is_layer_window_attention = _split_kv_parts()
    config = layer.config
    return (is_decode_only and softmax_offset is None and q.is_cuda and q.dim() == 4 and k.dim() == 4
            and q.shape[0] == seqlens_k.shape[0] and da.supports(q[:, 0], k)
            and not getattr(layer, "batch_invariant_mode", False)
            and type(config).__name__ != "MLATransformerConfig"
            and not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer.layer_number))


@functools.cache
def _split_kv_parts():
    """(our decode_attention module, megatron-core's is_layer_window_attention), imported once: asked per layer
    and step."""
    from megatron.core.transformer.utils import is_layer_window_attention

    from megatron_patch.inference import decode_attention

    return decode_attention, is_layer_window_attention


@register("alibi_paged_attention", ">=0.18.2,<0.20")
def _alibi_paged_attention() -> Callable[[], None] | None:
    """ALiBi models (Bloom, Baichuan-13B) on megatron-core's dynamic inference engine, which attends through
    `Attention.flash_decode_and_prefill` (`megatron/core/transformer/attention.py`, 0.18.2 to 0.19.x) and not
    through the layer's core attention, where the ALiBi bias lives (`models/modules/alibi.py`): flash-attn's paged
    kernels would drop the bias. Here a layer whose core attention has ALiBi slopes (`alibi.layer_slopes`)
    attends with the bias added: decode-only steps the split-KV kernels take (`_split_kv_serves`) on our Triton
    kernels with the slopes (`inference/decode_attention.py`), every other call in torch
    (`inference/paged_attention.py`, request by request for prefill). Layers without ALiBi keep the method in
    place. Applied by the dynamic engine for models with ALiBi (`inference.dynamic`), which then captures CUDA
    graphs of decode-only steps only (the torch prefill reads the lengths on the host)."""
    from megatron.core.transformer import attention

    from megatron_patch.inference import decode_attention as da
    from megatron_patch.inference import paged_attention
    from megatron_patch.models.modules.alibi import layer_slopes

    original = attention.Attention.flash_decode_and_prefill
    kernels_here = _gpu_with_triton()

    @functools.wraps(original)
    def flash_decode_and_prefill(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                                 block_table, is_decode_only, softmax_offset=None):
        slopes = layer_slopes(self.core_attention)
        extra = {} if softmax_offset is None else {"softmax_offset": softmax_offset}
        if slopes is None:
            return original(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                            block_table, is_decode_only, **extra)
        if kernels_here and _split_kv_serves(self, q, k, seqlens_k, is_decode_only, softmax_offset):
            # the slopes on the queries' device once (a CUDA graph captures no host-to-device copy)
            if getattr(self, "_alibi_slopes_on", None) is None or self._alibi_slopes_on.device != q.device:
                self._alibi_slopes_on = slopes.to(q.device, torch.float32)
            scale = getattr(self, "softmax_scale", None) or q.shape[-1] ** -0.5
            return da.decode_attention(q[:, 0], k, v, block_table, seqlens_k, scale, self._alibi_slopes_on)[:, None]
        return paged_attention.flash_decode_and_prefill(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q,
                                                        cu_seqlens_k, seqlens_k, block_table, is_decode_only,
                                                        **extra)

    return _swap([(attention.Attention, "flash_decode_and_prefill", flash_decode_and_prefill)])


@register("mla_latent_cache", ">=0.18.2,<0.20")
def _mla_latent_cache() -> Callable[[], None] | None:
    """Multi-latent attention (DeepSeek) on megatron-core's dynamic inference engine, through megatron-core's own
    cached-latent path (`cache_mla_latents`, `megatron/core/transformer/multi_latent_attention.py`, 0.18.2 to
    0.19.x), which as shipped runs only with Transformer Engine and FlashMLA: `prepare_for_absorption` splits TE's
    fused norm + linear `linear_kv_up_proj` into copies (`split_te_layernorm_column_parallel_linear`, None without
    TE) and deletes it, so the model cannot train afterwards and the copies go stale when it does; each prefill or
    mixed step up-projects the layer's whole latent cache (`uncompress_kv_from_cache`), whatever the step's requests
    hold; decode attends through FlashMLA's kernel; and 0.19 calls `flash_decode_and_prefill` without its
    `is_decode_only` argument. Here `MLASelfAttention.prepare_for_absorption` (called at every forward pass) uses
    the layer's own weights: the absorbed up-projections `up_k_weight` / `up_v_weight` are views of
    `linear_kv_up_proj`'s weight and `linear_kv_up_proj_linear` is that layer (local) or its linear part (TE's fused
    layer, whose norm becomes `kv_layernorm` for the call: `_FusedNorm`), none of them in the state dict;
    `mla_latent_forget` puts the layer back as it was. `uncompress_kv_from_cache` hands the latents on, and
    `MultiLatentAttention.flash_decode_and_prefill` attends in torch (`inference/paged_attention.py`): prefill
    request by request over its own blocks up-projected (`mla_prefill`), decode absorbed (`mla_decode`; on a GPU on
    our split-KV Triton kernel, `decode_attention.mla_decode_attention`, for DeepSeek's shapes: `mla_supports`). The
    dynamic engine applies it for MLA models, with the latent switch on for the call only
    (`inference.dynamic._latent_cache`)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MultiLatentAttention

    from megatron_patch.inference import decode_attention as da
    from megatron_patch.inference import paged_attention

    kernels_here = _gpu_with_triton()
    uncompress = MLASelfAttention.uncompress_kv_from_cache

    def prepare_for_absorption(self) -> None:
        proj = self.linear_kv_up_proj
        fused = hasattr(proj, "layer_norm_weight")  # Transformer Engine's LayerNormLinear: the kv norm inside
        if fused and not isinstance(self.kv_layernorm, _FusedNorm):
            self.__dict__["_mla_kv_layernorm"] = self.kv_layernorm  # (an identity: put back by mla_latent_forget)
            self.kv_layernorm = _FusedNorm(proj)
        c = self.config
        weight = proj.weight.view(self.num_attention_heads_per_partition, c.qk_head_dim + c.v_head_dim,
                                  c.kv_lora_rank)
        self.__dict__.update(up_k_weight=weight[:, : c.qk_head_dim], up_v_weight=weight[:, c.qk_head_dim:],
                             linear_kv_up_proj_linear=functools.partial(_linear_part, proj) if fused else proj)

    def latents_for_prefill(self, kv_cache):
        # Attention._adjust_key_value_for_inference asks for the whole cache up-projected before a prefill / mixed
        # step: hand the latents on, and flash_decode_and_prefill up-projects each request's blocks only
        self.__dict__["_mla_latent_prefill"] = True
        return kv_cache, None

    def flash_decode_and_prefill(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                                 block_table, is_decode_only=None, softmax_offset=None):
        if self.__dict__.pop("_mla_latent_prefill", False):
            return paged_attention.mla_prefill(self, q, k, cu_seqlens_q, seqlens_k, block_table, uncompress,
                                               softmax_offset)
        rank = self.config.kv_lora_rank
        if (kernels_here and softmax_offset is None and q.is_cuda and q.shape[0] == seqlens_k.shape[0]
                and da.mla_supports(q[:, 0], k, rank)):  # one query a request: the Triton kernel
            return da.mla_decode_attention(q[:, 0], k, block_table, seqlens_k, self.softmax_scale, rank)[:, None]
        return paged_attention.mla_decode(self, q, k, block_table, seqlens_k, softmax_offset)

    targets = [(MLASelfAttention, "prepare_for_absorption", prepare_for_absorption),
               (MLASelfAttention, "uncompress_kv_from_cache", latents_for_prefill),
               (MultiLatentAttention, "flash_decode_and_prefill", flash_decode_and_prefill)]
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in targets]
    for owner, name, value in targets:
        setattr(owner, name, value)

    def undo() -> None:
        for owner, name, value in saved:  # inherited before (flash_decode_and_prefill): inherited again
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    return undo


class _FusedNorm(torch.nn.Module):
    """The norm inside Transformer Engine's fused norm + linear (`LayerNormLinear`: `layer_norm_weight`,
    `layer_norm_bias`, `normalization`, `eps`, `zero_centered_gamma`) as a layer of its own that reads the fused
    layer's weights (no parameters of its own, no copy)."""

    def __init__(self, fused: torch.nn.Module):
        super().__init__()
        self.__dict__["fused"] = fused  # (not a child module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.fused
        w = f.layer_norm_weight + 1 if getattr(f, "zero_centered_gamma", False) else f.layer_norm_weight
        if getattr(f, "normalization", "RMSNorm") == "RMSNorm":
            return torch.nn.functional.rms_norm(x, w.shape, w, f.eps)
        return torch.nn.functional.layer_norm(x, w.shape, w, getattr(f, "layer_norm_bias", None), f.eps)


def _linear_part(fused: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, None]:
    """The linear of a fused norm + linear without its norm, returning (output, bias) as megatron's linears do."""
    bias = fused.bias if getattr(fused, "use_bias", False) else None
    return torch.nn.functional.linear(x, fused.weight, bias), None


def mla_latent_forget(layer: torch.nn.Module) -> None:
    """Put an MLA layer back as it was before `mla_latent_cache`'s `prepare_for_absorption` ran on it."""
    for name in ("up_k_weight", "up_v_weight", "linear_kv_up_proj_linear"):
        layer.__dict__.pop(name, None)
    norm = layer.__dict__.pop("_mla_kv_layernorm", None)
    if norm is not None:
        layer.kv_layernorm = norm


def _rope_serves(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens, mscale: float, cp_group) -> bool:
    """Whether the dynamic context's RoPE call is one `inference.decode_rope` does with the original's
    arithmetic: Transformer Engine's fused bshd RoPE (`apply_rope_fusion`, no packed `cu_seqlens`, no mRoPE, no
    mscale, no MLA or interleaved rotation), or fp32 tensors (the unfused path then computes what the kernel does),
    one context-parallel rank, tensors the kernel takes."""
    from megatron_patch.inference import decode_rope

    return ((config.apply_rope_fusion or t.dtype == torch.float32) and cu_seqlens is None and mscale == 1.0
            and getattr(config, "mrope_section", None) is None and not config.multi_latent_attention
            and not config.rotary_interleaved and (cp_group is None or cp_group.size() == 1)
            and decode_rope.serves(t, freqs))


def _mla_rope_serves(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens, cp_group) -> bool:
    """Whether the dynamic context's RoPE call is multi-latent attention's that `inference.decode_rope.mla_rope`
    does with the original's arithmetic (megatron-core's unfused `_apply_rotary_pos_emb_bshd`, which MLA always
    takes: TE's fused RoPE has neither its interleaving nor YaRN's mscale): `decode_rope.MLA_ROPE` on, no packed
    `cu_seqlens`, no mRoPE, no rotate-half interleaving, one context-parallel rank, tensors the kernel takes."""
    from megatron_patch.inference import decode_rope

    return (decode_rope.MLA_ROPE and config.multi_latent_attention and cu_seqlens is None
            and getattr(config, "mrope_section", None) is None and not config.rotary_interleaved
            and (cp_group is None or cp_group.size() == 1) and decode_rope.mla_serves(t, freqs))


@register("fused_decode_rope", ">=0.18.2,<0.20")
def _fused_decode_rope() -> Callable[[], None] | None:
    """The dynamic engine's rotary embedding in one kernel each for queries and keys (`inference.decode_rope`),
    rotating in place at each token's position, instead of an index kernel gathering the angles, Transformer
    Engine's fused RoPE and (queries) a copy back: three kernels fewer a layer (issue 27).

    Wraps `DynamicInferenceContext.apply_rotary_emb_query` / `apply_rotary_emb_key`
    (`megatron/core/inference/contexts/dynamic_context.py`, 0.18.2 to 0.19.x), which rotate the first
    `padded_active_token_count` tokens at `gpu_view.token_to_pos_ids` (queries) / `token_to_position_in_request`
    (keys) and return the query tensor / the rotated keys (only those tokens' rows in a decode-only step).
    Calls `_rope_serves` declines run the original. Needs a GPU and Triton (tests: Triton's interpreter); applied by
    the dynamic engine (`inference.dynamic.DECODE_ROPE`). Multi-latent attention's calls (DeepSeek) likewise through
    `decode_rope.mla_rope` where `_mla_rope_serves` (`decode_rope.MLA_ROPE`): in place as the original writes
    back, except a decode-only step's keys, which the original returns as a new tensor."""
    if not _gpu_with_triton():
        return None
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    from megatron_patch.inference.decode_rope import mla_rope, rope_

    query_original = DynamicInferenceContext.apply_rotary_emb_query
    key_original = DynamicInferenceContext.apply_rotary_emb_key

    @functools.wraps(query_original)
    def apply_rotary_emb_query(self, query, query_emb, config, cu_seqlens_q, cp_group, mscale=1.0):
        n = self.padded_active_token_count
        positions = self.gpu_view.token_to_pos_ids[:n]
        if _mla_rope_serves(query[:n], query_emb, config, cu_seqlens_q, cp_group):
            mla_rope(query[:n], query_emb, positions, mscale)
        elif _rope_serves(query[:n], query_emb, config, cu_seqlens_q, mscale, cp_group):
            rope_(query[:n], query_emb, positions)
        else:
            return query_original(self, query, query_emb, config, cu_seqlens_q, cp_group, mscale=mscale)
        return query

    @functools.wraps(key_original)
    def apply_rotary_emb_key(self, key, key_emb, config, cp_group, mscale=1.0):
        n = self.padded_active_token_count
        decode_only = self.is_decode_only()
        positions = self.gpu_view.token_to_position_in_request[:n]
        if decode_only and key.shape[0] != n:
            return key_original(self, key, key_emb, config, cp_group, mscale=mscale)
        if _mla_rope_serves(key[:n], key_emb, config, None, cp_group):
            if decode_only:  # (the original returns new rows)
                return mla_rope(key[:n], key_emb, positions, mscale, out=torch.empty_like(key[:n]))
            mla_rope(key[:n], key_emb, positions, mscale)
            return key
        if not _rope_serves(key[:n], key_emb, config, None, mscale, cp_group):
            return key_original(self, key, key_emb, config, cp_group, mscale=mscale)
        rope_(key[:n], key_emb, positions)
        return key[:n] if decode_only else key

    return _swap([(DynamicInferenceContext, "apply_rotary_emb_query", apply_rotary_emb_query),
                  (DynamicInferenceContext, "apply_rotary_emb_key", apply_rotary_emb_key)])


@register("sampling_without_stream_sync", ">=0.18.2,<0.20")
def _sampling_without_stream_sync() -> Callable[[], None] | None:
    """The dynamic engine's sampling without a stream synchronisation per step, so that asynchronous scheduling
    overlaps the host's work for step k+1 with the GPU's step k as it means to.

    `TorchSampling.sample_kernel` (`megatron/core/inference/sampling/torch_sampling.py`, 0.18.2 to 0.19.x) groups
    the active requests by (temperature, top_k, top_p) and makes each group's row indices with
    `torch.tensor(indices, device=cuda)`: a blocking host-to-device copy, which waits for everything queued on
    the stream, i.e. the whole decode step in flight (8B, one request: 5.1 ms of the host's 5.4 ms a step inside
    that call; then the GPU waits ~0.5-1 ms for the host's next step; docs/benchmarks.md, issue 27). When every
    active request samples alike (one group: greedy, or one setting for the whole call, which is what
    `megatron_patch.inference.generate` submits) the group is the active rows 0..a-1: this wrapper samples
    `logits[:a]` with the same `sample_from_logits` call (the same generator draws) and writes `output[:a]`, which
    is what the original computes, without the index tensor. Several groups, the speculative path
    (`token_to_request_index`) and positional extras run the original. Applied by the dynamic engine
    (`inference.dynamic.SAMPLING_NO_SYNC`)."""
    try:
        from megatron.core.inference.sampling import torch_sampling
    except ImportError:
        return None
    sampler = torch_sampling.TorchSampling
    original = sampler.sample_kernel

    @functools.wraps(original)
    def sample_kernel(self, logits, n, context, *args, **kwargs):
        gather, output = kwargs.get("gather_indices"), kwargs.get("output")
        active = context.total_request_count - context.paused_request_count
        if args or kwargs.get("token_to_request_index") is not None or not 0 < active <= n:
            return original(self, logits, n, context, *args, **kwargs)
        md = context.active_request_metadata
        groups = set(zip(md["temperature"][:active].tolist(), md["top_k"][:active].tolist(),
                         md["top_p"][:active].tolist()))
        if len(groups) != 1:
            return original(self, logits, n, context, *args, **kwargs)
        (temperature, top_k, top_p), = groups
        if gather is not None:
            logits = logits[gather[:n], :]
        tokens = sampler.sample_from_logits(logits[:active], temperature, top_k, top_p, generator=self._rng,
                                            vocab_size=self._vocab_size)
        if output is None:
            output = torch.empty(n, device=logits.device, dtype=torch.int64)
        output[:active] = tokens
        return output

    return _swap([(sampler, "sample_kernel", sample_kernel)])


@register("lean_cross_entropy", ">=0.18.2,<0.20")
def _lean_cross_entropy() -> Callable[[], None] | None:
    """The language-model loss's fused cross-entropy without an fp32 copy of the logits (`--lean-cross-entropy`).

    `LanguageModule.compute_language_model_loss` (`megatron/core/models/common/language_module/language_module.py`,
    0.18.2 to 0.19.x) calls the module-level name `fused_vocab_parallel_cross_entropy(logits, labels, tp_group)`
    under `--cross-entropy-loss-fusion --cross-entropy-fusion-impl native`; it casts the [s, b, V] logits to fp32
    and keeps that softmax for the backward (3.9 GiB at seq 8192 and a 128k vocabulary, at the step's memory
    peak). This binds the name to `training.cross_entropy.lean_vocab_parallel_cross_entropy` (same arguments, same
    loss up to fp32 rounding; it keeps the logits as they are and recomputes the softmax in the backward). Every
    caller of `compute_language_model_loss` (GPTModel, HybridModel, multi-token prediction) goes through it.
    Applied by the training entry points when `--lean-cross-entropy` is on (`training.run`): given, or set by the
    default and benchmark throughput profiles (`training.profiles`)."""
    try:
        from megatron.core.models.common.language_module import language_module
    except ImportError:
        return None
    if not hasattr(language_module, "fused_vocab_parallel_cross_entropy"):
        return None
    from megatron_patch.training.cross_entropy import lean_vocab_parallel_cross_entropy

    return _swap([(language_module, "fused_vocab_parallel_cross_entropy", lean_vocab_parallel_cross_entropy)])


@register("first_log_interval_reset", ">=0.18.2,<0.20")
def _first_log_interval_reset() -> Callable[[], None] | None:
    """Each logged iteration's loss is that interval's own when a process's first iteration ends a log interval.

    `megatron.training.training.training_log` (0.18.2 to 0.19.x) always prints a process's first iteration
    (`is_first_iteration`) and then keeps its loss sums, iteration counts and interval timer (`should_reset`
    False) so that the interval it began is averaged whole. When that first iteration itself ends an interval
    (`iteration % --log-interval == 0`: every start and resume at `--log-interval 1`, the default of our
    launchers and tests), the next line averages it in again: the second iteration after a start or a resume
    logged the mean of two iterations' losses and times (NVIDIA/Megatron-LM issue #6237; on an H100 on
    2026-12-07 a resumed run's iteration 4 logged 6.727700, the mean of iterations 3 and 4, 6.796119 and
    6.659282). This calls `training_log` as for any other iteration there (`is_first_iteration=False`), so the
    accumulators are reset as at every interval's end; a first iteration inside an interval is left to
    Megatron. `train` looks `training_log` up in its module at each call, so binding the name serves it.
    Applied by the training entry points (`training.run`)."""
    import inspect

    try:
        from megatron.training import training
    except ImportError:
        return None
    original = getattr(training, "training_log", None)
    if original is None:
        return None
    signature = inspect.signature(original)
    if not {"is_first_iteration", "iteration"} <= set(signature.parameters):
        return None

    @functools.wraps(original)
    def training_log(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("is_first_iteration"):
            from megatron.training import get_args

            if bound.arguments["iteration"] % get_args().log_interval == 0:
                bound.arguments["is_first_iteration"] = False
        return original(*bound.args, **bound.kwargs)

    return _swap([(training, "training_log", training_log)])


@register("apex_free_wgrad_fusion", ">=0.18.2,<0.20")
def _apex_free_wgrad_fusion() -> Callable[[], None] | None:
    """Weight-gradient accumulation fusion for megatron-core's own linear layers without Apex
    (`--wgrad-fusion-without-apex`).

    `megatron/core/tensor_parallel/layers.py` (0.18.2 to 0.19.x) imports Apex's `fused_weight_gradient_mlp_cuda` at
    import time, refuses `gradient_accumulation_fusion` in `ColumnParallelLinear` / `RowParallelLinear` when it is
    missing (`_grad_accum_fusion_available`), and in the backward of
    `LinearWithGradAccumulationAndAsyncCommunication` calls its `wgrad_gemm_accum_fp32` / `_fp16(total_input,
    grad_output, weight.main_grad)` by that module-level name (`core/utils.py`'s deferred embedding wgrad imports it
    by name). This binds the name to `training.wgrad.WgradAccumulation` (main_grad += dyᵀ·x in the GEMM), marks the
    fusion available, and registers it as that module for the import by name. `VocabParallelEmbedding.forward`
    looks the word embedding up through the module's `F` (`torch.nn.functional`; the module's only use of it):
    bound to `training.wgrad.FUNCTIONAL`, whose `embedding` scatters the gradient's rows into `main_grad`. Not
    applied where Apex is installed. Applied by the training entry points when `--wgrad-fusion-without-apex` is on
    (`training.run`)."""
    import importlib.machinery
    import sys

    name = "fused_weight_gradient_mlp_cuda"
    if name not in sys.modules and importlib.util.find_spec(name) is not None:
        return None  # Apex: megatron-core uses it itself
    try:
        from megatron.core.tensor_parallel import layers
    except ImportError:
        return None
    if not hasattr(layers, "_grad_accum_fusion_available") or getattr(layers, "F", None) is not torch.nn.functional:
        return None
    from megatron_patch.training.wgrad import FUNCTIONAL, WgradAccumulation

    module = types.ModuleType(name, "megatron_patch.training.wgrad.WgradAccumulation in place of Apex's extension")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.wgrad_gemm_accum_fp32 = WgradAccumulation.wgrad_gemm_accum_fp32
    module.wgrad_gemm_accum_fp16 = WgradAccumulation.wgrad_gemm_accum_fp16
    missing = object()
    before = sys.modules.get(name, missing), getattr(layers, name, missing), layers._grad_accum_fusion_available
    sys.modules[name] = module
    layers.fused_weight_gradient_mlp_cuda, layers._grad_accum_fusion_available = module, True
    layers.F = FUNCTIONAL

    def undo() -> None:
        layers.F = torch.nn.functional
        in_sys, in_layers, available = before
        if in_sys is missing:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = in_sys
        if in_layers is missing:
            delattr(layers, name)
        else:
            layers.fused_weight_gradient_mlp_cuda = in_layers
        layers._grad_accum_fusion_available = available

    return undo


@register("fp8_output_layer", ">=0.19,<0.20")
def _fp8_output_layer() -> Callable[[], None] | None:
    """The output layer's GEMMs in FP8 under any recipe (`--fp8-output-layer`), not only MXFP8.

    megatron-core 0.19 builds the language model's output layer as `TELMHeadColumnParallelLinear` (Transformer
    Engine's column-parallel linear, run under `get_fp8_context(config)`) where
    `fp8_utils.is_mxfp8_output_proj_active(config)` holds: `config.fp8_output_proj`, fp8 on, and the recipe MXFP8
    (Blackwell's); otherwise megatron-core's bf16 `ColumnParallelLinear` (`models/gpt/gpt_model.py`, which imports
    the name, and the layer's own `__init__`, which imports it from `fp8_utils` when called). This binds both names
    to a test without the recipe condition, so on Hopper the delayed, tensorwise and blockwise recipes run the
    output layer in FP8 too (its three GEMMs were 22% of an 8B fp8 step in the profile of 2026-12-05).
    `TransformerConfig.__post_init__` refuses `fp8_output_proj` with another recipe, so `training.model` sets the
    field on the built config. Applied by the training entry points when `--fp8-output-layer` is on."""
    try:
        from megatron.core import fp8_utils
        from megatron.core.models.gpt import gpt_model
    except ImportError:
        return None
    if not (hasattr(fp8_utils, "is_mxfp8_output_proj_active") and hasattr(gpt_model, "is_mxfp8_output_proj_active")
            and hasattr(gpt_model, "TELMHeadColumnParallelLinear")):
        return None

    def output_proj_in_fp8(config) -> bool:
        return bool(getattr(fp8_utils, "HAVE_TE", False) and getattr(config, "fp8_output_proj", False)
                    and getattr(config, "fp8", None))

    return _swap([(fp8_utils, "is_mxfp8_output_proj_active", output_proj_in_fp8),
                  (gpt_model, "is_mxfp8_output_proj_active", output_proj_in_fp8)])
