"""The runtime patch registry, its CPU patches (`cpu_cuda_calls`, `cpu_parallel_state`, `cpu_training`,
`paged_attention_in_torch`) and `first_log_interval_reset`."""

import contextlib
import inspect

import pytest
import torch

from megatron_patch import patches


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patch does nothing with CUDA")
def test_cpu_cuda_calls_apply_and_undo():
    from megatron.core.fusions import fused_softmax
    from megatron.core.inference import communication_utils
    from megatron.core.inference.contexts import dynamic_context

    original = fused_softmax.get_sliding_window_causal_mask
    triton_append = dynamic_context.triton_append_key_value_cache
    with patches.applied("cpu_cuda_calls") as active:
        assert active and torch.cuda.current_device() == "cpu"
        mask = fused_softmax.get_sliding_window_causal_mask(6, 6, (2, 0))
        i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
        # HF sliding_window = 3: query i sees keys i-2 .. i
        assert torch.equal(mask, (j > i) | (i - j > 2))
        # tensors megatron-core sends to "cuda" stay on the CPU (the inference controller's buffers)
        assert torch.ones(2).cuda().device.type == "cpu"
        assert torch.ones(2).to("cuda").device.type == "cpu"
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        # the dynamic inference engine: pinned bookkeeping, a copy stream, the Triton KV append, PP broadcasts
        assert not torch.empty(2, pin_memory=True).is_pinned() and torch.ones(2).pin_memory().device.type == "cpu"
        torch.cuda.Stream(device="cpu").wait_stream(None)
        assert dynamic_context.triton_append_key_value_cache is None
        communication_utils._is_cuda(torch.ones(1))
    assert fused_softmax.get_sliding_window_causal_mask is original
    assert dynamic_context.triton_append_key_value_cache is triton_append
    if "cpu_cuda_calls" not in patches._ACTIVE:  # (the CPU test harness keeps it on for good)
        with pytest.raises(RuntimeError):
            torch.ones(2).cuda()
        with pytest.raises(AssertionError):
            communication_utils._is_cuda(torch.ones(1))


# releases around the supported range: a patch's range must not reach past it (0.18.0, 0.20.0, a 1.0)
_PROBES = ("0.17.1", "0.18.0", "0.18.1", "0.18.2", "0.19.0", "0.19.2", "0.19.99", "0.20.0rc1", "0.20.0", "1.0.0")


def test_every_patch_states_why_and_a_tested_range_inside_the_supported_one():
    """Every patch says why it exists and the megatron-core versions it applies to; those lie inside the
    supported range (`compat.SUPPORTED`, setup.py's), and at least one tested release (`compat.TESTED`,
    each run by .ci/run) falls in it, so this file tests it."""
    from packaging.version import Version

    from megatron_patch import compat

    for p in patches.registry().values():
        assert p.why and str(p.versions), p.name
        outside = [v for v in _PROBES if Version(v) in p.versions and Version(v) not in compat.SUPPORTED]
        assert not outside, f"{p.name} ({p.versions}) reaches past the supported range {compat.SUPPORTED}: {outside}"
        assert any(Version(v) in p.versions for v in compat.TESTED), f"{p.name} ({p.versions}) is never tested"


@pytest.mark.parametrize("version", ["0.17.1", "0.18.1", "0.20.0"])
def test_a_patch_is_never_applied_outside_its_range(monkeypatch, version):
    """Under a megatron-core outside a patch's range, asking for the patch (directly, in a block, or as a
    dependency of another: `cpu_training` applies two) does nothing: its code never runs, nothing is
    active, and `apply` answers False."""
    from packaging.version import Version

    from megatron_patch import compat

    monkeypatch.setattr(compat, "megatron_core_version", lambda: Version(version))
    ran = []
    for p in patches.registry().values():
        assert Version(version) not in p.versions, f"{p.name}: pick a probe outside {p.versions}"
        monkeypatch.setattr(p, "apply", lambda name=p.name: ran.append(name))
        monkeypatch.delitem(patches._ACTIVE, p.name, raising=False)  # (the CPU harness may hold some)
    for name in patches.registry():
        assert patches.covers(name) is False
        assert patches.apply(name) is False and not patches.is_active(name)
        with patches.applied(name) as active:
            assert active is False
    assert ran == [] and not any(patches.is_active(n) for n in patches.registry())


