"""The families as megatron-core's `HybridModel` (`--model-class hybrid`, models/hybrid.py), CPU fp32:

- every tiny config whose layers are sequential attention + MLP: logits vs transformers <= 1e-5, and the
  same numbers as the family's GPTModel; the others (Falcon's parallel attention + MLP) are refused, saying why;
- our converter's torch_dist checkpoint (GPT format) loads into a HybridModel: through megatron-core's
  GPT -> Hybrid interop for the dense families, through `hybrid.load_torch_dist` for the mixture-of-experts
  ones; every parameter bitwise equal to the GPTModel's, logits vs transformers <= 1e-5; saved back as a
  HybridModel run saves it, it exports (mcore-to-hf) to the HF weights it came from, bitwise;
- megatron.training's own `load_checkpoint` (a HybridModel run's `--load`) reads it, at another layout;
- a HybridModel over two pipeline stages loads HF weights per stage and matches transformers;
- a `python -m megatron_patch.pretrain --model-class hybrid` run from an HF checkpoint has the GPT run's losses,
  its `--save-hf` export equals the GPT run's, and its checkpoint loads for generation (logits = transformers').
"""

import argparse
import os
import shutil
import sys

import pytest
import torch

from megatron_patch import compat
from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
from megatron_patch.conversion.verify import fixed_prompts
from megatron_patch.models import Layout, build_model, get_family
from megatron_patch.models.family import UnsupportedConfig
from megatron_patch.runtime.logits import megatron_logits
from tests.models import all_variants, case, save_case

# (the refusal under 0.18 is tested by faking the version, so it runs under 0.19 too)
pytestmark = pytest.mark.skipif(not compat.at_least("0.19"), reason="HybridModel is new in megatron-core 0.19")

# stacked (dense) checkpoints go through megatron-core's interop; per-layer ones (MoE) through ours
CHECKPOINT_VARIANTS = ["gqa", "tied", "llama3_rope", "qwen3", "glm4", "mistral_swa", "bloom", "starcoder",
                       "internlm2", "baichuan2", "mixtral", "qwen2_moe", "deepseek_v3"]


def _logits(model, c) -> torch.Tensor:
    return megatron_logits(model.eval(), fixed_prompts(c.vocab_size, batch=3, seq=48), c.vocab_size)


def _reference(c) -> torch.Tensor:
    with torch.no_grad():
        return c.ref(fixed_prompts(c.vocab_size, batch=3, seq=48)).logits


