"""The `te_fa4_causal_window` patch (issue 28), checked on a CPU: Transformer Engine's FlashAttention backend
calls FlashAttention-4 with TE's causal window `(-1, 0)`; FA4 4.0.0b36 reads -1 as an offset, so every row
attends to nothing and the output is zero. A stand-in TE module holds the names TE's backend calls, with a
stand-in FA4 of FA4's window semantics in torch; the GPU suite runs the real pair (tests/gpu)."""

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from megatron_patch import patches

PATCH = "te_fa4_causal_window"


def fa4_attention(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), **kwargs):
    """FlashAttention-4's `flash_attn_func` on bshd tensors as its interface resolves a window (4.0.0b36): a
    side that is None is unbounded, an int bounds query i's keys to [i - left, i + right] (a negative one
    included); both sides negative is FA2's "no window"; `causal` sets the right side to 0. A row without keys
    gives zeros."""
    left, right = window_size
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    s = q.shape[1]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = torch.ones(s, s, dtype=torch.bool)
    if left is not None:
        allowed &= j >= i - left
    if right is not None:
        allowed &= j <= i + right
    scores = torch.einsum("bshd,bthd->bhst", q, k) * (softmax_scale or q.shape[-1] ** -0.5)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhst,bthd->bshd", probs, v), None


class _Recorder:
    def __init__(self, fn=fa4_attention):
        self.calls, self.fn = [], fn

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)
        return self.fn(*args, **kwargs)


# How TE's `FlashAttention.forward` calls FA4 for a causal bshd/sbhd input without padding (2.20.x): the module
# name looked up at call time, window_size=(-1, 0) from `check_set_window_size`.
TE_CALL = """
def te_causal_call(q, k, v):
    return flash_attn_func_v4(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=True, window_size=(-1, 0),
                              num_splits=1, deterministic=False)[0]
"""


@pytest.fixture
def te(monkeypatch):
    """Transformer Engine's backends module as if TE had found FA4, its FA4 names recorders of the stand-in."""
    from megatron_patch import compat

    compat.megatron_core_version()  # megatron-core imported first: it probes for TE on import
    names = patches.TE_FLASH_BACKENDS.split(".")
    for n in range(1, len(names) + 1):
        module = types.ModuleType(".".join(names[:n]))
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        monkeypatch.setitem(sys.modules, module.__name__, module)
    backends = sys.modules[patches.TE_FLASH_BACKENDS]
    for name in patches.TE_FA4_NAMES:
        setattr(backends, name, _Recorder())
    exec(TE_CALL, backends.__dict__)
    monkeypatch.delitem(patches._ACTIVE, PATCH, raising=False)
    yield backends
    patches.revert(PATCH)


def _qkv(s=12):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, s, 3, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def test_fa4_window_maps_te_unbounded_sides_to_none():
    assert patches.fa4_window((-1, 0)) == (None, 0)  # causal
    assert patches.fa4_window((-1, -1)) == (None, None)  # no window
    assert patches.fa4_window((4095, 0)) == (4095, 0)  # a sliding window (Mistral)
    assert patches.fa4_window((None, None)) == (None, None) and patches.fa4_window(None) is None


def test_te_causal_call_attends_to_nothing_and_the_patch_makes_it_causal(te):
    """TE's causal call reaches FA4 with (-1, 0): every output row is zero (TE issue #3528). Under the patch the
    same call reaches FA4 with (None, 0) and gives causal attention (torch's SDPA, float64), every other argument
    as TE passed it."""
    q, k, v = _qkv()
    causal = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
    broken = te.te_causal_call(q, k, v)
    assert broken.abs().max() == 0
    with patches.applied(PATCH) as active:
        assert active
        fixed = te.te_causal_call(q, k, v)
    torch.testing.assert_close(fixed, causal, rtol=1e-12, atol=1e-12)
    recorder = te.flash_attn_func_v4
    (unpatched, patched) = recorder.calls
    assert unpatched["window_size"] == (-1, 0) and patched["window_size"] == (None, 0)
    assert {k: v for k, v in patched.items() if k != "window_size"} == {
        k: v for k, v in unpatched.items() if k != "window_size"}


def test_te_fa4_causal_window_keeps_sliding_windows_apply_twice_and_undo(te):
    recorder, varlen = te.flash_attn_func_v4, te.flash_attn_varlen_func_v4
    assert patches.apply(PATCH) and patches.apply(PATCH) and patches.is_active(PATCH)
    assert te.flash_attn_func_v4.__wrapped__ is recorder and te.flash_attn_varlen_func_v4.__wrapped__ is varlen
    q, k, v = _qkv()
    te.flash_attn_func_v4(q, k, v, causal=True, window_size=(3, 0))
    te.flash_attn_func_v4(q, k, v, causal=False, window_size=(-1, -1))
    te.flash_attn_func_v4(q, k, v, causal=True)  # no window argument: none added
    te.flash_attn_varlen_func_v4(q, k, v, causal=True, window_size=(-1, 0), cu_seqlens_q=None)
    assert [c.get("window_size", "absent") for c in recorder.calls] == [(3, 0), (None, None), "absent"]
    assert varlen.calls[0]["window_size"] == (None, 0) and "cu_seqlens_q" in varlen.calls[0]
    # context parallelism's raw calls (TE imports them from the module when it runs): the two sides apart
    raw = {name: getattr(te, name).__wrapped__ for name in ("_flash_attn_fwd_v4", "_flash_attn_bwd_v4")}
    te._flash_attn_fwd_v4(q, k, v, causal=True, window_size_left=-1, window_size_right=0, return_lse=True)
    te._flash_attn_bwd_v4(q, k, v, causal=False, window_size_left=-1, window_size_right=-1)
    te._flash_attn_fwd_v4(q, k, v, causal=False, window_size_left=5, window_size_right=2)
    fwd, bwd = raw["_flash_attn_fwd_v4"].calls, raw["_flash_attn_bwd_v4"].calls
    assert [(c["window_size_left"], c["window_size_right"]) for c in fwd + bwd] == [(None, 0), (5, 2), (None, None)]
    assert fwd[0]["return_lse"] is True
    patches.revert(PATCH)
    assert te.flash_attn_func_v4 is recorder and te.flash_attn_varlen_func_v4 is varlen
    assert all(getattr(te, name) is fn for name, fn in raw.items())
    patches.revert(PATCH)  # (a second undo does nothing)
    assert te.flash_attn_func_v4 is recorder and not patches.is_active(PATCH)


def test_te_fa4_causal_window_needs_te_with_fa4(te, monkeypatch):
    """Where TE found no FA4 (its names are None) or TE is not installed, nothing is patched."""
    for name in patches.TE_FA4_NAMES:
        setattr(te, name, None)
    assert not patches.apply(PATCH) and te.flash_attn_func_v4 is None
    monkeypatch.setattr(patches.importlib.util, "find_spec", lambda name, *a: None)
    assert not patches.apply(PATCH) and not patches.is_active(PATCH)


def test_building_a_model_applies_the_patch(te):
    """`model_class_parts`, which `build_model` and the training model provider both call, applies it."""
    from megatron_patch.models.build import model_class_parts

    recorder = te.flash_attn_func_v4
    model_class_parts("gpt")
    assert patches.is_active(PATCH) and te.flash_attn_func_v4.__wrapped__ is recorder
