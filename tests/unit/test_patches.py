"""The runtime patch registry and the one patch the library carries (`cpu_cuda_calls`)."""

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
