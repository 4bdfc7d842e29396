"""The one place where megatron_patch differs by megatron-core version.

We support the megatron-core releases in `SUPPORTED` (setup.py's range) and test the oldest and the newest
of them (`TESTED`; docs/upgrading.md). Code that needs version-specific behaviour asks a function here,
never `megatron.core.package_info` itself; each function says which versions differ and how. Runtime
patches of megatron-core are not here: they live in `megatron_patch/patches.py`, each with its own range.
"""

from __future__ import annotations

import functools

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# setup.py's install_requires carries the same range (tests/unit/test_compat.py checks they agree)
SUPPORTED = SpecifierSet(">=0.18.2,<0.20")
# the oldest and the newest supported release, both run by .ci/run (make test-oldest, make test)
TESTED = ("0.18.2", "0.19.2")


@functools.cache
def megatron_core_version() -> Version:
    """The installed megatron-core's version."""
    from megatron.core.package_info import __version__

    return Version(__version__)


def at_least(version: str) -> bool:
    """Whether the installed megatron-core is `version` or newer."""
    return megatron_core_version() >= Version(version)


def require_hybrid_model() -> None:
    """megatron-core's `HybridModel` (`megatron/core/models/hybrid/`) and its GPT checkpoint interop
    (`dist_checkpointing/gpt_checkpoint_interop.py`) are new in 0.19; 0.18 has neither."""
    if not at_least("0.19"):
        raise UnsupportedVersion(f"building a HybridModel needs megatron-core >= 0.19 (installed: "
                                 f"{megatron_core_version()}); build the GPTModel instead (--model-class gpt)")


def async_scheduling_available() -> bool:
    """The dynamic inference engine's asynchronous step scheduling (`InferenceConfig.async_sched_mode`) is new
    in megatron-core 0.19; 0.18's engine schedules each step after the last one resolved."""
    import dataclasses

    from megatron.core.inference.config import InferenceConfig

    return any(f.name == "async_sched_mode" for f in dataclasses.fields(InferenceConfig))


class UnsupportedVersion(RuntimeError):
    """The installed megatron-core lacks what was asked for."""


def torch_dist_common_state_inline() -> bool:
    """Where a torch_dist checkpoint keeps its common (non-sharded) state — iteration, args, version:
    from 0.19 inside the torch.distributed.checkpoint files, as the ShardedObject "common_state"
    (`dist_checkpointing/serialization.py`, `save`), and 0.19 still reads the older place too; 0.18 only in
    a `common.pt` file beside them (`dist_checkpointing/strategies/common.py`, `save_common` / `load_common`).
    The converter writes the installed release's layout; megatron-core 0.18 cannot load a checkpoint written
    under 0.19, but our converter reads both (`load_torch_dist_common`)."""
    return at_least("0.19")


def load_torch_dist_common(checkpoint_dir: str) -> dict:
    """A torch_dist checkpoint's common state, in either place (`torch_dist_common_state_inline`), under any
    supported release: 0.19's `dist_checkpointing.load_common_state_dict` reads both, 0.18's only `common.pt`;
    the inline object is read here as 0.19 reads it. With this our converter and `verify` under 0.18 read a
    checkpoint written under 0.19 (megatron.training's `--load` under 0.18 still cannot)."""
    import io
    import os

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    if at_least("0.19") or os.path.exists(os.path.join(checkpoint_dir, COMMON_STATE_FNAME)):
        return dist_checkpointing.load_common_state_dict(checkpoint_dir)
    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    state = {key: io.BytesIO()}
    dcp_load(state, storage_reader=FileSystemReader(checkpoint_dir), no_dist=True)
    data = state[key]
    if isinstance(data, io.BytesIO):
        data.seek(0)
        data = torch.load(data, weights_only=True)
    return data[0]  # megatron-core stores a ShardedObject's data as torch.save([data])