@pytest.mark.parametrize("variant", all_variants())
def test_hybrid_logits_match_transformers(cpu_megatron, variant):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from megatron_patch.models.hybrid import layer_pattern, to_hybrid_names

    c = case(variant)
    family = get_family(c.cfg)
    # attention and MLP side by side on the layer input (Falcon's parallel_attn): no HybridModel form
    if getattr(family, "parallel_attention", None) and family.parallel_attention(family.canonical(c.cfg)):
        with pytest.raises(UnsupportedConfig, match="not separate residual sublayers"):
            build_model(c.cfg, model_class="hybrid")
        return
    state = hf_to_megatron(make_plan(c.cfg, Layout()), c.sd.__getitem__, c.sd.keys())[(0, 0, 0)]
    model = build_model(c.cfg, model_class="hybrid")
    assert isinstance(model, HybridModel)
    pattern = layer_pattern(c.cfg)
    assert len(model.decoder.layers) == len(pattern) == 2 * int(model.config.num_layers // 2)
    assert set(pattern[0::2]) <= {"*", "+"} and set(pattern[1::2]) <= {"-", "E"}
    load_rank_state_dict(model, to_hybrid_names(state))
    gpt = build_model(c.cfg)
    load_rank_state_dict(gpt, state)
    out, ref, gpt_out = _logits(model, c), _reference(c), _logits(gpt, c)
    assert out.shape == ref.shape
    diff = (out - ref).abs().max().item()
    assert diff <= 1e-5, f"{variant}: max abs logit diff {diff}"
    assert (out - gpt_out).abs().max().item() <= 1e-6  # the GPTModel's function
    assert ref.std() > 0.1


def _hybrid_rank_logits(rank: int, cfg: dict, sd: dict, ids: torch.Tensor, tp: int, pp: int) -> torch.Tensor:
    from megatron_patch.conversion.engine import load_hf_into_rank
    from tests import _cpu

    _cpu.init_model_parallel(tp, pp)
    model = build_model(cfg, layout=Layout(tp, pp), model_class="hybrid")
    load_hf_into_rank(model, make_plan(cfg, Layout(tp, pp)), sd.__getitem__, sd.keys())  # GPT names renamed
    return megatron_logits(model.eval(), ids, int(cfg["vocab_size"]))


def test_hybrid_pipeline_stages_match_transformers():
    """A HybridModel over two pipeline stages (gloo), each loading its stage of the HF weights (stage-local
    GPT layer names renamed): a dense first layer and sparse ones (Qwen2-MoE). TP splits tensors the same
    way in both model classes (the TP2 x PP2 run matched too, 2.1e-6; 4 processes are slow on CI)."""
    from tests import _cpu

    c = case("qwen2_moe")
    ids = fixed_prompts(c.vocab_size, batch=2, seq=24)
    with torch.no_grad():
        ref = c.ref(ids).logits
    for out in _cpu.run_world(2, _hybrid_rank_logits, c.cfg, dict(c.sd), ids, 1, 2):
        assert (out - ref).abs().max().item() <= 1e-5


def _convert(c, tmp_path, *layout: str) -> str:
    from megatron_patch.convert import main

    hf = save_case(c, str(tmp_path / "hf"))
    out = str(tmp_path / "mcore")
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", out, "--format", "torch_dist", *layout]) == 0
    return out


@pytest.mark.parametrize("variant", CHECKPOINT_VARIANTS)
def test_converted_checkpoint_loads_into_hybrid(cpu_megatron, tmp_path, variant):
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_patch import patches
    from megatron_patch.conversion.megatron_checkpoint import MegatronCheckpoint, load_megatron_model
    from megatron_patch.models.hybrid import hybrid_name, load_torch_dist

    c = case(variant)
    ckpt = MegatronCheckpoint.open(_convert(c, tmp_path))
    stored = FileSystemReader(ckpt.step_dir).read_metadata().state_dict_metadata
    per_layer = any(k.startswith("decoder.layers.0.") for k in stored)
    assert per_layer == bool(c.cfg.get("num_local_experts") or c.cfg.get("num_experts")
                             or c.cfg.get("n_routed_experts"))  # dense: megatron-core's interop
    model = build_model(ckpt.hf_config, model_class="hybrid", padded_vocab_size=ckpt.padded_vocab_size,
                        perform_initialization=False)
    with patches.applied("cpu_cuda_calls"):
        load_torch_dist(model, ckpt.step_dir)
    gpt, _ = load_megatron_model(ckpt.path)
    hybrid = model.state_dict()
    for name, tensor in gpt.state_dict().items():
        if not name.endswith("_extra_state"):
            assert torch.equal(hybrid[hybrid_name(name)], tensor), name
    diff = (_logits(model, c) - _reference(c)).abs().max().item()
    assert diff <= 1e-5, f"{variant}: max abs logit diff {diff}"

    # and back: the HybridModel saved as a HybridModel run saves it (a layer per sublayer, decoder.final_norm)
    # exports to the HF weights it came from, bitwise
    from megatron.core import dist_checkpointing

    from megatron_patch.conversion.hf_io import read_all
    from megatron_patch.conversion.torch_dist import is_hybrid_checkpoint
    from megatron_patch.convert import main

    common = compat.load_torch_dist_common(ckpt.step_dir)
    shutil.rmtree(ckpt.step_dir)
    os.makedirs(ckpt.step_dir)
    with patches.applied("cpu_cuda_calls"):
        dist_checkpointing.save({"model": model.sharded_state_dict(), **common}, ckpt.step_dir)
    assert is_hybrid_checkpoint(ckpt.step_dir)
    back = str(tmp_path / "back")
    assert main(["mcore-to-hf", "--mcore-dir", ckpt.path, "--out", back]) == 0
    x, y = read_all(str(tmp_path / "hf")), read_all(back)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), variant


def test_megatron_training_loads_converted_checkpoint_into_hybrid(cpu_megatron, tmp_path, monkeypatch):
    """megatron.training's `load_checkpoint`, strict, as a HybridModel run does on `--load`: a checkpoint
    converted for TP2 x PP2, loaded at TP1 through megatron-core's GPT -> Hybrid interop."""
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.global_vars import set_args

    from megatron_patch.models.hybrid import layer_pattern

    c = case("tied")
    mc = _convert(c, tmp_path, "--tp", "2", "--pp", "2")
    pattern = layer_pattern(c.cfg)
    monkeypatch.setattr(sys, "argv", [
        "pretrain", "--load", mc, "--no-load-optim", "--no-load-rng", "--ckpt-format", "torch_dist",
        "--hybrid-layer-pattern", pattern, "--num-layers", str(len(pattern)),
        "--hidden-size", str(c.cfg["hidden_size"]), "--num-attention-heads", str(c.cfg["num_attention_heads"]),
        "--seq-length", "32", "--micro-batch-size", "1", "--position-embedding-type", "rope",
        "--no-position-embedding"])
    args = parse_args()
    args.world_size, args.data_parallel_size, args.use_dist_ckpt = 1, 1, True  # what validate_args derives
    set_args(args)
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(0, None, global_batch_size=1, micro_batch_size=1, data_parallel_size=1)
    model = build_model(c.cfg, model_class="hybrid", padded_vocab_size=1024, perform_initialization=False)
    iteration, _ = load_checkpoint([model], None, None, strict=True)
    assert iteration == 0
    diff = (_logits(model, c) - _reference(c)).abs().max().item()
    assert diff <= 1e-5, diff


