"""GPU proof of the training path (docs/gpu_results.md): a ~125M LLaMA-family model pretrains on the
bundled corpus with `python -m megatron_patch.pretrain` (Transformer Engine), and prints a JSON report:

- bf16 and fp8 (hybrid, delayed) runs of ITERS iterations: the loss falls;
- save at ITERS/2 and resume (bf16; fp8 with delayed scaling, whose scaling state TE pickles: patch
  `te_extra_state_safe_load`): the losses after the resume equal the uninterrupted run's;
- TP=2 and PP=2 (when 2 GPUs are visible), started from the same HF weights as a TP=1 run: same losses
  within bf16 tolerance;
- SFT with packing (`python -m megatron_patch.sft`, TE's THD attention) on synthetic chats: runs, loss falls.

Run: python tests/gpu/train_proof.py OUT_DIR [--iters 100]   (tests/gpu/test_train_proof.py does)"""

import argparse
import gzip
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_patch.training.log import parse_log  # noqa: E402

MODEL = {  # LLaMA shape, ~125M parameters with a 1000-token vocabulary
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 768,
    "intermediate_size": 2560, "num_hidden_layers": 16, "num_attention_heads": 12, "num_key_value_heads": 4,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0,
}


def prepare(out: str) -> tuple[str, str]:
    from megatron_patch.preprocess_data import preprocess
    from megatron_patch.tokenizer import CORPUS, TINY_TOKENIZER

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(MODEL, f)
    prefix = os.path.join(out, "corpus")
    if not os.path.isfile(prefix + "_text_document.idx"):
        with gzip.open(CORPUS, "rt") as f, open(os.path.join(out, "corpus.jsonl"), "w") as o:
            o.write(f.read())
        preprocess([os.path.join(out, "corpus.jsonl")], prefix, TINY_TOKENIZER, workers=8, append_eod=True)
    return os.path.join(out, "config.json"), prefix + "_text_document"


def train(out: str, name: str, nproc: int, data: str | None, model: list[str], iters: int, *extra: str,
          entry: str = "pretrain") -> dict:
    """`megatron_patch.<entry>` under torchrun on `nproc` GPUs (data None: megatron's mock data); its log is
    OUT/NAME.log. Returns rc, the losses by iteration, the median ms per iteration and, when it failed, the
    log's tail."""
    from megatron_patch.tokenizer import TINY_TOKENIZER
    from megatron_patch.training.profiles import BACKEND_VARIABLES

    if data is None:
        data_args = ["--mock-data"]
    else:
        data_args = ["--sft-data", data] if entry == "sft" else ["--data-path", data, "--split", "100,0,0"]
    # --standalone: a free port of torchrun's own choosing, so that runs side by side (`test_paths._train_all`) do
    # not meet on one
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", f"megatron_patch.{entry}", *model, *data_args,
           "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", TINY_TOKENIZER,
           "--seq-length", "512", "--micro-batch-size", "8", "--global-batch-size", "32", "--train-iters", str(iters),
           "--lr", "6e-4", "--min-lr", "6e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "10",
           "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-interval", "1", "--eval-iters", "0",
           "--eval-interval", "100000", "--seed", "1234", "--no-gradient-accumulation-fusion",
           "--make-vocab-size-divisible-by", "4", "--data-cache-path", os.path.join(out, "cache"),
           "--transformer-impl", "transformer_engine", "--precision", "bf16", *extra]
    # without the NVTE_*_ATTN variables megatron-core sets in a process that built a model (to 1 for its automatic
    # backend: an earlier test in this one): a run with --attention-backend fused would refuse them, and the
    # throughput profile leaves a user's variables alone (`training.profiles.flash_attention_suits`)
    env = {**{k: v for k, v in os.environ.items() if k not in BACKEND_VARIABLES}, "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": ROOT + ":" + os.environ.get("PYTHONPATH", "")}
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        p = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    text = open(os.path.join(out, f"{name}.log")).read()
    log = parse_log(text)
    return {"rc": p.returncode, "losses": log.series("lm loss"),
            "ms_per_iter": log.median("elapsed time per iteration (ms)"), "tail": text[-3000:] if p.returncode else ""}


def compare(a: dict, b: dict, iters) -> float | None:
    common = [i for i in iters if i in a and i in b]
    return max(abs(a[i] - b[i]) for i in common) if common else None


