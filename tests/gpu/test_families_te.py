"""Every model family under Transformer Engine on the GPU machine: the TE layer spec (fused/flash
attention with sliding window, LayerNorm with bias, interleaved partial rotary, post-sublayer norms,
NormHead, qk-norm, TE's ALiBi, embedding LayerNorm, learned positions, parallel attention + MLP) against
the local spec and the transformers reference, and the TE state-dict names (incl. `_extra_state`) our
legacy writer produces against a real TE model's.

Run there: python -m pytest -q tests/gpu -s   (results: tests/gpu/RESULTS.md)"""

import pytest
import torch

from tests.gpu.test_te import HAVE_TE, _record

pytestmark = pytest.mark.skipif(not HAVE_TE, reason="needs a CUDA GPU and Transformer Engine")

VARIANTS = ["qwen2", "qwen3", "mistral_swa", "starcoder2", "starcoder2_swa", "glm", "glm4", "chatglm2", "qwen1",
            "baichuan2", "internlm2", "yi", "bloom", "bloom_6heads", "starcoder", "starcoder_mha", "baichuan2_13b",
            "falcon_7b", "falcon_40b", "falcon_11b", "gptj", "gpt_neox", "gpt_neox_seq", "attn_bias_only",
            "llama3_rope_4k"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"]
VARIANTS += MOE


@pytest.fixture(scope="module")
def world():
    from megatron_patch.runtime.parallel import ensure_model_parallel

    ensure_model_parallel(1, 1)


def _logits(c, impl, dtype, ids, exact=True):
    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
    from megatron_patch.conversion.verify import exact_routing
    from megatron_patch.models import Layout, build_model
    from megatron_patch.runtime.logits import megatron_logits

    ranks = hf_to_megatron(make_plan(c.cfg, Layout(), impl), c.sd.__getitem__, c.sd.keys())
    model = build_model(c.cfg, impl=impl, dtype=dtype).eval()
    load_rank_state_dict(model, ranks[(0, 0, 0)])
    if exact and dtype == torch.float32:
        exact_routing(model)  # as `verify` does: fp64 router logits, not TE's TF32 GEMM
    return megatron_logits(model, ids, c.vocab_size), model


@pytest.mark.parametrize("variant", VARIANTS)
def test_family_te_matches_local_and_reference(world, variant):
    from megatron_patch.conversion.engine import extra_state_names, make_plan
    from megatron_patch.conversion.verify import compare, fixed_prompts
    from megatron_patch.models import Layout
    from tests.models import case

    c = case(variant)
    ids = fixed_prompts(c.vocab_size, batch=4, seq=64)
    ref_model = c.ref.cuda()
    with torch.no_grad():
        ref = ref_model(ids.cuda()).logits.float().cpu()
        torch.backends.cuda.matmul.allow_tf32 = True
        ref_tf32 = ref_model(ids.cuda()).logits.float().cpu()
        torch.backends.cuda.matmul.allow_tf32 = False
    local, _ = _logits(c, "local", torch.float32, ids)
    # megatron-core's default fp32 routing (router GEMM through TE, TF32): recorded, not asserted
    local_te_router = _logits(c, "local", torch.float32, ids, exact=False)[0] if variant in MOE else None
    te, te_model = _logits(c, "transformer_engine", torch.float32, ids)
    local16, _ = _logits(c, "local", torch.bfloat16, ids)
    te16, _ = _logits(c, "transformer_engine", torch.bfloat16, ids)
    plan = make_plan(c.cfg, Layout(), "transformer_engine")
    ours = plan.megatron_names(0) | extra_state_names(plan, 0)
    theirs = set(te_model.state_dict())
    row = dict(test="family_te", variant=variant, local_vs_hf=compare(ref, local), te_vs_hf=compare(ref, te),
               tf32_noise=compare(ref, ref_tf32), te_vs_local_bf16=compare(local16, te16),
               bf16_local_vs_hf=compare(ref, local16), logit_std=ref.std().item(),
               local_te_router_vs_hf=None if local_te_router is None else compare(ref, local_te_router),
               te_names_missing=sorted(theirs - ours), te_names_unexpected=sorted(ours - theirs))
    _record(**row)
    assert row["local_vs_hf"]["max_abs_logit_diff"] <= 1e-4
    assert row["te_vs_hf"]["max_abs_logit_diff"] <= max(4 * row["tf32_noise"]["max_abs_logit_diff"], 1e-3)
    assert row["te_vs_hf"]["top1_agreement"] >= 0.98
    # bf16: TE as close to the local spec as bf16 rounding allows
    assert row["te_vs_local_bf16"]["kl"] <= 1e-2 and row["te_vs_local_bf16"]["top1_agreement"] >= 0.9
    assert not row["te_names_missing"] and not row["te_names_unexpected"]
