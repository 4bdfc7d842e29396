"""A converted checkpoint loads through megatron.training's own `load_checkpoint` (the `--load` path,
strict), with and without `--finetune`, and the loaded model's logits match HF: torch_dist converted
for TP2 x PP2 loaded at TP1 (reshardable), and the legacy per-rank format at its own layout."""

import sys

import pytest

from megatron_patch.conversion.verify import compare, fixed_prompts, hf_logits
from megatron_patch.convert import main
from megatron_patch.models import build_model, load_hf_config
from megatron_patch.runtime.logits import megatron_logits
from tests.models import hf_model, llama_config, save_hf


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


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
@pytest.mark.parametrize("variant", ["gqa", "qwen2_moe"])
def test_use_checkpoint_args_gives_the_family_architecture(cpu_megatron, tmp_path, monkeypatch, fmt, variant):
    """megatron.training's `--use-checkpoint-args` (`load_args_from_checkpoint`) reads a converted checkpoint's
    `args` back as the same architecture our training writes from the HF config (`megatron_lm_args`, one map for
    both): every argument megatron reads from a checkpoint and the map names (SwiGLU, query groups, norms,
    experts) has the map's value."""
    from megatron.training.arguments import parse_args
    from megatron.training.checkpointing import load_args_from_checkpoint
    from megatron.training.global_vars import set_args

    from megatron_patch.models.megatron_args import megatron_lm_args
    from tests.models import case, save_case

    hf_dir = save_case(case(variant), str(tmp_path / "hf"))
    mc = str(tmp_path / "mcore")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--format", fmt]) == 0
    monkeypatch.setattr(sys, "argv", ["pretrain", "--load", mc, "--use-checkpoint-args",
                                      "--ckpt-format", "torch" if fmt == "legacy" else fmt])
    args = parse_args()
    args.use_dist_ckpt = fmt == "torch_dist"
    set_args(args)
    from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    loaded, _ = load_args_from_checkpoint(args)
    want = megatron_lm_args(load_hf_config(hf_dir))
    read = ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
            "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type",
            "add_position_embedding", "rotary_base", "rotary_percent", "rotary_interleaved", "add_bias_linear",
            "add_qkv_bias", "swiglu", "untie_embeddings_and_output_weights", "normalization", "attention_dropout",
            "hidden_dropout", "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_router_topk",
            "moe_router_pre_softmax", "moe_shared_expert_intermediate_size", "moe_router_score_function",
            "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor"]
    wrong = {k: (getattr(loaded, k, None), want[k]) for k in read if k in want and getattr(loaded, k, None) != want[k]}
    assert not wrong, wrong
    assert want["swiglu"]  # both are SwiGLU models: the argument megatron lacked from our checkpoints
