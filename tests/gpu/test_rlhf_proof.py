"""The RLHF proof on the GPU machine (tests/gpu/rlhf_proof.py); figures in docs/gpu_results.md."""

import json
import os
import subprocess
import sys

import pytest

from tests.gpu.test_te import HAVE_TE, _record

pytestmark = pytest.mark.skipif(not HAVE_TE, reason="needs a CUDA GPU and Transformer Engine")


def test_reward_model_dpo_grpo_on_gpu(tmp_path):
    out = os.environ.get("RLHF_PROOF_DIR", str(tmp_path))
    script = os.path.join(os.path.dirname(__file__), "rlhf_proof.py")
    p = subprocess.run([sys.executable, script, out], capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    report = json.load(open(os.path.join(out, "rlhf_proof.json")))
    _record(test="rlhf_proof", **report)
    rm, dpo, grpo = report["reward_model"], report["dpo"], report["grpo"]
    assert rm["rc"] == dpo["rc"] == grpo["rc"] == 0, report
    assert rm["accuracy_last5"] >= 0.9 and rm["margin_last5"] > rm["margin_1_5"]
    assert dpo["accuracy_last5"] >= 0.9 and dpo["margin_last5"] > 0.5
    assert grpo["reward_last"] > grpo["reward_first"] + 0.1