def test_require_applies_or_says_which_range_or_seam_is_missing(monkeypatch):
    """`require(name, flag)`: an option that needs a patch applies it, or stops with one line naming the option
    and either the megatron-core range it needs or, inside the range, that the patch found nothing to change."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from megatron_patch import compat

    p = patches.Patch("probe_patch", SpecifierSet(">=0.18.2,<0.20"),
                      "Probe: changes nothing real.\nSecond line.", lambda: None)
    monkeypatch.setitem(patches._REGISTRY, "probe_patch", p)
    monkeypatch.setattr(compat, "megatron_core_version", lambda: Version("0.17.1"))
    assert patches.covers("probe_patch") is False
    with pytest.raises(ValueError, match=r"^--probe needs megatron-core <0\.20,>=0\.18\.2, not 0\.17\.1$"):
        patches.require("probe_patch", "--probe")
    monkeypatch.setattr(compat, "megatron_core_version", lambda: Version("0.19.2"))
    assert patches.covers("probe_patch") is True
    with pytest.raises(ValueError, match=r"^--probe: megatron-core 0\.19\.2 lacks what patch probe_patch changes "
                                         r"\(Probe: changes nothing real\.\)$"):
        patches.require("probe_patch", "--probe")
    undone = []
    monkeypatch.setattr(p, "apply", lambda: lambda: undone.append(1))
    patches.require("probe_patch", "--probe")
    assert patches.is_active("probe_patch")
    patches.revert("probe_patch")
    assert undone == [1] and not patches.is_active("probe_patch")


def test_the_installed_megatron_core_is_supported():
    """The process runs a supported megatron-core (a CI environment with another one fails here), and the
    patches a CPU-only machine needs apply under it (each patch's own test checks what it does;
    `paged_attention_in_torch` applies only without flash-attn, tested below)."""
    from megatron_patch import compat

    assert compat.megatron_core_version() in compat.SUPPORTED
    if torch.cuda.is_available():
        return
    for name in ("cpu_cuda_calls", "cpu_parallel_state", "cpu_training", "prebuilt_dataset_helpers"):
        with patches.applied(name) as active:
            assert active, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patch does nothing with CUDA")
def test_cpu_training_apply_twice_and_undo():
    """`cpu_training` (what `--cpu` applies; the CPU test harness uses it too) redirects the calls its
    docstring names, applies its dependencies, is safe to apply twice, and its undo restores everything
    it changed (dependencies that were active before stay)."""
    from megatron.core.tensor_parallel import random as mc_random
    from megatron.training import training

    if patches.is_active("cpu_training"):
        pytest.skip("applied for good in this process")
    before_deps = {n: patches.is_active(n) for n in ("cpu_cuda_calls", "cpu_parallel_state")}
    originals = (training.initialize_megatron, torch.cuda.get_device_properties, torch.cuda.manual_seed,
                 mc_random._get_cuda_rng_state, torch.cuda.Stream)
    with patches.applied("cpu_training") as active:
        assert active and patches.apply("cpu_training")  # the second apply is a no-op
        assert training.initialize_megatron.keywords == {"allow_no_cuda": True}
        assert training.initialize_megatron.func is originals[0]  # wrapped once
        assert all(patches.is_active(n) for n in before_deps)
        assert torch.cuda.device_count() == 1 and torch.cuda.get_device_properties().major == 9
        assert torch.ones(2).type() == "torch.cuda.FloatTensor" and torch.ones(2).cuda().device.type == "cpu"
        # the stand-in CUDA generator is seeded apart from the CPU one
        cpu_state = torch.get_rng_state()
        torch.cuda.manual_seed(7)
        first = mc_random._get_cuda_rng_state()
        torch.cuda.manual_seed(7)
        assert torch.equal(first, mc_random._get_cuda_rng_state()) and torch.equal(cpu_state, torch.get_rng_state())
    assert (training.initialize_megatron, torch.cuda.get_device_properties, torch.cuda.manual_seed,
            mc_random._get_cuda_rng_state, torch.cuda.Stream) == originals
    assert {n: patches.is_active(n) for n in before_deps} == before_deps
    assert torch.ones(2).type() == "torch.FloatTensor"


def test_first_log_interval_reset_resets_a_first_iteration_that_ends_an_interval(monkeypatch):
    """`first_log_interval_reset` passes `is_first_iteration=False` to megatron-core's `training_log` where a
    process's first iteration ends a log interval, leaves a first iteration inside an interval and every later
    one as they are, wraps once, and its undo restores the original (the loss it fixes: tests/e2e/test_pretrain.py
    `test_resume_matches_uninterrupted`)."""
    import types

    import megatron.training
    from megatron.training import training

    if patches.is_active("first_log_interval_reset"):
        pytest.skip("applied for good in this process")
    seen = []

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, params_norm, num_zeros_in_grad, max_attention_logit,
                     pg_collection=None, is_first_iteration=False, seqlen_squared_sum_in_batch=None):
        seen.append((iteration, is_first_iteration))
        return report_memory_flag

    real = inspect.signature(training.training_log).parameters
    assert list(inspect.signature(training_log).parameters)[:13] == list(real)[:13]  # the stand-in's is Megatron's
    monkeypatch.setattr(training, "training_log", training_log)
    interval = types.SimpleNamespace(log_interval=1)
    monkeypatch.setattr(megatron.training, "get_args", lambda: interval)
    with patches.applied("first_log_interval_reset") as active:
        assert active and patches.apply("first_log_interval_reset")
        assert training.training_log.__wrapped__ is training_log
        flag = training.training_log({}, {}, 1e-3, 11, 1.0, "flag", 0, None, None, None, None,
                                     is_first_iteration=True)
        training.training_log({}, {}, 1e-3, 12, 1.0, True, 0, None, None, None, None, None, False)
        interval.log_interval = 10
        training.training_log({}, {}, 1e-3, 55, 1.0, True, 0, None, None, None, None, is_first_iteration=True)
        training.training_log({}, {}, 1e-3, 60, 1.0, True, 0, None, None, None, None, None, True)
    assert flag == "flag" and seen == [(11, False), (12, False), (55, True), (60, False)]
    assert training.training_log is training_log


def _dense_attention(q, k, v, scale, window, sink, slopes=None):
    """Reference: queries [s, h, d] at the last s positions of keys / values [L, hk, d], causal, in fp64; ALiBi
    `slopes` add `alibi.alibi_bias` (Bloom's bias, as the training path adds it)."""
    from megatron_patch.models.modules.alibi import alibi_bias

    s_len, h, _ = q.shape
    L = k.shape[0]
    k, v = (t.double().repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("shd,lhd->hsl", q.double(), k) * scale
    if slopes is not None:
        scores = scores + alibi_bias(slopes, s_len, L).double()
    i = torch.arange(L - s_len, L)[:, None]
    j = torch.arange(L)[None, :]
    seen = (j <= i) & ((j >= i - window[0]) if window else True)
    scores = scores.masked_fill(~seen, float("-inf"))
    weights = scores.exp()
    total = weights.sum(-1, keepdim=True) + (sink.double().exp()[:, None, None] if sink is not None else 0)
    return torch.einsum("hsl,lhd->shd", weights / total, v)


@pytest.mark.parametrize("window, sink, alibi", [(None, False, False), ((3, 0), False, False), (None, True, False),
                                                 (None, False, True)])
def test_paged_attention_in_torch_equals_dense_attention(window, sink, alibi):
    """The torch stand-in for megatron-core's paged flash-attention (`paged_attention_in_torch`) equals
    plain causal attention over each request's whole sequence to 1e-6 (fp32, max |difference|), on a
    mixed prefill step (a whole prompt, a prompt continued after cached tokens, a request in decode) and
    on a decode-only step with padding rows; grouped queries (8 heads over 2 KV heads), pages of 4
    tokens handed out out of order, a sliding window, a sink logit, ALiBi slopes on the layer's core attention
    (the `alibi_paged_attention` patch's path). Cache pages nobody wrote hold NaN: they must not leak."""
    from types import SimpleNamespace

    from megatron_patch.inference.paged_attention import flash_decode_and_prefill
    from megatron_patch.models.modules.alibi import alibi_slopes

    torch.manual_seed(0)
    h, hk, d, page, pages = 8, 2, 16, 4, 12
    slopes = alibi_slopes(h) if alibi else None
    layer = SimpleNamespace(config=SimpleNamespace(window_size=window, window_attn_skip_freq=None), layer_number=1,
                            softmax_scale=None, core_attention=SimpleNamespace(alibi_slopes=slopes))
    sink_logits = torch.randn(h) if sink else None
    k_cache = torch.full((pages, page, hk, d), float("nan"))
    v_cache = torch.full((pages, page, hk, d), float("nan"))
    lengths = [7, 9, 5]  # tokens cached per request, this step's included
    queries = [7, 3, 1]  # this step's tokens: a whole prompt, a continued prompt, one decode token
    tables = [[5, 0], [2, 7, 9], [11, 3]]  # pages per request, out of order
    full_k, full_v = [], []
    for n, table in zip(lengths, tables):
        k, v = torch.randn(n, hk, d), torch.randn(n, hk, d)
        for pos in range(n):
            k_cache[table[pos // page], pos % page], v_cache[table[pos // page], pos % page] = k[pos], v[pos]
        full_k.append(k)
        full_v.append(v)
    block_table = torch.tensor([t + [-1] * (3 - len(t)) for t in tables])
    q = torch.randn(sum(queries) + 2, 1, h, d)  # 2 padding tokens at the end
    cu_q = torch.tensor([0, 7, 10, 11])
    out = flash_decode_and_prefill(layer, q, k_cache, v_cache, 7, 9, cu_q, None, torch.tensor(lengths), block_table,
                                   False, sink_logits)
    for r in range(3):
        want = _dense_attention(q[cu_q[r]: cu_q[r + 1], 0], full_k[r], full_v[r], d ** -0.5, window, sink_logits,
                                slopes)
        assert (out[cu_q[r]: cu_q[r + 1], 0].double() - want).abs().max() < 1e-6
    assert torch.equal(out[11:], torch.zeros(2, 1, h, d))
    # decode only: one new token per request, plus a padding row (no pages, length 0)
    q = torch.randn(4, 1, h, d)
    table = torch.cat([block_table, torch.full((1, 3), -1)])
    out = flash_decode_and_prefill(layer, q, k_cache, v_cache, 1, 9, None, None, torch.tensor(lengths + [0]),
                                   table, True, sink_logits)
    for r in range(3):
        want = _dense_attention(q[r: r + 1, 0], full_k[r], full_v[r], d ** -0.5, window, sink_logits, slopes)
        assert (out[r, 0].double() - want[0]).abs().max() < 1e-6
    assert torch.isfinite(out).all()


def test_paged_attention_in_torch_applies_without_flash_attn():
    from megatron.core.transformer import attention

    from megatron_patch.inference import paged_attention

    if attention.HAVE_FA3 or attention.HAVE_FA4 or attention.flash_attn_varlen_func is not None:
        pytest.skip("flash-attn is installed: tested with a stand-in below")
    original = attention.Attention.flash_decode_and_prefill
    with patches.applied("paged_attention_in_torch") as active:
        assert active and patches.apply("paged_attention_in_torch")
        assert attention.Attention.flash_decode_and_prefill is paged_attention.flash_decode_and_prefill
        assert attention.is_fa_min_version("2.7.3")
        assert patches.attends_in_torch(torch.bfloat16) and patches.attends_in_torch(torch.float32)
    assert attention.Attention.flash_decode_and_prefill is original
    assert not patches.attends_in_torch(torch.float32)  # not applied: megatron-core's own method


def test_with_flash_attn_only_fp32_attends_in_torch(monkeypatch):
    """With a flash-attn kernel importable (FA4 on the GPU machine), fp16 / bf16 calls reach megatron-core's own
    method and fp32 ones, which no flash kernel takes (FA4: "inputs must be float16, bfloat16, fp8"), the torch
    implementation; megatron's version check is left alone."""
    from megatron.core.transformer import attention

    from megatron_patch.inference import paged_attention

    calls = []

    def flash(self, q, *args, **kwargs):
        calls.append(("flash", q.dtype))
        return "flash"

    def in_torch(self, q, *args, **kwargs):
        calls.append(("torch", q.dtype))
        return "torch"

    monkeypatch.setattr(attention, "HAVE_FA4", True)
    monkeypatch.setattr(attention.Attention, "flash_decode_and_prefill", flash)
    monkeypatch.setattr(paged_attention, "flash_decode_and_prefill", in_torch)
    version_check = attention.is_fa_min_version
    with patches.applied("paged_attention_in_torch") as active:
        assert active and attention.is_fa_min_version is version_check
        method = attention.Attention.flash_decode_and_prefill
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            method(None, torch.zeros(1, dtype=dtype))
        assert not patches.attends_in_torch(torch.bfloat16) and patches.attends_in_torch(torch.float32)
    assert calls == [("flash", torch.bfloat16), ("flash", torch.float16), ("torch", torch.float32)]
    assert attention.Attention.flash_decode_and_prefill is flash


class _Context:
    """What TorchSampling.sample_kernel reads of megatron-core's DynamicInferenceContext."""

    def __init__(self, temperature, top_k, top_p, paused=0):
        self.total_request_count, self.paused_request_count = len(temperature) + paused, paused
        self.active_request_metadata = {"temperature": torch.tensor(temperature, dtype=torch.float32),
                                        "top_k": torch.tensor(top_k, dtype=torch.int32),
                                        "top_p": torch.tensor(top_p, dtype=torch.float32)}


@pytest.mark.parametrize("temperature, top_k, top_p, gather", [
    ([1.0] * 3, [1] * 3, [0.0] * 3, False),  # greedy: one group
    ([0.7] * 4, [5] * 4, [0.0] * 4, True),  # one sampling setting, gathered rows: the same generator draws
    ([1.0, 0.7, 1.0], [1, 5, 1], [0.0, 0.0, 0.0], False),  # two groups: the original runs
])
def test_sampling_without_stream_sync_samples_what_the_original_does(monkeypatch, temperature, top_k, top_p,
                                                                     gather):
    """The patched sample_kernel returns the original's tokens (and leaves its generator where the original
    does) without building index tensors on the device when every request samples alike."""
    from megatron.core.inference.sampling.torch_sampling import TorchSampling

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # the original's index tensors, on a CPU
    n, vocab = len(temperature), 50
    logits = torch.randn(n + 2, vocab, generator=torch.Generator().manual_seed(0))
    kwargs = {"gather_indices": torch.tensor([n + 1, *range(n - 1), n])} if gather else {}
    if "no_top_k" in inspect.signature(TorchSampling.sample_kernel).parameters:  # 0.19 on
        kwargs.update(no_top_k=not any(top_k), no_top_p=not any(top_p))
    outs, states, index_tensors = [], [], []
    make_tensor = torch.tensor

    def counted(*args, **kw):  # the index tensors the original makes on the device (here: "cpu")
        index_tensors[-1] += "device" in kw
        return make_tensor(*args, **kw)

    for patched in (False, True):
        rng, context = torch.Generator().manual_seed(1), _Context(temperature, top_k, top_p)
        index_tensors.append(0)
        with (patches.applied("sampling_without_stream_sync") if patched else contextlib.nullcontext(),
              monkeypatch.context() as m):
            m.setattr(torch, "tensor", counted)
            outs.append(TorchSampling(rng, vocab).sample_kernel(logits, n, context, **kwargs))
        states.append(rng.get_state())
    assert torch.equal(outs[0], outs[1]) and torch.equal(states[0], states[1]), outs
    groups = len(set(zip(temperature, top_k, top_p)))
    assert index_tensors == [groups, 0 if groups == 1 else groups], index_tensors
    assert not patches.is_active("sampling_without_stream_sync")
