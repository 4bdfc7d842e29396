"""A converted checkpoint loads through megatron.training's own `load_checkpoint` (the `--load` path,
strict), with and without `--finetune`, and the loaded model's logits match HF: torch_dist converted
for TP2 x PP2 loaded at TP1 (reshardable), and the legacy per-rank format at its own layout."""

import sys

import pytest

from megatron_patch.conversion.verify import compare, fixed_prompts, hf_logits
from megatron_patch.models import build_model, load_hf_config
from megatron_patch.runtime.logits import megatron_logits
from tests.models import hf_model, llama_config, save_hf
from toolkits.checkpoint_converter.__main__ import main


@pytest.mark.parametrize("fmt,layout,finetune", [
    ("torch_dist", ("2", "2"), True), ("torch_dist", ("2", "2"), False), ("legacy", ("1", "1"), False),
])
def test_megatron_training_load_checkpoint(cpu_megatron, tmp_path, monkeypatch, fmt, layout, finetune):
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.global_vars import set_args

    cfg = llama_config("tied")
    hf_dir = save_hf(hf_model(cfg), str(tmp_path / "hf"))
    mc = str(tmp_path / "mcore")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--tp", layout[0], "--pp", layout[1],
                 "--format", fmt]) == 0
    argv = ["pretrain", "--load", mc, "--no-load-optim", "--no-load-rng",
            "--ckpt-format", "torch" if fmt == "legacy" else fmt,
            "--num-layers", str(cfg["num_hidden_layers"]), "--hidden-size", str(cfg["hidden_size"]),
            "--num-attention-heads", str(cfg["num_attention_heads"]), "--seq-length", "32",
            "--micro-batch-size", "1", "--position-embedding-type", "rope", "--no-position-embedding",
            ] + (["--finetune"] if finetune else [])
    monkeypatch.setattr(sys, "argv", argv)
    args = parse_args()
    # what validate_args would derive for this run
    args.world_size, args.data_parallel_size, args.use_dist_ckpt = 1, 1, fmt == "torch_dist"
    set_args(args)
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()  # as initialize_megatron does (legacy checkpoints are torch.load-ed)
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(0, None, global_batch_size=1, micro_batch_size=1, data_parallel_size=1)
    model = build_model(load_hf_config(mc + "/hf"), padded_vocab_size=1024)
    iteration, _ = load_checkpoint([model], None, None, strict=True)
    assert iteration == 0
    ids = fixed_prompts(cfg["vocab_size"])
    result = compare(hf_logits(hf_dir, ids), megatron_logits(model.eval(), ids, cfg["vocab_size"]))
    assert result["max_abs_logit_diff"] <= 1e-5