def rel_gap(a: dict, b: dict, iters) -> float | None:
    """|mean(b) - mean(a)| / mean(a) over the iterations both runs logged."""
    common = [i for i in iters if i in a and i in b]
    if not common:
        return None
    ma, mb = sum(a[i] for i in common) / len(common), sum(b[i] for i in common) / len(common)
    return abs(mb - ma) / ma


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--only", default="bf16,fp8,layouts,sft", help="comma-separated parts to run")
    a = ap.parse_args()
    out, n, half = a.out, a.iters, a.iters // 2
    config, data = prepare(out)
    from tests.models import hf_model, save_hf

    hf_dir = os.path.join(out, "hf_start")
    if not os.path.isdir(hf_dir):
        save_hf(hf_model(MODEL), hf_dir)
        from megatron_patch.conversion.hf_io import copy_side_files
        from megatron_patch.tokenizer import TINY_TOKENIZER

        copy_side_files(TINY_TOKENIZER, hf_dir, ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    runs = {}
    scratch = ["--hf-config", config]
    runs["bf16"] = train(out, "bf16", 1, data, scratch, n, "--save", os.path.join(out, "ck_bf16"), "--save-interval",
                         str(half))
    # resume the saved iteration ITERS/2 of that run into another folder, to ITERS
    runs["bf16_resume"] = train(out, "bf16_resume", 1, data, scratch, n, "--load", os.path.join(out, "ck_bf16"),
                                "--ckpt-step", str(half), "--save", os.path.join(out, "ck_resume"),
                                "--save-interval", str(10 * n))
    from_hf = ["--load-hf", hf_dir]
    short = max(20, n // 5)
    if "fp8" in a.only:
        fp8_flags = ["--precision", "fp8", "--fp8-recipe", "delayed"]
        runs["fp8"] = train(out, "fp8", 1, data, scratch, n, *fp8_flags, "--save", os.path.join(out, "ck_fp8"),
                            "--save-interval", str(half))
        runs["fp8_resume"] = train(out, "fp8_resume", 1, data, scratch, n, *fp8_flags, "--load",
                                   os.path.join(out, "ck_fp8"), "--ckpt-step", str(half), "--save",
                                   os.path.join(out, "ck_fp8_resume"), "--save-interval", str(10 * n))
    if "layouts" in a.only:
        runs["hf_tp1"] = train(out, "hf_tp1", 1, data, from_hf, short)
    if "layouts" in a.only and torch.cuda.device_count() >= 2:
        runs["hf_tp2"] = train(out, "hf_tp2", 2, data, from_hf, short, "--tensor-model-parallel-size", "2")
        runs["hf_pp2"] = train(out, "hf_pp2", 2, data, from_hf, short, "--pipeline-model-parallel-size", "2")
    if "sft" in a.only:
        # packed chat data through TE's THD attention (PackedSeqParams), from the HF start
        from tests.helpers import conversations

        chats = os.path.join(out, "chats.jsonl")
        with open(chats, "w") as f:
            f.writelines(json.dumps(c) + "\n" for c in conversations(2000))
        runs["sft"] = train(out, "sft", 1, chats, from_hf, 30, "--lr", "1e-3", entry="sft")
    empty = {"losses": {}}
    bf16, fp8 = runs["bf16"]["losses"], runs.get("fp8", empty)["losses"]
    tp1 = runs.get("hf_tp1", empty)["losses"]
    report = {
        "device": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "iters": n,
        "runs": {k: {"rc": v["rc"], "ms_per_iter": v["ms_per_iter"], "first": v["losses"].get(1),
                     "last": v["losses"].get(max(v["losses"], default=0)), "tail": v["tail"]} for k, v in runs.items()},
        "bf16_loss_1_10_last10": [sum(bf16.get(i, 0) for i in range(1, 11)) / 10,
                                  sum(bf16.get(i, 0) for i in range(n - 9, n + 1)) / 10],
        "fp8_loss_1_10_last10": [sum(fp8.get(i, 0) for i in range(1, 11)) / 10,
                                 sum(fp8.get(i, 0) for i in range(n - 9, n + 1)) / 10],
        "fp8_vs_bf16_max_diff_last10": compare(bf16, fp8, range(n - 9, n + 1)),
        "fp8_vs_bf16_rel_gap_last10": rel_gap(bf16, fp8, range(n - 9, n + 1)),
        "curves_every_10": {k: [runs[k]["losses"].get(i) for i in [1, *range(10, n + 1, 10)]]
                            for k in ("bf16", "fp8") if k in runs},
        "resume_max_diff": compare(bf16, runs["bf16_resume"]["losses"], range(half + 1, n + 1)),
        "resume_iters": sorted(runs["bf16_resume"]["losses"])[:1] + sorted(runs["bf16_resume"]["losses"])[-1:],
        "fp8_resume_max_diff": (compare(fp8, runs["fp8_resume"]["losses"], range(half + 1, n + 1))
                                if "fp8_resume" in runs else None),
        "tp2_vs_tp1_max_diff": compare(tp1, runs.get("hf_tp2", empty)["losses"], range(1, short + 1)),
        "pp2_vs_tp1_max_diff": compare(tp1, runs.get("hf_pp2", empty)["losses"], range(1, short + 1)),
        "sft_loss_1_3_last3": [sum(runs.get("sft", empty)["losses"].get(i, 0) for i in (1, 2, 3)) / 3,
                               sum(runs.get("sft", empty)["losses"].get(i, 0) for i in (28, 29, 30)) / 3],
        "losses": {k: v["losses"] for k, v in runs.items()},
    }
    with open(os.path.join(out, "train_proof.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "losses"}, indent=1))


if __name__ == "__main__":
    main()
