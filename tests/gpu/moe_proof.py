"""GPU proof of the mixture-of-experts path (docs/gpu_results.md), on `nvidia-h200-x2`:

- the Transformer Engine grouped-GEMM experts compute what the sequential (local) experts compute, from
  the same HF Mixtral weights, and both match transformers (fp32 and bf16 logits, router choices);
- a small Mixtral (8 experts, top-2) pretrains 50 iterations on the bundled corpus with expert parallelism
  EP=2 over NCCL (alltoall dispatcher), TE grouped GEMM, bf16: the loss falls; the same run at EP=1 on one
  GPU, from the same HF start, gives the same losses within bf16 tolerance.

Run: python tests/gpu/moe_proof.py OUT_DIR   (tests/gpu/test_moe_proof.py does); prints a JSON report."""

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.train_proof import compare, prepare, train  # noqa: E402

MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 1000, "hidden_size": 512,
           "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu",
           "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
           "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0}


def hf_init(cfg: dict):
    """transformers' own initialisation (std 0.02): logits of a sane scale, so routing is not a coin toss."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()


def grouped_vs_sequential(out: str) -> dict:
    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
    from megatron_patch.conversion.hf_io import HFCheckpoint
    from megatron_patch.conversion.verify import fixed_prompts
    from megatron_patch.models import Layout, build_model
    from megatron_patch.runtime.logits import megatron_logits
    from megatron_patch.runtime.parallel import ensure_model_parallel
    from tests.models import save_hf

    ensure_model_parallel(1, 1)
    cfg = {**MIXTRAL, "num_hidden_layers": 4}
    hf_dir = os.path.join(out, "hf_small")
    hf = hf_init(cfg)
    save_hf(hf, hf_dir)
    ckpt = HFCheckpoint(hf_dir)
    ids = fixed_prompts(1000, batch=4, seq=64)
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = {}
        for impl in ("local", "transformer_engine"):
            model = build_model(cfg, impl=impl, dtype=dtype, perform_initialization=False).eval()
            state = hf_to_megatron(make_plan(cfg, Layout(), impl), ckpt.get, ckpt.keys(), dtype)[(0, 0, 0)]
            load_rank_state_dict(model, state)
            if impl == "transformer_engine":
                rows["grouped_gemm"] = type(model.decoder.layers[0].mlp.experts).__name__
            logits[impl] = megatron_logits(model, ids, 1000)
            del model
        with torch.no_grad():
            torch.backends.cuda.matmul.allow_tf32 = False
            ref = hf.to(dtype).cuda()(ids.cuda()).logits.float().cpu()
            hf.float().cpu()
        name = str(dtype).replace("torch.", "")
        te, local = logits["transformer_engine"], logits["local"]
        rows[name] = {"te_grouped_vs_local_sequential": float((te - local).abs().max()),
                      "local_vs_hf": float((local - ref).abs().max()), "te_vs_hf": float((te - ref).abs().max()),
                      "top1_te_vs_local": float((te.argmax(-1) == local.argmax(-1)).float().mean())}
    return rows


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(),
              "te_vs_sequential": grouped_vs_sequential(out)}
    _, data = prepare(out)
    from megatron_patch.conversion.hf_io import copy_side_files
    from megatron_patch.tokenizer import TINY_TOKENIZER
    from tests.models import save_hf

    hf_dir = os.path.join(out, "mixtral_start")
    if not os.path.isdir(hf_dir):
        save_hf(hf_init(MIXTRAL), hf_dir)
        copy_side_files(TINY_TOKENIZER, hf_dir, ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    model = ["--load-hf", hf_dir]
    moe = ["--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
           "--moe-aux-loss-coeff", "0.0"]
    runs = {"ep2": train(out, "moe_ep2", 2, data, model, 50, "--expert-model-parallel-size", "2", *moe),
            "ep1": train(out, "moe_ep1", 1, data, model, 20, *moe)}
    ep2, ep1 = runs["ep2"]["losses"], runs["ep1"]["losses"]
    report["runs"] = {k: {"rc": v["rc"], "ms_per_iter": v["ms_per_iter"], "first": v["losses"].get(1),
                          "last": v["losses"].get(max(v["losses"], default=0)), "tail": v["tail"]}
                      for k, v in runs.items()}
    report["ep2_loss_1_5_last5"] = [sum(ep2.get(i, 0) for i in range(1, 6)) / 5,
                                    sum(ep2.get(i, 0) for i in range(46, 51)) / 5]
    report["ep2_vs_ep1_max_diff_1_20"] = compare(ep1, ep2, range(1, 21))
    report["losses"] = {k: v["losses"] for k, v in runs.items()}
    with open(os.path.join(out, "moe_proof.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "losses"}, indent=1))


if __name__ == "__main__":
    main()
