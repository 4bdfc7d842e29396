"""Registry resolution and the LLaMA family's config translation and refusals."""

import json

import pytest

from megatron_patch.models import UnsupportedConfig, get_family, padded_vocab_size, register
from megatron_patch.models.registry import UnknownArchitecture
from tests.models import any_config, llama_config


def test_resolves_by_architecture_name_dict_and_folder(tmp_path):
    cfg = llama_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for key in ("llama", "LlamaForCausalLM", cfg, str(tmp_path)):
        assert get_family(key).name == "llama"


def test_unknown_architecture_names_it():
    with pytest.raises(UnknownArchitecture, match="GPT2LMHeadModel"):
        get_family({"architectures": ["GPT2LMHeadModel"]})


def test_register_plugin(monkeypatch):
    from megatron_patch.models import registry

    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))  # the alias does not outlive the test
    register("llama_alias", "megatron_patch.models.families.llama", ("MyLlamaForCausalLM",))
    assert get_family({"architectures": ["MyLlamaForCausalLM"]}).name == "llama"


def test_padded_vocab():
    assert padded_vocab_size(1000, 1) == 1024
    assert padded_vocab_size(1100, 2) == 1280
    assert padded_vocab_size(32000, 8) == 32768


def test_config_translation():
    fam = get_family("llama")
    ck = fam.config_kwargs(llama_config("head_dim"))
    assert (ck["num_attention_heads"], ck["num_query_groups"], ck["kv_channels"]) == (8, 2, 16)
    gk = fam.gpt_kwargs(llama_config("llama3_rope"))
    assert gk["rope_scaling"] and gk["rope_scaling_factor"] == 8.0 and gk["rotary_base"] == 500000.0
    assert fam.gpt_kwargs(llama_config("linear_rope"))["seq_len_interpolation_factor"] == 4.0
    assert fam.gpt_kwargs(llama_config("tied"))["share_embeddings_and_output_weights"]
    # llama3 scaling: megatron-core's GPTModel takes the factor; other parameters are the family's to apply
    assert fam.llama3_parameters(llama_config("llama3_rope")) is None
    assert fam.llama3_parameters(llama_config("llama3_rope_4k")) == {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 4096.0}
    ck = fam.config_kwargs(llama_config("attn_bias_only"))
    assert (ck["add_qkv_bias"], ck["add_bias_linear"]) == (True, False)
    assert fam.attn_out_bias(fam.canonical(llama_config("attn_bias_only")))


def test_new_families_resolve():
    from tests.models import family_config

    assert get_family("GPTJForCausalLM").name == "gptj"
    assert get_family(family_config("gpt_neox_seq")).name == "gpt_neox"
    assert get_family("gpt_neox").names.lm_head == "embed_out"  # what transformers writes (lm_head in memory)


@pytest.mark.parametrize("overrides,match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, "high_freq_factor"),
    ({"hidden_act": "relu"}, "hidden_act"),
])
def test_unsupported_configs_raise_clearly(overrides, match):
    fam = get_family("llama")
    cfg = llama_config(**overrides)
    with pytest.raises(UnsupportedConfig, match=match):
        fam.config_kwargs(cfg)
        fam.gpt_kwargs(cfg)


def test_megatron_config_back_to_hf(cpu_megatron):
    """(d): Megatron config -> HF config.json reproduces the architecture fields."""
    from transformers import AutoConfig

    from megatron_patch.models import transformer_config

    for variant in ("gqa", "tied", "llama3_rope", "linear_rope", "bias", "head_dim", "geglu", "qwen2", "qwen3",
                    "mistral", "mistral_swa", "starcoder2", "starcoder2_swa", "glm", "glm_tied", "glm4",
                    "attn_bias_only", "gptj"):
        cfg = any_config(variant)
        fam = get_family(cfg)
        back = fam.hf_config_from_megatron(transformer_config(cfg), fam.gpt_kwargs(cfg), cfg["vocab_size"])
        assert back["architectures"] == cfg["architectures"]
        assert fam.config_kwargs(back) == fam.config_kwargs(cfg), variant
        assert fam.gpt_kwargs(back) == fam.gpt_kwargs(cfg), variant
        # transformers reads it back as the same architecture
        hf = AutoConfig.for_model(**back)
        assert fam.config_kwargs(hf) == fam.config_kwargs(cfg), variant


