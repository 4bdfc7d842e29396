"""What the dynamic inference engine needs on an H200 (issue 27), checked on a CPU: the `fa4_no_split_kv_on_sm90`
patch (megatron-core's FA4 call with `num_splits=1` on compute capability 9.x only) and a new CUDA-graph manager
for every engine (`dynamic.set_inference_cuda_graphs`: a manager kept across engines replays the next engine's
calls against the old engine's arguments, `CUDA graph argument mismatch`)."""

import types

import pytest
import torch

from megatron_patch import patches

PATCH = "fa4_no_split_kv_on_sm90"


class _Recorder:
    """Stands in for FA4's `flash_attn_varlen_func`: records its keyword arguments, returns (out, lse)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, **kwargs):
        self.calls.append(kwargs)
        return torch.zeros_like(q), torch.zeros(q.shape[-2], q.shape[0])


@pytest.fixture
def fa4(monkeypatch):
    """megatron-core's attention module as if FA4 were installed, its kernel a recorder; the patch not active."""
    from megatron.core.transformer import attention

    if not patches.covers(PATCH):
        pytest.skip(f"{PATCH} does not cover megatron-core {compat_version()}")
    recorder = _Recorder()
    monkeypatch.setattr(attention, "HAVE_FA4", True)
    monkeypatch.setattr(attention, "flash_attn4_varlen_func", recorder, raising=False)
    monkeypatch.delitem(patches._ACTIVE, PATCH, raising=False)
    yield attention, recorder
    patches.revert(PATCH)


def compat_version():
    from megatron_patch import compat

    return compat.megatron_core_version()


def _attention_inputs(decode_only: bool) -> tuple:
    """`flash_decode_and_prefill`'s arguments after `self`: 2 requests, 8 query heads over 2 KV heads, head dim
    16, pages of 256 tokens; decode: one query each, prefill: 5 and 2."""
    q = torch.randn(2 if decode_only else 7, 1, 8, 16)
    k = v = torch.randn(3, 256, 2, 16)
    return (q, k, v, 1 if decode_only else 5, 300, torch.tensor([0, 1, 2] if decode_only else [0, 5, 7]), None,
            torch.tensor([300, 40]), torch.tensor([[0, 1], [2, -1]]), decode_only)


def _megatron_attention_call(attention, inputs: tuple) -> None:
    """megatron-core's own `Attention.flash_decode_and_prefill` (the FA4 call site) on a stand-in layer."""
    layer = types.SimpleNamespace(
        training=False, batch_invariant_mode=False, layer_number=1,
        config=types.SimpleNamespace(window_size=None, window_attn_skip_freq=None),
        _resolve_flash_version=lambda: (True, False))
    out = attention.Attention.flash_decode_and_prefill(layer, *inputs)
    assert out.shape == inputs[0].shape


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode", "prefill"])
def test_megatron_asks_fa4_to_choose_its_splits_and_the_patch_makes_it_one_on_sm90(fa4, monkeypatch, decode_only):
    """megatron-core 0.19 passes FA4 `num_splits=0` ("choose"; FA4 then splits long KV on SM90, where it has no
    split-KV kernel); under the patch, on a GPU of compute capability 9.0, FA4 receives 1 and every other
    argument as megatron-core passed it."""
    attention, recorder = fa4
    inputs = _attention_inputs(decode_only)
    _megatron_attention_call(attention, inputs)
    assert recorder.calls[-1]["num_splits"] == 0
    monkeypatch.setattr(patches, "_cuda_capability", lambda: (9, 0))
    with patches.applied(PATCH) as active:
        assert active
        _megatron_attention_call(attention, inputs)
    unpatched, patched = recorder.calls
    assert patched["num_splits"] == 1 and patched.keys() == unpatched.keys()
    for key in unpatched.keys() - {"num_splits"}:
        assert patched[key] is unpatched[key] or patched[key] == unpatched[key], key
    assert attention.flash_attn4_varlen_func is recorder


