"""The training proof on the GPU machine (tests/gpu/train_proof.py); figures in docs/gpu_results.md."""

import json
import os
import subprocess
import sys

import pytest

from tests.gpu.test_te import HAVE_TE, _record

pytestmark = pytest.mark.skipif(not HAVE_TE, reason="needs a CUDA GPU and Transformer Engine")


def test_pretrain_bf16_fp8_resume_and_layouts(tmp_path):
    out = os.environ.get("TRAIN_PROOF_DIR", str(tmp_path))
    script = os.path.join(os.path.dirname(__file__), "train_proof.py")
    p = subprocess.run([sys.executable, script, out], capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-4000:]
    report = json.load(open(os.path.join(out, "train_proof.json")))
    _record(test="train_proof", **{k: v for k, v in report.items() if k != "losses"})
    assert all(r["rc"] == 0 for r in report["runs"].values()), report["runs"]
    for key in ("bf16_loss_1_10_last10", "fp8_loss_1_10_last10"):
        first, last = report[key]
        assert last < first - 1.0, (key, first, last)  # the loss falls
    assert report["fp8_vs_bf16_max_diff_last10"] <= 0.1  # FP8 converges like BF16
    assert report["resume_max_diff"] <= 0.02  # bf16 kernels are not bitwise deterministic
    for key in ("tp2_vs_tp1_max_diff", "pp2_vs_tp1_max_diff"):
        if report[key] is not None:
            assert report[key] <= 0.02, key
