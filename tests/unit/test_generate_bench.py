"""benchmarks/generate_bench.py runs its whole logic on a CPU at the tiny shape (the GPU machine runs the
real table): the prompt file of mixed lengths is written and read back, every run gives a row, ours
produces every requested token (the script asserts it), and the batch-1 row carries ms per token next
to the bandwidth bound."""

import importlib.metadata
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_shape_on_cpu(tmp_path, cpu_megatron):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import generate_bench
    finally:
        sys.path.pop(0)
    prompts = tmp_path / "prompts.jsonl"
    result = generate_bench.main(["--shapes", "tiny", "--device", "cpu", "--impl", "local", "--dtype", "fp32",
                                  "--requests", "1", "3", "--new", "4", "--min-prompt", "4", "--max-prompt", "12",
                                  "--repeat", "1", "--hf", "hf", "--prompts", str(prompts),
                                  "--out", str(tmp_path / "r.json")])
    lengths = [len(json.loads(line)["prompt_ids"]) for line in open(prompts)]
    assert len(lengths) == 3 and all(4 <= n <= 12 for n in lengths)
    rows = result["rows"]
    assert [(r["requests"], r["run"]) for r in rows] == [
        (n, run) for n in (1, 3) for run in ("ours (dynamic engine)", "ours (static engine)", "HF generate")]
    assert all(r["tokens_per_s"] > 0 and "skipped" not in r for r in rows)
    assert all(r["ms_per_token"] > 0 and r["bound_ms"] > 0 for r in rows if r["requests"] == 1)
    versions = json.load(open(tmp_path / "r.json"))["versions"]
    assert versions["megatron-core"] == importlib.metadata.version("megatron-core")
