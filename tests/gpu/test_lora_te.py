"""LoRA on Transformer Engine's linears (GPU machine): `TELayerNormColumnParallelLinear` (the adapter reads the
normalised input TE returns), `TERowParallelLinear`; fp32 with TF32 disabled for the adapters' torch GEMMs.
With the same random adapters, the TE model's change of logits (adapted - base) equals the local model's,
and its adapter gradients equal the local model's. Skipped without CUDA + Transformer Engine.

Run there: python -m pytest -q tests/gpu/test_lora_te.py -s"""

import pytest
import torch

from tests.gpu.test_te import GPU_CFG, HAVE_TE, _record, world  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not HAVE_TE, reason="needs a CUDA GPU and Transformer Engine")


def _model(cfg, sd, impl, adapter):
    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
    from megatron_patch.lora.adapters import LoRAConfig, apply_lora, load_adapter
    from megatron_patch.models import Layout, build_model

    plan = make_plan(cfg, Layout(), impl)
    model = build_model(cfg, impl=impl).eval()
    load_rank_state_dict(model, hf_to_megatron(plan, sd.__getitem__, sd.keys())[(0, 0, 0)])
    apply_lora(model, cfg, LoRAConfig(8, 16.0), plan)
    if adapter is not None:
        load_adapter(model, {k: v.cuda() for k, v in adapter.items()})
    return model


def test_te_lora_equals_local_lora(world):  # noqa: F811
    from megatron_patch.conversion.verify import compare, fixed_prompts
    from megatron_patch.lora.adapters import adapter_tensors
    from megatron_patch.runtime.logits import megatron_logits
    from tests.models import hf_model, llama_config

    cfg = llama_config("gqa", **GPU_CFG)
    sd = {k: v.cuda() for k, v in hf_model(cfg).state_dict().items()}
    local = _model(cfg, sd, "local", None)
    g = torch.Generator().manual_seed(0)
    adapter = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in adapter_tensors(local).items()}
    ids = fixed_prompts(cfg["vocab_size"], batch=2, seq=64)
    out = {}
    for impl in ("local", "transformer_engine"):
        base = _model(cfg, sd, impl, None)  # B = 0: the base function
        model = _model(cfg, sd, impl, adapter)
        with torch.no_grad():
            delta = megatron_logits(model, ids, cfg["vocab_size"]) - megatron_logits(base, ids, cfg["vocab_size"])
        model.train()
        logits = model(ids.cuda(), torch.arange(64).cuda()[None].expand(2, -1), None)
        logits.float().pow(2).mean().backward()
        grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.requires_grad}
        out[impl] = (delta, grads)
    d_local, g_local = out["local"]
    d_te, g_te = out["transformer_engine"]
    assert set(g_local) == set(g_te)
    grad_rel = max(((g_te[k] - g_local[k]).norm() / g_local[k].norm().clamp(min=1e-12)).item() for k in g_local)
    _record(test="lora_te_vs_local", delta=compare(d_local, d_te), delta_std=d_local.std().item(), grad_rel=grad_rel)
    assert compare(d_local, d_te)["max_abs_logit_diff"] <= 0.05 * d_local.abs().max().item()
    assert grad_rel <= 0.02
