"""Every model family: bitwise HF -> Megatron (TP2 x PP2, local and TE naming) -> HF round trips, the
converter CLI picking the family from config.json alone, family-specific tensors landing where
megatron-core expects them, and configs a family cannot express refused clearly. Logits parity:
tests/parity; TP/PP logits: tests/distributed."""

import json
import os

import pytest
import torch

from megatron_patch.conversion.engine import hf_to_megatron, make_plan, megatron_to_hf
from megatron_patch.conversion.hf_io import read_all
from megatron_patch.convert import main
from megatron_patch.models import Layout, UnsupportedConfig, get_family
from tests.models import DROP, all_variants, case, family_config, save_case
from tests.remote import REMOTE_VARIANTS


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
@pytest.mark.parametrize("variant", all_variants())
def test_round_trip_tp2_pp2_bitwise(variant, impl):
    c = case(variant)
    plan = make_plan(c.cfg, Layout(2, 2), impl)  # one kv head: replicated to two query groups
    ranks = hf_to_megatron(plan, c.sd.__getitem__, c.sd.keys())
    back = megatron_to_hf(plan, ranks)
    tied = [k for k in c.sd if plan.is_dropped(k)]
    expected = {k: v for k, v in c.sd.items() if k not in tied}
    assert set(back) == set(expected)
    for k in expected:
        assert back[k].dtype == expected[k].dtype and torch.equal(back[k], expected[k]), k


# one config per family (the family is found from config.json's architectures alone)
FAMILY_REPRESENTATIVES = ["qwen2", "qwen3", "mistral_swa", "starcoder2", "glm", "glm4", "qwen1", "baichuan2",
                          "internlm2", "yi", "chatglm2", "bloom", "starcoder", "baichuan2_13b", "falcon_7b",
                          "falcon_40b", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gptj",
                          "gpt_neox", "gpt_neox_seq", "attn_bias_only"]


@pytest.mark.parametrize("fmt,impl", [("legacy", "transformer_engine"), ("torch_dist", "local")])
@pytest.mark.parametrize("variant", FAMILY_REPRESENTATIVES)
def test_cli_converts_without_family_flag(cpu_megatron, tmp_path, variant, fmt, impl):
    c = case(variant)
    hf_dir = save_case(c, str(tmp_path / "hf"))
    mc = str(tmp_path / "mcore")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--tp", "2", "--pp", "2",
                 "--format", fmt, "--impl", impl]) == 0
    manifest = json.load(open(os.path.join(mc, "megatron_patch.json")))
    assert manifest["family"] == get_family(c.cfg).name
    back = str(tmp_path / "back")
    assert main(["mcore-to-hf", "--mcore-dir", mc, "--out", back]) == 0
    a, b = read_all(hf_dir), read_all(back)
    assert set(a) - set(b) <= {k for k in a if "rotary" in k} and set(b) <= set(a)
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert json.load(open(os.path.join(back, "config.json")))["architectures"] == c.cfg["architectures"]


def test_family_tensors_land_where_megatron_core_expects():
    def names(variant, impl="local"):
        c = case(variant)
        return make_plan(c.cfg, Layout(), impl).megatron_names(0)

    assert "decoder.layers.0.self_attention.linear_qkv.bias" in names("qwen2")
    assert "decoder.layers.0.self_attention.linear_proj.bias" not in names("qwen2")
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in names("qwen3")
    assert {"decoder.layers.0.self_attention.post_layernorm.weight",
            "decoder.layers.0.mlp.post_layernorm.weight"} <= names("glm4")
    sc = names("starcoder2", "transformer_engine")
    assert {"decoder.layers.0.self_attention.linear_qkv.layer_norm_bias", "decoder.layers.0.mlp.linear_fc1.bias",
            "decoder.final_layernorm.bias"} <= sc
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in names("chatglm2")
    assert {"embedding.word_embeddings_layernorm.weight", "embedding.word_embeddings_layernorm.bias"} <= names("bloom")
    assert "embedding.position_embeddings.weight" in names("starcoder")
    # Falcon-7B: one norm shared by attention and MLP; Falcon-40B: ln_attn and ln_mlp
    f7 = names("falcon_7b", "transformer_engine")
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in f7
    assert not any("linear_fc1.layer_norm" in n or "pre_mlp_layernorm" in n for n in f7)
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names("falcon_40b", "transformer_engine")
    # GPT-J: MLP and output layer biased, attention not; one shared norm
    gj = names("gptj", "transformer_engine")
    assert {"decoder.layers.0.mlp.linear_fc1.bias", "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias",
            "output_layer.bias"} <= gj
    assert not any(n.endswith(("linear_qkv.bias", "linear_proj.bias")) or "pre_mlp_layernorm" in n for n in gj)
    # GPT-NeoX: two norms with a parallel residual; attention_bias false keeps the MLP's biases only
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_bias" in names("gpt_neox", "transformer_engine")
    assert {"decoder.layers.0.self_attention.linear_proj.bias", "decoder.layers.0.self_attention.linear_qkv.bias"} \
        <= names("gpt_neox")
    neox_seq = names("gpt_neox_seq")
    assert "decoder.layers.0.mlp.linear_fc2.bias" in neox_seq and not any("self_attention" in n and n.endswith(".bias")
                                                                          for n in neox_seq)
    # LLaMA attention_bias without mlp_bias: q/k/v/o biased, MLP not
    llama = names("attn_bias_only")
    assert {"decoder.layers.0.self_attention.linear_qkv.bias",
            "decoder.layers.0.self_attention.linear_proj.bias"} <= llama
    assert not any("mlp" in n and n.endswith(".bias") for n in llama)


