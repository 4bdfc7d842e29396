"""Every format pair on tiny models, bitwise: HF (safetensors single/sharded, .bin) <-> torch_dist <->
legacy per-rank (TP2 x PP2), local <-> Transformer Engine naming, and checkpoints written by
megatron.training itself."""

import json
import os
import sys

import pytest
import torch

from megatron_patch.conversion.engine import extra_state_names, make_plan
from megatron_patch.conversion.hf_io import read_all
from megatron_patch.conversion.legacy import load_legacy_file
from megatron_patch.convert import main
from megatron_patch.models import Layout
from megatron_patch.names import LEGACY_FILE
from tests.models import hf_model, llama_config, save_hf


def _assert_same(a: dict, b: dict):
    assert set(a) == set(b), set(a) ^ set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _ok(*argv):
    assert main(list(argv)) == 0, argv


@pytest.fixture(scope="module")
def src(tmp_path_factory, cpu_megatron):
    root = tmp_path_factory.mktemp("formats")
    model = hf_model(llama_config("bias"))
    hf = save_hf(model, str(root / "hf"))
    # the same weights as a legacy pytorch_model.bin folder
    bin_dir = root / "hf_bin"
    bin_dir.mkdir()
    torch.save(model.state_dict(), bin_dir / "pytorch_model.bin")
    (bin_dir / "config.json").write_text(open(os.path.join(hf, "config.json")).read())
    return root, hf, str(bin_dir), read_all(hf)


def test_bin_to_legacy_tp2pp2_to_hf(src):
    root, _, bin_dir, ref = src
    _ok("hf-to-mcore", "--hf-dir", bin_dir, "--out", str(root / "leg"), "--tp", "2", "--pp", "2", "--format", "legacy")
    step = root / "leg" / "release"
    assert sorted(os.listdir(step)) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    state = load_legacy_file(str(step / "mp_rank_01_001" / LEGACY_FILE))
    assert state["args"].tensor_model_parallel_size == 2 and state["checkpoint_version"] == 3.0
    assert "decoder.final_layernorm.weight" in state["model"]
    _ok("mcore-to-hf", "--mcore-dir", str(root / "leg"), "--out", str(root / "leg_hf"))
    _assert_same(ref, read_all(str(root / "leg_hf")))


def test_legacy_to_torch_dist_to_legacy_te_to_hf(src):
    root, hf, _, ref = src
    _ok("hf-to-mcore", "--hf-dir", hf, "--out", str(root / "leg2"), "--tp", "2", "--pp", "2", "--format", "legacy")
    _ok("mcore-to-mcore", "--mcore-dir", str(root / "leg2"), "--out", str(root / "dist"), "--format", "torch_dist",
        "--tp", "1", "--pp", "1")
    _ok("mcore-to-mcore", "--mcore-dir", str(root / "dist"), "--out", str(root / "te"), "--format", "legacy",
        "--impl", "transformer_engine", "--pp", "2")
    te = load_legacy_file(str(root / "te" / "release" / "mp_rank_00_000" / LEGACY_FILE))["model"]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te
    assert "decoder.layers.0.self_attention.core_attention._extra_state" in te
    assert not any("input_layernorm" in k for k in te)
    # TE naming -> local naming at another layout, then to HF
    _ok("mcore-to-mcore", "--mcore-dir", str(root / "te"), "--out", str(root / "local2"), "--impl", "local",
        "--tp", "2", "--pp", "1")
    local = load_legacy_file(str(root / "local2" / "release" / "mp_rank_01" / LEGACY_FILE))["model"]
    assert "decoder.layers.3.input_layernorm.weight" in local
    _ok("mcore-to-hf", "--mcore-dir", str(root / "local2"), "--out", str(root / "back"))
    _assert_same(ref, read_all(str(root / "back")))
    # and the torch_dist in the middle exports bitwise too
    _ok("mcore-to-hf", "--mcore-dir", str(root / "dist"), "--out", str(root / "dist_hf"))
    _assert_same(ref, read_all(str(root / "dist_hf")))


def test_legacy_verifies(src, capsys):
    root, hf, _, _ = src
    _ok("hf-to-mcore", "--hf-dir", hf, "--out", str(root / "leg_v"), "--pp", "2", "--format", "legacy",
        "--impl", "transformer_engine")
    capsys.readouterr()
    _ok("verify", "--hf-dir", hf, "--mcore-dir", str(root / "leg_v"), "--impl", "local")
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["max_abs_logit_diff"] <= 1e-5


def test_sharded_safetensors_input(src):
    root, _, _, ref = src
    sharded = root / "hf_sharded"
    _ok("hf-to-mcore", "--hf-dir", src[1], "--out", str(root / "d1"))
    _ok("mcore-to-hf", "--mcore-dir", str(root / "d1"), "--out", str(sharded), "--max-shard-size", "100KB")
    assert len([n for n in os.listdir(sharded) if n.endswith(".safetensors")]) > 2
    _ok("hf-to-mcore", "--hf-dir", str(sharded), "--out", str(root / "d2"), "--tp", "2", "--format", "legacy")
    _ok("mcore-to-hf", "--mcore-dir", str(root / "d2"), "--out", str(root / "d2_hf"))
    _assert_same(ref, read_all(str(root / "d2_hf")))


