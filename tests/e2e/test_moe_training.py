"""Mixture-of-experts training on megatron.training (CPU, gloo): a tiny Mixtral and a tiny DeepSeek-V3 (MLA)
started from HF weights
(`--load-hf`, each EP rank reading only its experts) trains with the same losses at EP=2 (2 processes) as
at EP=1, its first loss is transformers' loss on that batch, and the loss falls."""

import contextlib
import io

import pytest
import torch

from tests import _cpu
from tests.helpers import pretrain_argv as _argv


def _run(rank: int, argv: list[str]) -> dict:
    _cpu.install_training()
    from megatron_patch.pretrain import main
    from megatron_patch.training import gpt

    logged, batches, get_batch = _cpu.record_train_steps(), [], gpt.get_batch

    def record_batch(it):
        batch = get_batch(it)
        batches.append({k: batch[k].clone() for k in ("tokens", "labels", "loss_mask")})
        return batch

    gpt.get_batch = record_batch
    with contextlib.redirect_stdout(io.StringIO()):
        main(argv)
    return {"losses": [r["lm loss"] for r in logged], "first_batches": batches[:2]}


def _hf_folder(root, variant: str) -> str:
    from megatron_patch.conversion.hf_io import copy_side_files
    from megatron_patch.tokenizer import TINY_TOKENIZER
    from tests.models import case, save_case

    path = str(root / variant)
    save_case(case(variant), path)
    copy_side_files(TINY_TOKENIZER, path, ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    return path


@pytest.mark.parametrize("variant", ["mixtral", "deepseek_v3"])
def test_expert_parallel_training_matches_ep1_and_hf(corpus, tmp_path, variant):  # noqa: F811
    hf_dir = _hf_folder(tmp_path, variant)
    extra = ["--train-iters", "6", "--make-vocab-size-divisible-by", "4", "--moe-token-dispatcher-type", "allgather"]
    ep1 = _cpu.run_world(1, _run, _argv(corpus, str(tmp_path / "a"), *extra, model=("--load-hf", hf_dir)))[0]
    ep2 = _cpu.run_world(2, _run, _argv(corpus, str(tmp_path / "b"), *extra, "--expert-model-parallel-size", "2",
                                        model=("--load-hf", hf_dir)))
    assert len(ep1["losses"]) == 6
    for rank in ep2:
        assert max(abs(a - b) for a, b in zip(rank["losses"], ep1["losses"])) <= 1e-5, (rank["losses"], ep1["losses"])
    assert sum(ep1["losses"][-2:]) < sum(ep1["losses"][:2])
    # the first iteration's loss is transformers' loss on the same tokens (mean over its micro-batches)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ref = []
    for b in ep1["first_batches"]:
        with torch.no_grad():
            logits = hf(b["tokens"]).logits
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), reduction="none")
        ref.append(float((nll * b["loss_mask"].flatten()).sum() / b["loss_mask"].sum()))
    assert abs(ep1["losses"][0] - sum(ref) / len(ref)) <= 1e-5, (ep1["losses"][0], ref)

