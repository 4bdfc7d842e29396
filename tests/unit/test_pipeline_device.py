"""Where pipeline results land (issue 26: at PP = 1 `from_last_stage` ignored `device`, so `verify`'s Megatron
logits stayed on the GPU while the HF reference was on the CPU, and `compare` failed on every GPU machine).
A CPU machine has one real device; the "meta" device stands in for a second one."""

import torch


def test_pp1_result_lands_on_the_asked_device(cpu_megatron):
    from megatron_patch.runtime import pipeline

    t = torch.arange(6.0).reshape(2, 3)
    assert pipeline.from_last_stage(t, (2, 3), device="meta").device.type == "meta"
    out = pipeline.from_last_stage(t.to(torch.float64), (2, 3))
    assert out.device == t.device and out.dtype == torch.float32


def test_forward_everywhere_returns_on_the_callers_device(cpu_megatron):
    from megatron_patch.models import build_model
    from megatron_patch.runtime import pipeline
    from tests.models import llama_config

    cfg = llama_config("gqa")
    model = build_model(cfg).eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 8))
    out = pipeline.forward_everywhere(model, ids, (2, 8), lambda o: o[..., 0], device="meta")
    assert out.device.type == "meta" and out.shape == (2, 8)


def test_compare_takes_the_candidate_to_the_reference(cpu_megatron):
    from megatron_patch.conversion.verify import compare

    ref = torch.randn(2, 4, 10)
    # a candidate whose .to(device) is checked: the comparison asks for the reference's device
    seen = []

    class Elsewhere(torch.Tensor):
        def to(self, *args, **kwargs):
            seen.append(args[0] if args else kwargs.get("device"))
            return torch.Tensor.to(self.as_subclass(torch.Tensor), *args, **kwargs)

    result = compare(ref, (ref + 0.5).as_subclass(Elsewhere))
    assert seen and seen[0] == ref.device
    assert abs(result["max_abs_logit_diff"] - 0.5) < 1e-6 and result["top1_agreement"] == 1.0
