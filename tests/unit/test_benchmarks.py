"""The benchmark scripts' CPU-checkable parts: the training benchmark's commands (every side takes the
same samples per optimizer step; each run's profile and flags reach the pretrain command) and the trace
summary's arithmetic."""

import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _dry_run(*args: str) -> list[list[str]]:
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_bench.py"), "--dry-run", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return [shlex.split(line) for line in p.stdout.strip().splitlines()]


def _opt(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_training_benchmark_commands():
    (none, default, mbs2, graphs) = _dry_run("--shapes", "8b", "--runs", "bf16 none", "bf16", "bf16 mbs2",
                                             "fp8 +graph-full")
    for cmd in (none, default, mbs2, graphs):
        # 8 micro-batches of 8192 tokens per optimizer step, whatever the micro-batch size
        assert int(_opt(cmd, "--global-batch-size")) == 8 and _opt(cmd, "--seq-length") == "8192"
    assert (_opt(none, "--throughput-profile"), _opt(default, "--throughput-profile")) == ("none", "default")
    assert (_opt(default, "--micro-batch-size"), _opt(mbs2, "--micro-batch-size")) == ("1", "2")
    assert _opt(graphs, "--precision") == "fp8" and _opt(graphs, "--cuda-graph-impl") == "full_iteration"
    assert _opt(graphs, "--throughput-profile") == "benchmark"  # megatron wants the NaN check off with it
    dp2, tp2 = _dry_run("--shapes", "8b-full", "--gpus", "2", "--runs", "fp8 dp2", "fp8 tp2")
    assert _opt(dp2, "--nproc_per_node") == "2" and _opt(dp2, "--global-batch-size") == "16"  # 8 per replica
    assert _opt(tp2, "--global-batch-size") == "8" and "--sequence-parallel" in tp2


def test_trace_summary_groups_kernels_and_finds_idle_time(tmp_path):
    from trace_summary import summarise_folder

    events = [  # microseconds; two streams overlap in 100-150, the GPU idles in 250-400
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 0, "dur": 150},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce", "ts": 100, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel", "ts": 200, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "multi_tensor_apply_kernel<adam>", "ts": 400, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # host events are ignored
    ]
    (tmp_path / "rank0.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    out = summarise_folder(str(tmp_path))
    assert out["window_ms"] == 0.5 and out["idle_ms"] == 0.15 and out["idle_share"] == 0.3
    assert {k: v["ms"] for k, v in out["categories"].items()} == {
        "gemm": 0.15, "communication": 0.1, "optimizer": 0.1, "attention": 0.05}
