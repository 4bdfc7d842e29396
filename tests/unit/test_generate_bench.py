"""benchmarks/generate_bench.py runs its whole logic on a CPU at the tiny shape (the GPU machine runs the
real table): the prompt file of mixed lengths is written and read back, every run gives a row, ours
produces every requested token (the script asserts it), and the batch-1 row carries ms per token next
to the bandwidth bound. No assertion here reads a measured time: its sign and size depend on the machine's
load (a loaded CPU once gave HF a negative ms per token); the arithmetic on the times is tested on given
numbers instead."""

import importlib.metadata
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import generate_bench
    finally:
        sys.path.pop(0)
    return generate_bench


def test_timing_fields():
    """tokens/s = N x new / seconds; ms per decoded token = (seconds - one-token seconds) / (new - 1)."""
    bench = _bench()
    assert bench.timing_fields(3, 4, 0.25, None, 0.5) == {"seconds": 0.25, "tokens_per_s": 48.0}
    assert bench.timing_fields(1, 5, 0.9, 0.1, 0.0123456) == {"seconds": 0.9, "tokens_per_s": 5.6,
                                                              "ms_per_token": 200.0, "bound_ms": 0.01235}
    # a one-token call slower than the whole one (a busy machine): reported as measured
    assert bench.timing_fields(1, 4, 0.2, 0.5, 1.0)["ms_per_token"] == -100.0


def test_vs_hf():
    """Each timed row against the HF row of its request count; none where that HF row is missing or skipped."""
    bench = _bench()
    rows = [{"requests": 1, "run": "ours (dynamic engine)", "seconds": 0.5},
            {"requests": 1, "run": "HF generate", "seconds": 2.0},
            {"requests": 1, "run": "ours (static engine)", "skipped": "RuntimeError: no"},
            {"requests": 3, "run": "ours (dynamic engine)", "seconds": 0.5},
            {"requests": 3, "run": "HF generate", "skipped": "RuntimeError: no"}]
    bench.add_vs_hf(rows)
    assert [r.get("vs_hf") for r in rows] == [4.0, 1.0, None, None, None]


def test_tiny_shape_on_cpu(tmp_path, cpu_megatron):
    generate_bench = _bench()
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
    assert all("skipped" not in r for r in rows)
    # the timing columns are there and are numbers; their values are the machine's (test_timing_fields)
    timed = [r[k] for r in rows for k in ("seconds", "tokens_per_s")]
    timed += [r["ms_per_token"] for r in rows if r["requests"] == 1]
    assert all(isinstance(t, float) and math.isfinite(t) for t in timed)
    assert all("ms_per_token" not in r for r in rows if r["requests"] > 1)
    # the bound is no timing: the bytes of the tiny model's weights over --bandwidth-tb-s
    assert all(r["bound_ms"] > 0 for r in rows if r["requests"] == 1)
    versions = json.load(open(tmp_path / "r.json"))["versions"]
    assert versions["megatron-core"] == importlib.metadata.version("megatron-core")


