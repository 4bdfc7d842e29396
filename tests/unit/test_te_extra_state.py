"""The `te_extra_state_safe_load` patch, checked on a CPU: Transformer Engine 2.20 refuses to unpickle the FP8
delayed-scaling state it saved (a checkpoint of a `--fp8-recipe delayed` run could not be resumed: the FP8
convergence run of 2026-12-04). Stand-ins of TE's recipe module (the classes a DelayedScaling pickle names) and
of `module/base.py` (its check and `set_extra_state`'s flow, as in TE 2.20.2) hold a payload made as TE's
`get_extra_state` makes it; the GPU suite runs the real TE (tests/gpu/test_te.py)."""

import enum
import importlib.machinery
import io
import os
import pickle
import sys
import types
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch

from megatron_patch import patches

PATCH = "te_extra_state_safe_load"
RECIPE = "transformer_engine.common.recipe"  # where TE's recipe classes live (megatron-core's allow-list names it)


def _stand_in_recipe_module() -> types.ModuleType:
    """TE's `transformer_engine.common.recipe` as far as a DelayedScaling pickle names it (2.20.2)."""
    m = types.ModuleType(RECIPE)

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(enum.Enum):
        E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
        HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)

    @dataclass(repr=False)
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"
        reduce_amax: bool = True

    for cls in (_FormatHelper, Format, DelayedScaling):
        cls.__module__ = m.__name__
        cls.__qualname__ = cls.__name__
        setattr(m, cls.__name__, cls)
    return m


# TE 2.20.2's flow: `should_load_extra_state_pickle` (from `_extra_state.py`, imported into base) raises where a
# payload names globals and NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE is not 1; `set_extra_state` then unpickles
BASE = '''
import os, pickle
def should_load_extra_state_pickle(data, context):
    if not data:
        return False
    if os.getenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "0") == "1":
        return True
    raise RuntimeError(f"Refusing to load pickled Transformer Engine extra state for {context}.")
def set_extra_state(state, context="TERowParallelLinear"):
    state_bytes = state.detach().cpu().numpy().tobytes()
    if not should_load_extra_state_pickle(state_bytes, context):
        return None
    return pickle.loads(state_bytes)
'''


@pytest.fixture
def te(monkeypatch):
    """Stand-in TE modules in sys.modules: the recipe module and `module/base.py`; the patch not applied."""
    from megatron_patch import compat

    compat.megatron_core_version()  # megatron-core imported first: it probes for TE on import
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
    base_name = patches.TE_EXTRA_STATE_MODULES[0]
    for full in (RECIPE, base_name):
        names = full.split(".")
        for n in range(1, len(names) + 1):
            name = ".".join(names[:n])
            if name not in sys.modules or n == len(names):
                module = _stand_in_recipe_module() if name == RECIPE else types.ModuleType(name)
                module.__spec__ = importlib.machinery.ModuleSpec(name, None)
                monkeypatch.setitem(sys.modules, name, module)
    base = sys.modules[base_name]
    exec(BASE, base.__dict__)
    monkeypatch.delitem(patches._ACTIVE, PATCH, raising=False)
    yield types.SimpleNamespace(base=base, recipe=sys.modules[RECIPE])
    patches.revert(PATCH)


def _extra_state(recipe_module, payload=None) -> tuple[torch.Tensor, dict]:
    """A module's extra state as TE's `get_extra_state` makes it for delayed scaling: the pickled dict of the
    recipe, scales and amax histories (CPU copies) and plain fp8_meta values, as a uint8 tensor; and the dict."""
    g = torch.Generator().manual_seed(0)
    state = payload if payload is not None else {
        "recipe": recipe_module.DelayedScaling(margin=1, amax_history_len=16),
        "scale_fwd": torch.rand(3, generator=g), "amax_history_fwd": torch.rand(16, 3, generator=g),
        "scale_bwd": torch.rand(2, generator=g), "amax_history_bwd": torch.rand(16, 2, generator=g),
        "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True, "autocast_key": ("hybrid", 1)}}
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8), state


class _Runs:
    """A pickle that runs `os.system(command)` when loaded."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_delayed_scaling_state_is_refused_by_te_and_loads_under_the_patch(te):
    """Without the patch TE refuses its own delayed-scaling state (the resume failed); with it the state loads:
    the recipe as saved, the scale and amax tensors bit-equal, the plain values unchanged."""
    tensor, saved = _extra_state(te.recipe)
    with pytest.raises(RuntimeError, match="Refusing to load pickled"):
        te.base.set_extra_state(tensor)
    with patches.applied(PATCH) as active:
        assert active
        loaded = te.base.set_extra_state(tensor)
        # TE's own answers stand: an empty state loads nothing
        assert te.base.should_load_extra_state_pickle(b"", "X") is False
    assert loaded["recipe"] == saved["recipe"] and loaded["recipe"].fp8_format is te.recipe.Format.HYBRID
    for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
        assert torch.equal(loaded[key], saved[key]) and loaded[key].dtype == saved[key].dtype
    assert loaded["extra_fp8_variables"] == saved["extra_fp8_variables"]
    assert not patches.is_active(PATCH)


def test_a_payload_that_runs_code_is_refused_without_running(te, tmp_path):
    """A pickle naming anything but tensors, plain containers and TE's recipe classes (here os.system, at the
    top level and hidden in a tensor's storage bytes, which torch's own `_load_from_bytes` would read with
    weights_only=False) is refused with a RuntimeError naming what is at fault; nothing runs."""
    marker = tmp_path / "ran"
    top = {"recipe": te.recipe.DelayedScaling(), "scale_fwd": torch.ones(1), "hook": _Runs(f"touch {marker}")}

    buf = io.BytesIO()
    torch.save(_Runs(f"touch {marker}"), buf)
    # a storage as torch pickles one: `torch.storage._load_from_bytes(<a torch.save file>)`, here one that runs
    # os.system (written opcode by opcode: in this process the name is megatron-core's safe replacement)
    inner = buf.getvalue()
    nested = (b"\x80\x04ctorch.storage\n_load_from_bytes\nB" + len(inner).to_bytes(4, "little") + inner
              + b"\x85R.")
    with patches.applied(PATCH):
        for payload in (top, nested):
            tensor = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if isinstance(payload, bytes)
                      else _extra_state(te.recipe, payload)[0])
            with pytest.raises(RuntimeError, match=r"TERowParallelLinear: .*more than FP8 scaling metadata") as e:
                te.base.set_extra_state(tensor)
            assert not marker.exists()
        assert "Weights only load failed" in str(e.value)  # the storage's torch.save file, read weights-only
    tensor, _ = _extra_state(te.recipe, top)
    with pytest.raises(RuntimeError, match=r"posix.system|nt.system"):
        with patches.applied(PATCH):
            te.base.set_extra_state(tensor)
    assert not marker.exists()


def test_the_patch_applies_twice_and_undoes(te):
    original = te.base.should_load_extra_state_pickle
    assert patches.apply(PATCH) and patches.apply(PATCH)
    assert te.base.should_load_extra_state_pickle is not original
    patches.revert(PATCH)
    assert te.base.should_load_extra_state_pickle is original