@pytest.mark.parametrize("variant", ["gqa", "tied", "mixtral", "qwen2_moe", "deepseek_v3"])
def test_extra_state_rule_matches_the_local_model(cpu_megatron, variant):
    from megatron_patch.models import build_model
    from tests.models import any_config

    cfg = any_config(variant)
    with torch.device("meta"):
        model = build_model(cfg, perform_initialization=False, use_cpu_initialization=True)
    real = {k for k in model.state_dict() if k.endswith("._extra_state")}
    assert real == extra_state_names(make_plan(cfg, Layout()), 0)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_checkpoint_written_by_megatron_training(src, tmp_path, monkeypatch, fmt):
    """megatron.training's own save_checkpoint (iteration 7, optimizer-free) -> export with --hf-config."""
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.global_vars import set_args

    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict
    from megatron_patch.models import build_model, load_hf_config

    root, hf, _, ref = src
    cfg = load_hf_config(hf)
    save_dir = str(tmp_path / "trained")
    monkeypatch.setattr(sys, "argv", ["pretrain", "--save", save_dir, "--ckpt-format", fmt, "--num-layers", "4",
                                      "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "32",
                                      "--micro-batch-size", "1", "--no-save-optim", "--no-save-rng"])
    args = parse_args()
    args.world_size, args.data_parallel_size, args.use_dist_ckpt = 1, 1, fmt == "torch_dist"
    args.async_save, args.consumed_train_samples = False, 0
    set_args(args)
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(0, None, global_batch_size=1, micro_batch_size=1, data_parallel_size=1)
    model = build_model(cfg)
    sd = ref
    load_rank_state_dict(model, hf_to_megatron(make_plan(cfg), sd.__getitem__, sd.keys())[(0, 0, 0)])
    save_checkpoint(7, [model], None, None, 0)
    assert open(os.path.join(save_dir, "latest_checkpointed_iteration.txt")).read().strip() == "7"
    out = str(tmp_path / "exported")
    assert main(["mcore-to-hf", "--mcore-dir", save_dir, "--out", out]) == 1  # no hf/ folder: must say so
    _ok("mcore-to-hf", "--mcore-dir", save_dir, "--out", out, "--hf-config", hf)
    _assert_same(ref, read_all(out))


def test_tensor_manifest_matches_what_was_written(src):
    """Each output carries tensors.json: names, shapes, dtypes and CRC-32 of the tensors as written."""
    from megatron_patch.conversion import manifest
    from megatron_patch.conversion.legacy import load_legacy_stage
    from megatron_patch.conversion.megatron_checkpoint import MegatronCheckpoint

    root, hf, _, ref = src
    _ok("hf-to-mcore", "--hf-dir", hf, "--out", str(root / "m_dist"), "--tp", "2")
    _ok("hf-to-mcore", "--hf-dir", hf, "--out", str(root / "m_leg"), "--pp", "2", "--format", "legacy")
    _ok("mcore-to-hf", "--mcore-dir", str(root / "m_dist"), "--out", str(root / "m_hf"))
    back = manifest.read(str(root / "m_hf"))
    assert set(back) == set(ref)
    for name, t in ref.items():
        assert back[name] == {"shape": list(t.shape), "dtype": "float32", "crc32": manifest.crc32(t)}
    leg = manifest.read(str(root / "m_leg"))
    ckpt = MegatronCheckpoint.open(str(root / "m_leg"))
    stage1 = load_legacy_stage(ckpt.step_dir, 1, 2, 1)[(0, 1, 0)]
    for name, t in stage1.items():
        if not name.endswith("._extra_state"):
            assert leg[f"mp_rank_00_001/{name}"]["crc32"] == manifest.crc32(t), name
    dist = manifest.read(str(root / "m_dist"))
    assert "embedding.word_embeddings.weight@0,0" in dist
    assert "decoder.layers.mlp.linear_fc1.weight@3,160,0" in dist  # layer 3, the "up" half


@pytest.mark.parametrize("variant", ["gqa", "mixtral", "deepseek_v3"])
def test_torch_dist_in_te_naming_runs_as_local(tmp_path, capsys, cpu_megatron, variant):
    """torch_dist keys tensors alike for both implementations: a checkpoint converted for Transformer
    Engine runs under the local implementation (a machine without TE) with HF's logits."""
    from tests.models import case, save_case

    hf = save_case(case(variant), str(tmp_path / "hf"))
    mc = str(tmp_path / "mc")
    _ok("hf-to-mcore", "--hf-dir", hf, "--out", mc, "--impl", "transformer_engine")
    capsys.readouterr()
    _ok("verify", "--hf-dir", hf, "--mcore-dir", mc, "--impl", "local")
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["impl"] == "local" and result["max_abs_logit_diff"] <= 1e-5