def test_one_table_over_several_calls_with_a_results_file(tmp_path, cpu_megatron, monkeypatch):
    """`--results FILE` (benchmarks/results_file.py): rows kept by an earlier call of the same command are taken,
    and a shape whose rows are all kept is not even built (the final 1B/8B table of issue 27 takes more than one
    10-minute call); another setting is refused in one line. The bandwidth of the bound is the GPU's own unless
    given (here, without one, the H200's default)."""
    bench = _bench()
    args = ["--shapes", "tiny", "--device", "cpu", "--impl", "local", "--dtype", "fp32", "--requests", "1", "2",
            "--new", "3", "--min-prompt", "4", "--max-prompt", "12", "--repeat", "1", "--hf", "hf", "--engines",
            "dynamic", "--prompts", str(tmp_path / "p.jsonl"), "--results", str(tmp_path / "g.jsonl")]
    first = bench.main(args)["rows"]
    assert [(r["requests"], r["run"]) for r in first] == [(n, run) for n in (1, 2)
                                                         for run in ("ours (dynamic engine)", "HF generate")]
    import megatron_patch.models

    monkeypatch.setattr(megatron_patch.models, "build_model", lambda *a, **k: pytest.fail("every row is kept"))
    second = bench.main(args)["rows"]
    assert second == first  # the same rows, vs_hf included
    with pytest.raises(SystemExit, match="holds results of another settings"):
        bench.main([*args[:-2], "--new", "4", *args[-2:]])
    with pytest.raises(SystemExit):  # TE's SwiGLU op needs TE's layers: argparse's one line, exit 2
        bench.parse_args([*args, "--te-swiglu"])
    assert bench.bandwidth(bench.parse_args(args)) == 4.8
    assert bench.bandwidth(bench.parse_args([*args, "--bandwidth-tb-s", "3.35"])) == 3.35
    from machine import hbm_tb_s

    assert [hbm_tb_s(n) for n in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 NVL", "NVIDIA H800", None)] \
        == [4.8, 3.35, 3.9, 3.35, 4.8]


def test_multi_latent_attention_shape_on_both_engines(tmp_path, cpu_megatron):
    """A DeepSeek shape (multi-latent attention) runs its rows on both engines, on the dynamic one with CUDA graphs
    of its decode steps on a GPU by default (no effect on a CPU, where it runs anyway, without graphs);
    `--no-mla-gpu`, `--no-mla-graphs`, `--no-mla-rope` (its RoPE kernel) and `--no-moe-router-fusion` (TE's fused
    router) switch them off for the rows and put them back after (the switches of before, `--mla-gpu`,
    `--mla-graphs`, `--mla-rope` and `--moe-router-fusion`, are still accepted)."""
    from megatron_patch.inference import decode_rope, dynamic

    args = ["--shapes", "tiny-mla", "--device", "cpu", "--impl", "local", "--dtype", "fp32", "--requests", "2",
            "--new", "3", "--min-prompt", "4", "--max-prompt", "70", "--repeat", "1", "--hf", "hf", "--prompts",
            str(tmp_path / "p.jsonl")]
    result = _bench().main(args)
    # (tiny-mla has MoE layers: dropless on the dynamic engine by default)
    assert [r["run"] for r in result["rows"]] == ["ours (dynamic engine, dropless MoE)", "ours (static engine)",
                                                  "HF generate"]
    assert all("skipped" not in r for r in result["rows"]), result["rows"]
    with _bench().switches(no_mla_gpu=True, no_mla_graphs=True, no_mla_rope=True, no_router_fusion=True):
        assert not dynamic.MLA_ON_GPU and not dynamic.MLA_GRAPHS and not decode_rope.MLA_ROPE
        assert not dynamic.MOE_ROUTER_FUSION
    assert dynamic.MLA_ON_GPU and dynamic.MLA_GRAPHS and decode_rope.MLA_ROPE and dynamic.MOE_ROUTER_FUSION
    with _bench().switches(no_mla_rope=True):
        assert not decode_rope.MLA_ROPE and dynamic.MOE_ROUTER_FUSION and dynamic.MLA_GRAPHS
    a = _bench().parse_args(args + ["--no-mla-gpu", "--no-mla-graphs", "--no-mla-rope", "--no-moe-router-fusion",
                                    "--mla-gpu", "--mla-graphs", "--mla-rope", "--moe-router-fusion"])
    assert a.no_mla_gpu and a.no_mla_graphs and a.no_mla_rope and a.no_moe_router_fusion


def test_engines_choose_our_rows(tmp_path, cpu_megatron):
    """`--engines dynamic` leaves out the static engine's row (minutes at 256 requests on the GPU)."""
    result = _bench().main(["--shapes", "tiny", "--device", "cpu", "--impl", "local", "--dtype", "fp32",
                            "--requests", "2", "--new", "3", "--min-prompt", "4", "--max-prompt", "6", "--repeat", "1",
                            "--engines", "dynamic", "--hf", "--prompts", str(tmp_path / "p.jsonl")])
    assert [(r["requests"], r["run"]) for r in result["rows"]] == [(2, "ours (dynamic engine)")]
    assert "skipped" not in result["rows"][0]


def test_hf_static_compile_row_says_whether_it_compiled(tmp_path, cpu_megatron, monkeypatch):
    """The HF static-cache row runs HF's own compile path (no hand-compiled forward, which failed on the GPU) and
    says whether the decode steps ran compiled: on a CPU (and with dynamo off, as here) HF does not compile."""
    bench = _bench()
    result = bench.main(["--shapes", "tiny", "--device", "cpu", "--impl", "local", "--dtype", "fp32",
                         "--requests", "2", "--new", "3", "--min-prompt", "4", "--max-prompt", "6", "--repeat", "1",
                         "--engines", "dynamic", "--hf", "hf-static-compile", "--prompts", str(tmp_path / "p.jsonl")])
    row = result["rows"][1]
    assert row["run"] == "HF static cache + torch.compile" and "skipped" not in row and row["compiled"] is False

    import torch._dynamo.config

    class Compiled:  # what HF's get_compiled_call leaves on the model
        _compiled_call = None

    monkeypatch.setattr(torch._dynamo.config, "disable", False)
    assert bench.hf_compiled(Compiled()) is True and bench.hf_compiled(object()) is False
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    assert bench.hf_compiled(Compiled()) is False


def test_engine_probe_runs_moe_layers_as_asked(cpu_megatron):
    """engine_probe.py --moe-dispatch: a mixture-of-experts shape's rows run megatron-core's dispatchers (`padded`)
    or the dropless MoE layers (`auto`, the library's default without graphs; `dropless`), and say which; the
    switches are put back afterwards."""
    from megatron_patch.inference import dynamic

    defaults = dynamic.MOE_DROPLESS, dynamic.DROPLESS_COST
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import engine_probe
    finally:
        sys.path.pop(0)
    args = ["--shape", "tiny-moe", "--device", "cpu", "--impl", "local", "--dtype", "fp32", "--graphs", "off",
            "--sampling-sync", "off", "--requests", "2", "--new", "6", "--min-prompt", "4", "--max-prompt", "12",
            "--repeat", "1"]
    rows = [r for kind in ("padded", "auto", "dropless")
            for r in engine_probe.main([*args, "--moe-dispatch", kind])]
    assert [r["moe_dropless"] for r in rows] == [False, True, True]
    assert all("error" not in r for r in rows)
    assert (dynamic.MOE_DROPLESS, dynamic.DROPLESS_COST) == defaults


def test_engine_probe_at_the_tiny_shape_on_cpu(tmp_path, cpu_megatron, capsys):
    """benchmarks/engine_probe.py's whole logic on a CPU: one row per (scheduling, sampling sync) with every token
    produced (the script asserts it), async scheduling's greedy tokens equal legacy's, the sampling patch's equal
    megatron-core's sampling's, and a profile per
    scheduling whose host-function table counts the engine's steps (a prefill step and a decode step per later
    token; async scheduling may launch one more) and lists --top functions by own time."""
    from megatron_patch import compat
    from megatron_patch.inference import dynamic

    if not compat.async_scheduling_available():
        pytest.skip("megatron-core < 0.19 has no asynchronous scheduling")
    default, sampling_default = dynamic.ASYNC_SCHEDULING, dynamic.SAMPLING_NO_SYNC
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import engine_probe
    finally:
        sys.path.pop(0)
    new = 12
    rows = engine_probe.main(["--shape", "tiny", "--device", "cpu", "--impl", "local", "--dtype", "fp32",
                              "--graphs", "off", "--sched", "legacy", "async", "--sampling-sync", "on", "off",
                              "--requests", "2", "--new",
                              str(new), "--min-prompt", "4", "--max-prompt", "12", "--repeat", "1",
                              "--profile", str(tmp_path), "--profile-steps", "2", "--top", "40"])
    timed = [r for r in rows if "requests" in r]
    assert [(r["sched"], r["sampling_sync"]) for r in timed] == [("legacy", True), ("legacy", False),
                                                                  ("async", True), ("async", False)]
    assert all("error" not in r for r in rows), rows
    same = {"identical": 1.0, "mean_common_prefix": new}
    assert timed[2]["tokens_vs_legacy"] == timed[3]["tokens_vs_legacy"] == same
    assert timed[1]["tokens_vs_sampling_sync"] == timed[3]["tokens_vs_sampling_sync"] == same
    profiles = [r for r in rows if "config" in r]
    assert [p["config"] for p in profiles] == ["n1_graphs_off_legacy", "n1_graphs_off_async"]
    for p in profiles:
        assert new <= p["engine_steps_per_call"] <= new + 2
        table = p["host_functions"]  # (which functions lead is the machine's: only the table's form is asserted)
        own = [f["own_ms"] for f in table]
        assert len(table) == 40 and own == sorted(own, reverse=True) and all(f["calls"] > 0 for f in table)
        assert (tmp_path / f"summary_{p['config']}.json").exists()
    assert dynamic.ASYNC_SCHEDULING is default and dynamic.SAMPLING_NO_SYNC is sampling_default  # left as found


def test_engine_probe_kernel_choices_set_the_engine_switches():
    """engine_probe --gemv: on = GEMV and split-KV attention, attn / gemv = that one alone, off = neither; the
    sampling and RoPE switches as asked; the library's defaults restored afterwards by the caller."""
    from megatron_patch.inference import dynamic

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import engine_probe
    finally:
        sys.path.pop(0)
    saved = dynamic.DECODE_GEMV, dynamic.DECODE_ATTENTION, dynamic.SAMPLING_NO_SYNC, dynamic.DECODE_ROPE
    try:
        seen = {}
        for choice in ("on", "attn", "gemv", "off"):
            engine_probe.set_kernels(choice, "off", "on")
            seen[choice] = (dynamic.DECODE_GEMV, dynamic.DECODE_ATTENTION)
            assert dynamic.SAMPLING_NO_SYNC is True and dynamic.DECODE_ROPE is True
        assert seen == {"on": (True, True), "attn": (False, True), "gemv": (True, False), "off": (False, False)}
        engine_probe.set_kernels("off", "on", "off")
        assert dynamic.SAMPLING_NO_SYNC is False and dynamic.DECODE_ROPE is False
    finally:
        dynamic.DECODE_GEMV, dynamic.DECODE_ATTENTION, dynamic.SAMPLING_NO_SYNC, dynamic.DECODE_ROPE = saved


def test_bound_of_a_mixture_of_experts_counts_the_experts_one_token_reads():
    """A decode step of one request reads, of each MoE layer's routed experts, the `num_experts_per_tok` its token
    is routed to: the bound counts that share of the routed experts' bytes (shared experts and everything else
    whole; the input embedding table as one row, as for a dense model)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    bench = _bench()
    for shape, routed in (("tiny-moe", "experts"), ("tiny-mla", "experts")):
        cfg = bench.hf_config(shape, 64)
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
        experts = sum(p.numel() * 4 for n, p in hf.named_parameters()
                      if f".{routed}." in n and "shared_experts" not in n)
        emb = hf.get_input_embeddings().weight.numel() * 4
        total = sum(p.numel() * 4 for p in hf.parameters())
        k, e = cfg["num_experts_per_tok"], cfg.get("num_local_experts", cfg.get("n_routed_experts"))
        assert experts > 0 and k < e
        assert bench.bytes_read_per_decode_step(hf) == total - emb - experts + experts * k // e


def test_mixture_of_experts_shape_runs_its_rows(tmp_path, cpu_megatron):
    """A Mixtral shape runs the dynamic engine's row and HF's (its experts converted in memory)."""
    result = _bench().main(["--shapes", "tiny-moe", "--device", "cpu", "--impl", "local", "--dtype", "fp32",
                            "--requests", "2", "--new", "3", "--min-prompt", "4", "--max-prompt", "6", "--repeat", "1",
                            "--engines", "dynamic", "--hf", "hf", "--prompts", str(tmp_path / "p.jsonl")])
    assert [r["run"] for r in result["rows"]] == ["ours (dynamic engine, dropless MoE)", "HF generate"]
    assert all("skipped" not in r for r in result["rows"]), result["rows"]


def test_mixture_of_experts_rows_name_their_path(tmp_path, cpu_megatron):
    """`--moe-dispatch`: an MoE shape's dynamic row names the path the engine's plan takes (`auto` and `dropless`:
    the dropless layers, which the plan takes without graphs at any count; `padded`: megatron-core's dispatchers,
    no suffix without graphs); a dense shape's row keeps its name; the switches are put back."""
    from megatron_patch.inference import dynamic

    defaults = dynamic.MOE_DROPLESS, dynamic.DROPLESS_COST
    args = ["--device", "cpu", "--impl", "local", "--dtype", "fp32", "--requests", "2", "--new", "3",
            "--min-prompt", "4", "--max-prompt", "6", "--repeat", "1", "--engines", "dynamic", "--hf",
            "--prompts", str(tmp_path / "p.jsonl")]
    names = {kind: [r["run"] for r in _bench().main(["--shapes", "tiny-moe", "tiny", *args, "--moe-dispatch",
                                                      kind])["rows"]] for kind in ("auto", "padded")}
    assert names == {"auto": ["ours (dynamic engine, dropless MoE)", "ours (dynamic engine)"],
                     "padded": ["ours (dynamic engine)", "ours (dynamic engine)"]}
    assert (dynamic.MOE_DROPLESS, dynamic.DROPLESS_COST) == defaults
