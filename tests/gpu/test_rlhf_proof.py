"""The RLHF proof on the GPU machine (tests/gpu/rlhf_proof.py); figures in docs/gpu_results.md."""

import pytest

from tests.gpu.test_te import HAVE_TE, run_proof

pytestmark = pytest.mark.skipif(not HAVE_TE, reason="needs a CUDA GPU and Transformer Engine")


def test_reward_model_dpo_grpo_on_gpu(tmp_path):
    report = run_proof("rlhf_proof", tmp_path, timeout=1200)
    rm, dpo, grpo = report["reward_model"], report["dpo"], report["grpo"]
    assert rm["rc"] == dpo["rc"] == grpo["rc"] == 0, report
    assert rm["accuracy_last5"] >= 0.9 and rm["margin_last5"] > rm["margin_1_5"]
    assert dpo["accuracy_last5"] >= 0.9 and dpo["margin_last5"] > 0.5
    assert grpo["reward_last"] > grpo["reward_first"] + 0.1
