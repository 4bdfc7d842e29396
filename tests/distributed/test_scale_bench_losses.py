"""Loss equality across layouts, the check `benchmarks/scale_bench.py losses` runs on the GPUs, here at tiny
size on Megatron's CPU path (2-process gloo worlds, fp32): from the same random HF checkpoint (`--load-hf`),
on the same mock-data global batch, DP2, TP2, PP2 and PP2 x VPP2 of a LLaMA, and DP2 and EP2 of a Mixtral, log the same
loss at every iteration within 1e-5 (the log prints 7 significant digits), while the loss falls (so the
comparison is not of constants)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_layouts_train_with_the_same_losses_on_cpu(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "scale_bench.py"), "losses", "--cpu", "--shapes", "tiny",
           "tiny-moe", "--gpus", "2", "--iters", "6", "--global-batch", "8", "--work", str(tmp_path),
           "--extra", "--lr 3e-3 --min-lr 3e-4", "--out", str(tmp_path / "rows.jsonl")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT,
                       env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    reports = {r["shape"]: r for r in (json.loads(x) for x in p.stdout.splitlines() if x.startswith("{"))
               if r.get("kind") == "losses"}
    runs = [json.loads(line) for line in open(tmp_path / "rows.jsonl")]
    assert len(runs) == 6 and all(r["kind"] == "loss_run" and "error" not in r for r in runs)
    expected = {"tiny": ["2 x dp2", "2 x tp2 dp1", "2 x pp2 dp1", "2 x pp2 vp2 dp1"],
                "tiny-moe": ["2 x dp2", "2 x ep2 dp2"]}
    for shape, layouts in expected.items():
        r = reports[shape]
        assert (r["precision"], r["tolerance"], r["reference"], r["ok"]) == ("fp32", 1e-5, layouts[0], True), r
        assert list(r["losses"]) == layouts and all(len(v) == 6 for v in r["losses"].values())
        for row in r["rows"]:
            assert row["max_abs_diff"] <= 1e-5, (shape, row)
        reference = r["losses"][layouts[0]]
        assert reference[-1] < reference[0] - 0.05, reference  # it trains
