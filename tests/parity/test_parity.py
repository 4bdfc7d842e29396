"""Every tiny config (LLaMA variants, the other native families and the remote-code ones): logits of
the converted megatron-core model vs the transformers reference, CPU fp32 (max abs <= 1e-5)."""

import pytest
import torch

from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
from megatron_patch.conversion.verify import fixed_prompts
from megatron_patch.models import Layout, build_model
from megatron_patch.runtime.logits import megatron_logits
from tests.models import DEEPSEEK_YARN, Case, all_variants, any_config, case, case_of


def _converted_logits(c: Case):
    """Our logits, transformers' and our model, for the case converted at TP = PP = 1 (CPU fp32)."""
    ranks = hf_to_megatron(make_plan(c.cfg, Layout()), c.sd.__getitem__, c.sd.keys())
    model = build_model(c.cfg).eval()
    load_rank_state_dict(model, ranks[(0, 0, 0)])
    ids = fixed_prompts(c.vocab_size, batch=3, seq=48)
    with torch.no_grad():
        ref = c.ref(ids).logits
    return megatron_logits(model, ids, c.vocab_size), ref, model


@pytest.mark.parametrize("variant", all_variants())
def test_logits_match_transformers(cpu_megatron, variant):
    out, ref, _ = _converted_logits(case(variant))
    assert out.shape == ref.shape
    diff = (out - ref).abs().max().item()
    assert diff <= 1e-5, f"{variant}: max abs logit diff {diff}"
    # the model is not trivially constant: logits vary across positions and vocab
    assert ref.std() > 0.1


def test_build_model_takes_a_layout_and_still_the_old_tp_pp_form(cpu_megatron):
    """`build_model(cfg, layout=Layout(...))`; the older `build_model(cfg, tp, pp, ...)` and `tp=` / `pp=`
    keywords give the same model with a DeprecationWarning; both forms at once, or impl / dtype passed by
    position, are a TypeError naming the form."""
    c = case("gqa")
    torch.manual_seed(0)
    new = build_model(c.cfg, layout=Layout(1, 1, 64))
    with pytest.warns(DeprecationWarning, match=r"pass layout=Layout\(tp, pp"):
        torch.manual_seed(0)
        old = build_model(c.cfg, 1, 1, make_vocab_size_divisible_by=64)
    with pytest.warns(DeprecationWarning):
        build_model(c.cfg, tp=1)
    assert new.state_dict().keys() == old.state_dict().keys()
    assert all(torch.equal(new.state_dict()[k], old.state_dict()[k]) for k in new.state_dict()
               if isinstance(new.state_dict()[k], torch.Tensor))
    with pytest.raises(TypeError, match="pass the layout once"):
        build_model(c.cfg, 1, layout=Layout())
    with pytest.raises(TypeError, match="keyword-only"):
        build_model(c.cfg, 1, 1, "local")


@pytest.mark.parametrize("variant", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("mscale_all_dim", [1.0, 0.707])
def test_deepseek_yarn_logits_match_transformers(cpu_megatron, variant, mscale_all_dim):
    """DeepSeek's released models rotate with YaRN (`rope_scaling`: factor 40, mscale_all_dim 1.0 in V3, 0.707 in
    V2-Lite), which megatron-core's MLA builds as `YarnRotaryEmbedding`, its attention scale multiplied by the
    concentration factor's square: logits of the converted model equal transformers' (CPU fp32), as the tiny
    configs without scaling do above."""
    torch.manual_seed(0)
    out, ref, model = _converted_logits(case_of({**any_config(variant),
                                                 "rope_scaling": {**DEEPSEEK_YARN, "mscale_all_dim": mscale_all_dim}}))
    assert type(model.decoder.layers[0].self_attention.rotary_pos_emb).__name__ == "YarnRotaryEmbedding"
    diff = (out - ref).abs().max().item()
    assert diff <= 1e-5, f"{variant}: max abs logit diff {diff}"
