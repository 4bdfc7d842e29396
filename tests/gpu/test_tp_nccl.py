"""TP=2 / PP=2 over NCCL on two GPUs equal TP=1 (tests/gpu/tp_nccl.py under torchrun). Skipped
without two GPUs and Transformer Engine."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.gpu.test_te import HAVE_TE, _record

pytestmark = pytest.mark.skipif(not HAVE_TE or torch.cuda.device_count() < 2,
                                reason="needs two CUDA GPUs and Transformer Engine")


def test_tp2_pp2_over_nccl_match_tp1(tmp_path):
    out = str(tmp_path / "tp.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           os.path.join(os.path.dirname(__file__), "tp_nccl.py"), out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.load(open(out))
    _record(test="tp_nccl", rows=rows)
    for r in rows:
        d = r["vs_tp1"]
        # local: fp32 torch ops, only the reduction order changes; TE: TF32 GEMMs on both sides
        tol = 1e-4 if r["impl"] == "local" else 5e-2
        assert d["max_abs_logit_diff"] <= tol and d["top1_agreement"] >= 0.98, r
