"""Conversion engine: per-rank layout, strictness, TE naming, bitwise round trips at any TP x PP."""

import pytest
import torch

from megatron_patch.conversion.engine import ConversionError, hf_to_megatron, make_plan, megatron_to_hf
from megatron_patch.models import Layout
from tests.models import hf_model, llama_config


@pytest.fixture(scope="module")
def tiny():
    cfg = llama_config("bias")
    return cfg, hf_model(cfg).state_dict()


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)])
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_round_trip_bitwise(tiny, tp, pp, impl):
    cfg, sd = tiny
    plan = make_plan(cfg, Layout(tp, pp), impl)
    ranks = hf_to_megatron(plan, sd.__getitem__, sd.keys())
    assert set(ranks) == {(t, p, 0) for t in range(tp) for p in range(pp)}
    back = megatron_to_hf(plan, ranks)
    assert set(back) == set(sd)
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k


def test_stage_layout(tiny):
    cfg, sd = tiny
    ranks = hf_to_megatron(make_plan(cfg, Layout(2, 2)), sd.__getitem__, sd.keys())
    first, last = ranks[(1, 0, 0)], ranks[(1, 1, 0)]
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "decoder.final_layernorm.weight" in last and "embedding.word_embeddings.weight" not in last
    # global layers 2,3 are local layers 0,1 of stage 1
    assert torch.equal(last["decoder.layers.0.pre_mlp_layernorm.weight"],
                       sd["model.layers.2.post_attention_layernorm.weight"])
    assert first["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] == (8 + 2 * 2) * 8 // 2
    assert first["embedding.word_embeddings.weight"].shape == (512, 64)


def test_te_names_match_megatron_core_sharded_keys_map():
    """Our local->TE renames are exactly the ones megatron-core declares for its local spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_patch.conversion.engine import to_impl_name

    keys_map = get_gpt_layer_local_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map
    for local, te in keys_map.items():
        assert to_impl_name(f"decoder.layers.3.{local}weight", "transformer_engine") == f"decoder.layers.3.{te}weight"
    plan = make_plan(llama_config(), Layout(), "transformer_engine")
    names = plan.megatron_names(0)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)


def test_tied_embeddings_with_pp_copy_to_last_stage():
    cfg = llama_config("tied")
    sd = hf_model(cfg).state_dict()
    sd = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # as save_pretrained writes it
    plan = make_plan(cfg, Layout(1, 2))
    ranks = hf_to_megatron(plan, sd.__getitem__, sd.keys())
    assert torch.equal(ranks[(0, 1, 0)]["output_layer.weight"], ranks[(0, 0, 0)]["embedding.word_embeddings.weight"])
    assert set(megatron_to_hf(plan, ranks)) == set(sd)


def test_strict_missing_and_unexpected(tiny):
    cfg, sd = tiny
    plan = make_plan(cfg, Layout())
    partial = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ConversionError, match="missing HF tensors: model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron(plan, partial.__getitem__, partial.keys())
    extra = {**sd, "model.layers.0.mystery.weight": torch.zeros(1)}
    with pytest.raises(ConversionError, match="does not consume: model.layers.0.mystery.weight"):
        hf_to_megatron(plan, extra.__getitem__, extra.keys())
    # an explicit Drop is fine
    dropped = {**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}
    hf_to_megatron(plan, dropped.__getitem__, dropped.keys())
    ranks = hf_to_megatron(plan, sd.__getitem__, sd.keys())
    del ranks[(0, 0, 0)]["decoder.layers.0.mlp.linear_fc2.bias"]
    with pytest.raises(ConversionError, match="missing Megatron parameters: decoder.layers.0.mlp.linear_fc2.bias"):
        megatron_to_hf(plan, ranks)


@pytest.mark.parametrize("overrides,tp,pp,match", [
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2, 1, "does not divide the 3 kv heads"),
    ({}, 3, 1, "does not divide the 8 attention heads"),
    ({}, 1, 3, "does not divide the 4 layers"),
])
def test_bad_layouts(overrides, tp, pp, match):
    with pytest.raises(ValueError, match=match):
        make_plan(llama_config("gqa", **overrides), Layout(tp, pp))


@pytest.mark.parametrize("layout,match", [
    (Layout(2, 1, vpp=2), "VPP=2: a virtual pipeline needs PP > 1"),
    (Layout(1, 2, vpp=3), r"PP x VPP dividing the 4 layers \(PP=2\)"),
    (Layout(1, 1, cp=0), "parallel sizes must be >= 1 \\(got CP=0\\)"),
    (Layout(1, 1, ep=2), "EP=2: llama has no experts to split"),
])
def test_bad_layouts_of_the_complete_layout(layout, match):
    """The one layout check (`Layout.check`, run by every plan and model build) covers the virtual pipeline,
    context and expert sizes too."""
    with pytest.raises(ValueError, match=match):
        make_plan(llama_config("gqa"), layout)
    make_plan(llama_config("gqa"), Layout(1, 2, vpp=2, cp=2))  # 4 layers: PP 2 x VPP 2, any CP


def test_layout_from_megatron_args():
    """Megatron-LM's parsed arguments name every size; a missing optional one takes its default."""
    from argparse import Namespace

    args = Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, make_vocab_size_divisible_by=64,
                     expert_model_parallel_size=2, expert_tensor_parallel_size=1, context_parallel_size=2,
                     virtual_pipeline_model_parallel_size=3)
    assert Layout.from_megatron_args(args) == Layout(2, 4, 64, ep=2, etp=1, cp=2, vpp=3)
    old = Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, make_vocab_size_divisible_by=128)
    assert Layout.from_megatron_args(old) == Layout()


@pytest.mark.parametrize("variant,tp", [("mqa", 2), ("gqa", 4)])
def test_kv_heads_replicated_when_tp_exceeds_them(variant, tp):
    """One kv head at TP=2 (two at TP=4): megatron gets TP query groups, each HF kv head copied to
    consecutive groups; back to HF the copies collapse bitwise, and copies that differ are an error."""
    cfg = llama_config(variant)
    sd = hf_model(cfg).state_dict()
    plan = make_plan(cfg, Layout(tp, 1))
    assert plan.shapes.num_query_groups == tp and plan.shapes.kv_replicas == tp // cfg["num_key_value_heads"]
    ranks = hf_to_megatron(plan, sd.__getitem__, sd.keys())
    d, per_rank_q = cfg["head_dim"], cfg["num_attention_heads"] // tp * cfg["head_dim"]
    k_of = [ranks[(t, 0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"][per_rank_q: per_rank_q + d]
            for t in range(tp)]
    groups, r = cfg["num_key_value_heads"], tp // cfg["num_key_value_heads"]
    k_hf = sd["model.layers.0.self_attn.k_proj.weight"].view(groups, d, -1)
    for t in range(tp):
        assert torch.equal(k_of[t], k_hf[t // r])
    back = megatron_to_hf(plan, ranks)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    ranks[(1, 0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"][per_rank_q] += 1.0
    with pytest.raises(ValueError, match="copies of each kv head"):
        megatron_to_hf(plan, ranks)


def test_dtype_cast(tiny):
    cfg, sd = tiny
    ranks = hf_to_megatron(make_plan(cfg, Layout()), sd.__getitem__, sd.keys(), torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in ranks[(0, 0, 0)].values())
