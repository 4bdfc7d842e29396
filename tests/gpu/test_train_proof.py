"""The training proof on the GPU machine (tests/gpu/train_proof.py); figures in docs/gpu_results.md."""

import pytest

from tests.gpu.test_te import HAVE_TE, run_proof

pytestmark = pytest.mark.skipif(not HAVE_TE, reason="needs a CUDA GPU and Transformer Engine")


def test_pretrain_bf16_fp8_resume_and_layouts(tmp_path):
    report = run_proof("train_proof", tmp_path, timeout=1800)
    assert all(r["rc"] == 0 for r in report["runs"].values()), report["runs"]
    for key in ("bf16_loss_1_10_last10", "fp8_loss_1_10_last10"):
        first, last = report[key]
        assert last < first - 1.0, (key, first, last)  # the loss falls
    assert report["fp8_vs_bf16_max_diff_last10"] <= 0.1  # FP8 converges like BF16
    assert report["resume_max_diff"] <= 0.02  # bf16 kernels are not bitwise deterministic
    for key in ("tp2_vs_tp1_max_diff", "pp2_vs_tp1_max_diff"):
        if report[key] is not None:
            # bf16 rounding of differently split reductions (TP) and of the p2p activations (PP), over 20
            # iterations: the acceptance tolerance docs/gpu_results.md states (measured 0.032 / 0.034 on
            # 2026-11-29, 0.048 / 0.043 on 2026-11-30)
            assert report[key] <= 0.05, (key, report[key])