def test_fa4_no_split_kv_on_sm90_apply_twice_and_undo(fa4, monkeypatch):
    attention, recorder = fa4
    monkeypatch.setattr(patches, "_cuda_capability", lambda: (9, 0))
    assert patches.apply(PATCH) and patches.apply(PATCH) and patches.is_active(PATCH)
    wrapped = attention.flash_attn4_varlen_func
    assert wrapped is not recorder and wrapped.__wrapped__ is recorder
    q = torch.zeros(4, 8, 16)
    wrapped(q, q, q, num_splits=0, causal=True)
    wrapped(q, q, q)
    wrapped(q, q, q, num_splits=3)
    assert [c["num_splits"] for c in recorder.calls] == [1, 1, 1] and recorder.calls[0]["causal"] is True
    patches.revert(PATCH)
    assert attention.flash_attn4_varlen_func is recorder and not patches.is_active(PATCH)
    patches.revert(PATCH)  # (a second undo does nothing)
    assert attention.flash_attn4_varlen_func is recorder


@pytest.mark.parametrize("capability", [None, (8, 0), (10, 0), (12, 0)], ids=["no-gpu", "sm80", "sm100", "sm120"])
def test_fa4_no_split_kv_on_sm90_does_nothing_off_hopper(fa4, monkeypatch, capability):
    """Without a GPU, and on GPUs other than 9.x (Blackwell splits the KV itself), megatron-core's call is left
    as it is."""
    attention, recorder = fa4
    monkeypatch.setattr(patches, "_cuda_capability", lambda: capability)
    with patches.applied(PATCH) as active:
        assert not active
        assert attention.flash_attn4_varlen_func is recorder
        q = torch.zeros(4, 8, 16)
        attention.flash_attn4_varlen_func(q, q, q, num_splits=0)
    assert recorder.calls == [{"num_splits": 0}]


def test_fa4_no_split_kv_on_sm90_needs_fa4(fa4, monkeypatch):
    """Where megatron-core did not pick FA4 (FA3 / FA2 / the torch fallback), nothing is patched."""
    attention, recorder = fa4
    monkeypatch.setattr(attention, "HAVE_FA4", False)
    monkeypatch.setattr(patches, "_cuda_capability", lambda: (9, 0))
    assert not patches.apply(PATCH) and attention.flash_attn4_varlen_func is recorder


# ---- CUDA graphs: one manager per engine -------------------------------------------------------------------


class _Manager:
    """Stands in for megatron-core's `CudaGraphManager` (which needs a GPU to build): remembers how it was made."""

    made = []

    def __init__(self, config, need_backward=True, **kwargs):
        self.config, self.need_backward, self.runners = config, need_backward, {}
        _Manager.made.append(self)


def _model_with_blocks(n: int = 2):
    """A module holding `n` decoder blocks (empty `TransformerBlock`s) and a config without CUDA graphs."""
    from megatron.core.transformer.enums import InferenceCudaGraphScope
    from megatron.core.transformer.transformer_block import TransformerBlock

    model = torch.nn.Module()
    for i in range(n):
        block = TransformerBlock.__new__(TransformerBlock)
        torch.nn.Module.__init__(block)
        model.add_module(f"block{i}", block)
    model.config = types.SimpleNamespace(cuda_graph_impl="none",
                                         inference_cuda_graph_scope=InferenceCudaGraphScope.none)
    return model


def _blocks(model):
    from megatron.core.transformer.transformer_block import TransformerBlock

    return [m for m in model.modules() if isinstance(m, TransformerBlock)]