def test_config_translation():
    mc = get_family("mistral").config_kwargs(family_config("mistral_swa"))
    assert mc["window_size"] == (7, 0) and mc["kv_channels"] == 16
    assert "window_size" not in get_family("mistral").config_kwargs(family_config("mistral"))
    assert get_family("mistral").config_kwargs({**family_config("mistral"), "sliding_window": None}) == \
        get_family("mistral").config_kwargs(family_config("mistral"))
    # MistralConfig's default when config.json has no sliding_window key
    no_key = {k: v for k, v in family_config("mistral").items() if k != "sliding_window"}
    assert get_family("mistral").config_kwargs(no_key)["window_size"] == (4095, 0)
    sc = get_family("starcoder2").config_kwargs(family_config("starcoder2"))
    assert sc["normalization"] == "LayerNorm" and not sc["gated_linear_unit"] and sc["add_bias_linear"]
    glm = get_family("glm")
    assert glm.config_kwargs(family_config("glm"))["rotary_interleaved"]
    assert glm.gpt_kwargs(family_config("glm"))["rotary_percent"] == 0.5
    chat = case("glm4_chat").cfg
    assert get_family(chat).gpt_kwargs(chat)["rotary_base"] == 5000000.0
    assert get_family(chat).config_kwargs(chat)["num_query_groups"] == 4
    q1 = case("qwen1").cfg
    assert get_family(q1).config_kwargs(q1)["ffn_hidden_size"] == q1["intermediate_size"] // 2
    gj = get_family("gptj")
    assert gj.gpt_kwargs(family_config("gptj"))["rotary_percent"] == 0.25
    assert gj.config_kwargs(family_config("gptj"))["rotary_interleaved"]
    neox = get_family("gpt_neox")
    assert neox.gpt_kwargs(family_config("gpt_neox"))["rotary_percent"] == 0.25
    assert (neox.gpt_kwargs(family_config("gpt_neox_seq"))["rotary_percent"],
            neox.gpt_kwargs(family_config("gpt_neox_seq"))["rotary_base"]) == (0.5, 50000.0)


@pytest.mark.parametrize("variant,overrides,match", [
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen1", {"rotary_pct": 0.5}, "rotary_pct"),
    ("qwen1", {"kv_channels": 4}, "kv_channels"),
    ("internlm2", {"bias": True}, "bias=true"),
    ("chatglm2", {"position_encoding_2d": True}, "ChatGLM-6B"),
    ("chatglm2", {"add_bias_linear": True}, "add_bias_linear"),
    ("starcoder2", {"hidden_act": "relu"}, "hidden_act"),
    ("bloom", {"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm"),
    ("starcoder", {"scale_attn_weights": False}, "scale_attn_weights"),
    ("baichuan", {"position_embedding": "learned"}, "position_embedding"),
    ("falcon_7b", {"alibi": True}, "alibi"),
    ("falcon_40b", {"parallel_attn": False}, "parallel_attn"),
    ("gptj", {"rotary_dim": None}, "rotary_dim"),
    ("gptj", {"rotary_dim": 5}, "rotary_dim"),
    ("gpt_neox", {"hidden_act": "relu"}, "hidden_act"),
])
def test_refusals(variant, overrides, match):
    cfg = case(variant).cfg if variant in REMOTE_VARIANTS else family_config(variant)
    cfg = {k: v for k, v in {**cfg, **overrides}.items() if v is not DROP}
    with pytest.raises(UnsupportedConfig, match=match):
        fam = get_family(cfg)
        fam.config_kwargs(cfg)
        fam.gpt_kwargs(cfg)


def test_verify_refuses_remote_code_without_consent(cpu_megatron, tmp_path, capsys):
    hf_dir = save_case(case("qwen1"), str(tmp_path / "hf"))
    mc = str(tmp_path / "mcore")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc]) == 0
    capsys.readouterr()
    assert main(["verify", "--hf-dir", hf_dir, "--mcore-dir", mc]) == 1
    assert "remote-code architecture" in capsys.readouterr().err


def test_single_kv_head_at_tp2_through_every_format(cpu_megatron, tmp_path, capsys):
    """StarCoder (MQA) converted for TP=2 stores two query groups (its kv head replicated); the
    checkpoint runs at TP=1 as stored, reshards to TP=1 (one group again) and exports bitwise."""
    c = case("starcoder")
    hf_dir = save_case(c, str(tmp_path / "hf"))
    mc, flat, back = (str(tmp_path / n) for n in ("mc", "flat", "back"))
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--tp", "2"]) == 0
    from megatron_patch.conversion.megatron_checkpoint import MegatronCheckpoint

    assert MegatronCheckpoint.open(mc).num_query_groups == 2
    capsys.readouterr()
    assert main(["verify", "--hf-dir", hf_dir, "--mcore-dir", mc]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["max_abs_logit_diff"] <= 1e-5
    assert main(["mcore-to-mcore", "--mcore-dir", mc, "--out", flat, "--tp", "1", "--format", "legacy"]) == 0
    assert MegatronCheckpoint.open(flat).num_query_groups == 1
    assert main(["mcore-to-hf", "--mcore-dir", flat, "--out", back]) == 0
    a, b = read_all(hf_dir), read_all(back)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