def test_model_class_option(cpu_megatron, tmp_path):
    """`--model-class hybrid` sets megatron's pattern from the family and refuses what does not map."""
    from megatron_patch.training.arguments import apply_model_class
    from tests.models import family_config, llama_config

    args = argparse.Namespace(model_class="hybrid", hybrid_layer_pattern=None, num_layers=4, save_hf=None)
    apply_model_class(args, family_config("qwen2_moe"))
    assert (args.hybrid_layer_pattern, args.num_layers) == ("*-*E*E*E", 8)
    args = argparse.Namespace(model_class="gpt", hybrid_layer_pattern="*-*-*-*-", num_layers=4)
    with pytest.raises(ValueError, match="--hybrid-layer-pattern"):
        apply_model_class(args, llama_config())
    args = argparse.Namespace(model_class="hybrid", hybrid_layer_pattern=None, num_layers=4)
    with pytest.raises(UnsupportedConfig, match="falcon has no HybridModel form"):
        apply_model_class(args, family_config("falcon_7b"))


def test_megatron_core_without_hybrid_model_is_refused(monkeypatch):
    from packaging.version import Version

    from megatron_patch import compat

    monkeypatch.setattr(compat, "megatron_core_version", lambda: Version("0.18.2"))
    with pytest.raises(compat.UnsupportedVersion, match=r"HybridModel needs megatron-core >= 0.19 .*0\.18\.2"):
        compat.require_hybrid_model()


def _pretrain(rank: int, argv: list[str]) -> list[dict]:
    from tests import _cpu

    _cpu.install_training()
    logged = _cpu.record_train_steps()
    from megatron_patch.pretrain import main

    try:
        assert main(argv) == 0
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    return logged


def test_pretrain_hybrid_matches_gpt(tmp_path):
    """The same run as GPTModel and as HybridModel, from the same HF checkpoint: the same losses."""
    from megatron.core.dist_checkpointing import load_common_state_dict
    from transformers import AutoModelForCausalLM

    from megatron_patch.conversion.hf_io import read_all
    from megatron_patch.conversion.megatron_checkpoint import load_megatron_model
    from tests import _cpu
    from tests.helpers import corpus_dataset, pretrain_argv, tiny_lm_folder

    os.makedirs(tmp_path / "data")
    data = corpus_dataset(str(tmp_path / "data"), documents=100)
    hf = tiny_lm_folder(str(tmp_path / "hf"))
    runs = {}
    for model_class in ("gpt", "hybrid"):
        save = str(tmp_path / model_class / "ckpt")
        argv = pretrain_argv(data, save, "--train-iters", "4", "--save-interval", "4", "--make-vocab-size-divisible-by",
                             "4", "--model-class", model_class, "--save-hf", str(tmp_path / model_class / "hf"),
                             model=("--load-hf", hf))
        runs[model_class] = [step["lm loss"] for step in _cpu.run_world(1, _pretrain, argv)[0]]
    assert len(runs["gpt"]) == 4
    assert max(abs(a - b) for a, b in zip(runs["gpt"], runs["hybrid"])) <= 1e-5, runs
    saved = load_common_state_dict(str(tmp_path / "hybrid" / "ckpt" / "iter_0000004"))["args"]
    assert saved.hybrid_layer_pattern == "*-" * 4 and saved.num_layers == 8
    # the HybridModel run's checkpoint exports to HF (--save-hf) like the GPT run's: the same weights after the
    # same training, and it loads for generation / verify as a GPTModel (per-sublayer layers mapped back)
    gpt, hybrid = read_all(str(tmp_path / "gpt" / "hf")), read_all(str(tmp_path / "hybrid" / "hf"))
    assert gpt.keys() == hybrid.keys() and not torch.equal(gpt["lm_head.weight"], read_all(hf)["lm_head.weight"])
    assert max((gpt[k] - hybrid[k]).abs().max().item() for k in gpt) <= 1e-5
    ids = torch.tensor([[5, 17, 230, 41, 99, 3, 250, 8]])
    logits = {c: megatron_logits(load_megatron_model(str(tmp_path / c / "ckpt"))[0], ids, 1000) for c in runs}
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hybrid" / "hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(logits["hybrid"], reference(ids).logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits["hybrid"], logits["gpt"], atol=1e-4, rtol=0)