def test_every_engine_gets_new_cuda_graph_managers_and_release_drops_them(monkeypatch):
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.enums import InferenceCudaGraphScope

    from megatron_patch.inference import dynamic

    deleted = []
    monkeypatch.setattr(cuda_graphs, "CudaGraphManager", _Manager)
    monkeypatch.setattr(cuda_graphs, "delete_cuda_graphs", lambda: deleted.append(True))
    _Manager.made = []
    model = _model_with_blocks()
    dynamic.set_inference_cuda_graphs(model, True)
    assert (model.config.cuda_graph_impl, model.config.inference_cuda_graph_scope) == (
        "local", InferenceCudaGraphScope.block)
    first = [b.cudagraph_manager for b in _blocks(model)]
    assert first == _Manager.made and all(not m.need_backward for m in first)
    dynamic.set_inference_cuda_graphs(model, True)  # the next engine: none of the old runners
    assert all(b.cudagraph_manager not in first for b in _blocks(model)) and len(_Manager.made) == 4
    dynamic.drop_inference_cuda_graphs(model)
    assert deleted == [True] and not any(hasattr(b, "cudagraph_manager") for b in _blocks(model))
    dynamic.set_inference_cuda_graphs(model, True)
    dynamic.set_inference_cuda_graphs(model, False)
    assert model.config.cuda_graph_impl == "none" and not any(hasattr(b, "cudagraph_manager") for b in _blocks(model))


def test_a_failed_engine_build_drops_its_half_captured_graphs(monkeypatch):
    """An engine whose capture raised (FA4's SplitKV assertion was one) leaves no runners for the next engine."""
    from megatron.core.transformer import cuda_graphs

    from megatron_patch.inference import dynamic

    deleted = []
    monkeypatch.setattr(cuda_graphs, "CudaGraphManager", _Manager)
    monkeypatch.setattr(cuda_graphs, "delete_cuda_graphs", lambda: deleted.append(True))
    model = _model_with_blocks()

    def failing_build(model, tokenizer, plan):
        dynamic.set_inference_cuda_graphs(model, plan.cuda_graphs)
        raise AssertionError("SplitKV not supported on SM 9.0")

    monkeypatch.setattr(dynamic, "_build_engine", failing_build)
    plan = dynamic.EnginePlan(max_requests=1, bounded=False, max_sequence_length=8, max_tokens=16, kv_cache_gb=0.1,
                              cuda_graphs=True, non_decode_graphs=True)
    dynamic._Engines.release()
    with pytest.raises(AssertionError, match="SplitKV"):
        dynamic._Engines.get(model, None, plan)
    assert deleted == [True] and not any(hasattr(b, "cudagraph_manager") for b in _blocks(model))
    assert dynamic._Engines.engine is None


def test_a_runner_kept_from_another_engine_reports_an_argument_mismatch():
    """The failure the new managers avoid, in megatron-core's own check: a runner made with one engine's
    context and rotary table, called with another engine's (same batch dimensions, so the same key)."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.transformer.cuda_graphs import ArgMetadata, _CudaGraphRunner

    def kwargs(context, max_sequence_length):
        return {"hidden_states": torch.zeros(4, 1, 8), "attention_mask": None, "inference_context": context,
                "rotary_pos_emb": torch.zeros(max_sequence_length, 1, 1, 16)}

    old, new = (object.__new__(DynamicInferenceContext) for _ in range(2))
    runner = _CudaGraphRunner.__new__(_CudaGraphRunner)
    runner.fwd_graph_input_arg_metas = []
    runner.fwd_graph_input_kwarg_metas = {k: ArgMetadata(a) for k, a in kwargs(old, 1280).items()}
    assert runner.get_mismatch_errors((), kwargs(old, 1280)) == []
    errors = "\n".join(runner.get_mismatch_errors((), kwargs(new, 1024)))
    assert "Value mismatch at kwargs['inference_context']" in errors
    assert "Tensor mismatch at kwargs['rotary_pos_emb']" in errors


def test_the_engine_probe_shows_its_help_on_a_cpu():
    """benchmarks/engine_probe.py (the GPU probe of this engine) imports and explains itself without a GPU."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "engine_probe.py"), "--help"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--profile DIR" in p.stdout and "--graphs" in p.stdout
