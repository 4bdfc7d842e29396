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
    # FP8 converges like BF16: over the last ten iterations FP8's mean loss at most 4% above BF16's. Healthy runs
    # measured 1.5% behind (2026-12-01) and 1.3% / 2.0% / 2.5% / 4.3% ahead (2026-11-29, 11-30, 12-02, and 12-04
    # with torch.compile's fused kernels); the two trajectories part by more mid-run (4.1% at iteration 50 on
    # 2026-11-29) before they meet again. FP8's failures (overflowing scales, stale amax) leave it behind, above a
    # loss of 6 (> 45%), so the bound is one-sided at 4%; ahead, 10% still says the two runs train alike. The
    # largest single-iteration difference is reported (fp8_vs_bf16_max_diff_last10), not bounded: 0.062 to 0.188
    bf16_last, fp8_last = report["bf16_loss_1_10_last10"][1], report["fp8_loss_1_10_last10"][1]
    gap = (fp8_last - bf16_last) / bf16_last
    assert -0.10 <= gap <= 0.04, (gap, report["curves_every_10"])
    assert report["resume_max_diff"] <= 0.02  # bf16 kernels are not bitwise deterministic
    # the delayed-scaling run resumes with its saved scales and amax histories (TE 2.20 refused to load them
    # before the patch te_extra_state_safe_load): its losses follow the uninterrupted run's as bf16's do; FP8
    # rounding of the same small kernel differences is coarser, hence twice bf16's bound (measured 0.0047 on
    # 2026-12-04, bf16's 0.0079)
    assert report["fp8_resume_max_diff"] <= 0.04, report["runs"].get("fp8_resume")
    for key in ("tp2_vs_tp1_max_diff", "pp2_vs_tp1_max_diff"):
        if report[key] is not None:
            # bf16 rounding of differently split reductions (TP) and of the p2p activations (PP), over 20
            # iterations: the acceptance tolerance docs/gpu_results.md states (measured 0.032 / 0.034 on
            # 2026-11-29, 0.048 / 0.043 on 2026-11-30)
            assert report[key] <= 0.05, (key, report[key])