def test_remote_code_families_need_their_config(cpu_megatron):
    from megatron_patch.models import transformer_config
    from tests.models import case

    cfg = case("qwen1").cfg
    fam = get_family(cfg)
    with pytest.raises(UnsupportedConfig, match="remote-code"):
        fam.hf_config_from_megatron(transformer_config(cfg), fam.gpt_kwargs(cfg), cfg["vocab_size"])
    # GPT-NeoX's block shape (use_parallel_residual) is in its layer spec, not in Megatron's config
    cfg = any_config("gpt_neox")
    fam = get_family(cfg)
    with pytest.raises(UnsupportedConfig, match="use_parallel_residual"):
        fam.hf_config_from_megatron(transformer_config(cfg), fam.gpt_kwargs(cfg), cfg["vocab_size"])


def test_registry_agrees_with_the_family_classes():
    """Each registry entry resolves to a family whose declared name and architectures are the entry's own, so a
    family file and its registry line cannot drift apart (e.g. an architecture added in one place only)."""
    from megatron_patch.models.registry import families

    for name, archs in families().items():
        family = get_family(name)
        assert family.name == name, (name, family.name)
        assert tuple(family.architectures) == tuple(archs), (name, family.architectures, archs)
        for arch in archs:
            assert get_family(arch) is family, arch


def test_every_family_is_tested_everywhere():
    """Every registered family has a config in the HF-parity list (tests/models.py `all_variants`), the layout
    list (tests/distributed/test_layouts.py) and the Transformer Engine list of the GPU suite
    (tests/gpu/test_families_te.py): docs/adding-a-family.md."""
    from megatron_patch.models.registry import families
    from tests.distributed.test_layouts import VARIANTS as LAYOUTS
    from tests.gpu.test_families_te import VARIANTS as TE
    from tests.models import all_variants, any_config
    from tests.remote import REMOTE_VARIANTS

    def family(variant: str) -> str:
        cfg = REMOTE_VARIANTS[variant]().cfg if variant in REMOTE_VARIANTS else any_config(variant)
        return get_family(cfg).name

    names = {v: family(v) for v in set(all_variants()) | set(LAYOUTS) | set(TE)}
    for what, variants in (("parity", all_variants()), ("layouts", LAYOUTS), ("GPU TE", TE)):
        missing = set(families()) - {names[v] for v in variants}
        assert not missing, f"families without a config in the {what} list: {sorted(missing)}"


def test_rope_is_fused_on_a_gpu_with_te_except_for_mla(cpu_megatron, monkeypatch):
    """RoPE runs as Transformer Engine's fused kernel where there is a GPU and TE (unfused it is ~14 small
    kernels a layer, a sixth of an 8B decode step), never on the CPU, and not for MLA, which megatron-core
    refuses it for (YaRN only, training only)."""
    import torch

    from megatron_patch.models import build, transformer_config

    assert build.runtime_config_kwargs()["apply_rope_fusion"] is (torch.cuda.is_available()
                                                                   and build.transformer_engine_available())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "transformer_engine_available", lambda: True)
    assert build.runtime_config_kwargs()["apply_rope_fusion"] is True
    monkeypatch.setattr(build, "transformer_engine_available", lambda: False)
    assert build.runtime_config_kwargs()["apply_rope_fusion"] is False
    monkeypatch.setattr(build, "transformer_engine_available", lambda: True)
    for variant in ("deepseek_v2", "deepseek_v3"):
        assert transformer_config(any_config(variant)).apply_rope_fusion is False, variant
