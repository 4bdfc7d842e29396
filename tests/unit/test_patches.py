"""The runtime patch registry and its CPU patches (`cpu_cuda_calls`, `cpu_parallel_state`, `cpu_training`)."""

import pytest
import torch

from megatron_patch import patches


@pytest.mark.skipif(torch.cuda.is_available(), reason="the patch does nothing with CUDA")
def test_cpu_cuda_calls_apply_and_undo():
    from megatron.core.fusions import fused_softmax

    original = fused_softmax.get_sliding_window_causal_mask
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
    assert fused_softmax.get_sliding_window_causal_mask is original
    if "cpu_cuda_calls" not in patches._ACTIVE:  # (the CPU test harness keeps it on for good)
        with pytest.raises(RuntimeError):
            torch.ones(2).cuda()


def test_every_patch_states_why_and_versions():
    for p in patches.registry().values():
        assert p.why and str(p.versions)


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
