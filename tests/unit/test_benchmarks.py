"""The benchmark scripts' CPU-checkable parts: the training benchmark's commands (every side takes the
same samples per optimizer step; each run's profile and flags reach the pretrain command), its table's
arithmetic (Megatron's FLOP count for every side), the torchtitan row (the same model and batches; a row
saying why when torchtitan is missing or incompatible; torchtitan itself is not installed here) and the trace
summary's arithmetic."""

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def _dry_run(*args: str) -> list[list[str]]:
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_bench.py"), "--dry-run", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return [shlex.split(line) for line in p.stdout.strip().splitlines()]


def _opt(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_hybrid_and_lora_runs():
    """Issue 29's rows: HybridModel and LoRA runs are the default profile plus one setting each."""
    hybrid, lora, base = _dry_run("--torchtitan", "none", "--hf", "none", "--shapes", "8b", "--runs", "bf16 +hybrid",
                                  "fp8 +lora", "bf16")
    assert _opt(hybrid, "--model-class") == "hybrid" and _opt(hybrid, "--throughput-profile") == "default"
    assert (_opt(lora, "--lora-rank"), _opt(lora, "--lora-alpha"), _opt(lora, "--precision")) == ("16", "32", "fp8")
    assert "--model-class" not in base and "--lora-rank" not in base


def test_training_benchmark_commands():
    (none, default, mbs2, graphs) = _dry_run("--torchtitan", "none", "--shapes", "8b", "--runs", "bf16 none", "bf16",
                                             "bf16 mbs2", "fp8 +graph-full")
    for cmd in (none, default, mbs2, graphs):
        # 8 micro-batches of 8192 tokens per optimizer step, whatever the micro-batch size
        assert int(_opt(cmd, "--global-batch-size")) == 8 and _opt(cmd, "--seq-length") == "8192"
    assert (_opt(none, "--throughput-profile"), _opt(default, "--throughput-profile")) == ("none", "default")
    assert (_opt(default, "--micro-batch-size"), _opt(mbs2, "--micro-batch-size")) == ("1", "2")
    assert _opt(graphs, "--precision") == "fp8" and _opt(graphs, "--cuda-graph-impl") == "full_iteration"
    assert _opt(graphs, "--throughput-profile") == "benchmark"  # megatron wants the NaN check off with it
    dp2, tp2 = _dry_run("--torchtitan", "none", "--shapes", "8b-full", "--gpus", "2", "--runs", "fp8 dp2", "fp8 tp2")
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
    assert out["categories"]["gemm"]["top"] == [["sm90_xmma_gemm_bf16", 0.15, 1]]
    assert "ops" not in out["categories"]["gemm"]  # kernels without a launching operator's id


def test_trace_summary_names_the_operators_that_launched_the_kernels(tmp_path):
    """Kernels carry the "External id" of the host operator that launched them: each group lists its costliest
    operators with the input shapes the profiler recorded (what an elementwise add is adding, e.g.)."""
    from trace_summary import summarise_folder

    add = "void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, LoadWithCast<2>>"
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::add_", "ts": 0, "dur": 10,
         "args": {"External id": 7, "Input Dims": [[128256, 4096], [128256, 4096], []]}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add_", "ts": 20, "dur": 10,
         "args": {"External id": 8, "Input Dims": [[4096], [4096], []]}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 40, "dur": 10, "args": {"External id": 9}},
        {"ph": "X", "cat": "kernel", "name": add, "ts": 0, "dur": 300, "args": {"External id": 7}},
        {"ph": "X", "cat": "kernel", "name": add, "ts": 300, "dur": 200, "args": {"External id": 7}},
        {"ph": "X", "cat": "kernel", "name": add, "ts": 500, "dur": 5, "args": {"External id": 8}},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst", "ts": 505, "dur": 95, "args": {"External id": 9}},
    ]
    (tmp_path / "rank0.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    cats = summarise_folder(str(tmp_path))["categories"]
    assert cats["elementwise"]["ops"] == [["aten::add_ [[128256, 4096], [128256, 4096]]", 0.5, 2],
                                          ["aten::add_ [[4096], [4096]]", 0.005, 1]]
    assert cats["gemm"]["ops"] == [["aten::mm", 0.095, 1]]


def test_trace_summary_counts_the_kernels_launched_in_the_traced_steps(tmp_path):
    """engine_probe's per-step figures divide by the steps traced: the kernels counted are those whose launch (the
    runtime call with the kernel's correlation id) lies inside a `ProfilerStep#` range, not every kernel the
    window holds (under asynchronous scheduling the trace also caught the next step's forward: 6.94 steps' kernels
    for 6 steps traced, 2026-12-06). A trace without step markers keeps every kernel."""
    from trace_summary import _events

    def launch(ts, corr, name="cudaLaunchKernel"):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 2, "args": {"correlation": corr}}

    def kernel(ts, corr):
        return {"ph": "X", "cat": "kernel", "name": "gemv_kernel", "ts": ts, "dur": 5, "args": {"correlation": corr}}

    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 100, "dur": 100},
              {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "ts": 200, "dur": 100},
              {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#4", "ts": 0, "dur": 900},
              launch(50, 1), launch(120, 2), launch(250, 3, "cudaGraphLaunch"), launch(310, 4),
              kernel(60, 1), kernel(130, 2), kernel(300, 3), kernel(310, 3), kernel(400, 4)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert [k["ts"] for k in _events(str(path), steps=True)[0]] == [130, 300, 310]  # a graph's kernels share one
    assert len(_events(str(path))[0]) == 5
    assert _events(str(path))[2] == [(100, 200), (200, 300)]  # the host's steps (not the GPU's annotation)
    unmarked = tmp_path / "unmarked.json"
    unmarked.write_text(json.dumps({"traceEvents": events[3:]}))
    assert len(_events(str(unmarked), steps=True)[0]) == 5


def test_trace_summary_tells_torch_elementwise_kernels_from_casts():
    """PyTorch's elementwise kernels are named `...gpu_kernel_impl_nocast<...>`: not FP8 casts (the 2026-12-02
    8B trace put unfused SwiGLU under "fp8 cast" that way, in bf16 too)."""
    from trace_summary import category

    nocast = "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::silu_kernel>"
    assert category(nocast) == "elementwise"
    assert category("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<bf16>>") == \
        "elementwise"
    assert category("void at::native::(anonymous namespace)::CatArrayBatchedCopy_vectorized<OpaqueType<2u>>") == \
        "elementwise"
    assert category("void transformer_engine::cast_transpose_kernel<true, float, __nv_fp8_e4m3>") == "fp8 cast"
    # a mixed-dtype add (fp32 main_grad += bf16 gradient) and a norm writing fp8 (2026-12-05's profiles)
    assert category("void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, std::array<char*"
                    ", 3ul>, 4, TrivialOffsetCalculator<2>, at::native::memory::LoadWithCast<2>, "
                    "at::native::memory::StoreWithCast<1>>") == "elementwise"
    assert category("void transformer_engine::normalization::rmsnorm_fwd_tuned_kernel<transformer_engine::"
                    "normalization::Kernel_traits<__nv_bfloat16, __nv_bfloat16, __nv_fp8_e4m3, float>>") == "norm"
    assert category("void multi_tensor_apply_kernel<TensorListMetadata<4>, transformer_engine::multi_tensor_adam>") \
        == "optimizer"


def test_train_bench_runs_with_torchdynamo_on(monkeypatch):
    """megatron-core fuses SwiGLU, bias-dropout-add, ... through `torch.compile` (its jit_fuser): with
    TORCHDYNAMO_DISABLE=1 they run as unfused torch ops (~12% of an 8B bf16 step, 2026-12-02), and the HF /
    torchtitan compile rows do not compile. train_bench measures what a user runs: it restarts itself
    without the variable."""
    import train_bench

    calls = []
    monkeypatch.setattr(train_bench.os, "execv", lambda exe, argv: calls.append((exe, argv)))
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    train_bench.torchdynamo_on(["--shapes", "8b"])
    assert calls == [(train_bench.sys.executable, [train_bench.sys.executable, train_bench.__file__, "--shapes", "8b"])]
    assert "TORCHDYNAMO_DISABLE" not in train_bench.os.environ
    calls.clear()
    train_bench.torchdynamo_on(["--shapes", "8b"])  # not set: nothing to do
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")  # the GPU suite's value: torch reads only "1" as off
    train_bench.torchdynamo_on(["--shapes", "8b"])
    assert calls == [] and train_bench.run_env()["TORCHDYNAMO_DISABLE"] == "0"


# parameters of torchtitan 0.2.2's Llama-3 `Transformer` built from `titan_peer.model_args` (meta device, torch
# 2.11), counted once in a venv with torchtitan: the HF model of each shape has the same count
TITAN_PARAMS = {"1b": 1_498_482_688, "8b": 2_795_573_248, "8b-full": 8_030_261_248}


def _flags(flags: list[str]) -> dict[str, str | bool]:
    out, i = {}, 0
    while i < len(flags):
        valued = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        out[flags[i]] = flags[i + 1] if valued else True
        i += 2 if valued else 1
    return out


def test_torchtitan_rows_take_the_same_model_and_batches():
    """torchtitan's model is the shape's (its FFN rule gives the HF widths; the parameter count of its model
    equals HF's), and every torchtitan run takes the shape's micro-batch and sequence, 8 micro-batches per
    optimizer step, bf16 autocast and fused AdamW, with compile and activation checkpointing as named."""
    import titan_peer
    import torch
    import train_bench as tb
    from transformers import AutoConfig, AutoModelForCausalLM

    # torchtitan's FFN rule on its own Llama-3 flavors: 8B (1.3, 1024) and 3.2-1B (1.5, 256); debugmodel
    assert (titan_peer.ffn_hidden(4096, 1024, 1.3), titan_peer.ffn_hidden(2048, 256, 1.5)) == (14336, 8192)
    assert titan_peer.ffn_hidden(256, 256, None) == 768
    for shape, s in tb.SHAPES.items():
        if s.get("tied"):  # Llama-3.2-1B as it is: HF's model with one weight for the embedding and the output
            with torch.device("meta"):
                hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tb.config(shape)))
            untied = shape.removesuffix("-tied")
            assert sum(p.numel() for p in hf.parameters()) == TITAN_PARAMS[untied] - tb.VOCAB * s["hidden_size"]
            assert {k: v for k, v in s.items() if k != "tied"} == tb.SHAPES[untied]
            continue
        a = titan_peer.model_args(s, tb.VOCAB)
        ffn = titan_peer.ffn_hidden(a["dim"], a["multiple_of"], a["ffn_dim_multiplier"])
        kv = a["n_kv_heads"] * a["dim"] // a["n_heads"]
        count = 2 * tb.VOCAB * a["dim"] + a["dim"] + a["n_layers"] * (2 * a["dim"] ** 2 + 2 * a["dim"] * kv
                                                                      + 3 * a["dim"] * ffn + 2 * a["dim"])
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tb.config(shape)))
        assert count == sum(p.numel() for p in hf.parameters()) == TITAN_PARAMS[shape], shape
        assert (a["max_seq_len"], a["rope_theta"], a["norm_eps"]) == (s["seq"], 500000.0, 1e-5)
        for run, (compiled, ac) in titan_peer.TITAN_RUNS.items():
            f = _flags(titan_peer.titan_flags(s, run, 12, 8, "/tmp/x"))
            assert int(f["--training.global_batch_size"]) == 8 * int(f["--training.local_batch_size"]) == 8 * s["mbs"]
            assert int(f["--training.seq_len"]) == s["seq"] and f["--training.steps"] == "12"
            assert (f["--optimizer.implementation"], f["--training.mixed_precision_param"]) == ("fused", "bfloat16")
            assert f["--activation_checkpoint.mode"] == ac and f["--lr_scheduler.warmup_steps"] == "2"
            assert f.get("--compile.enable", False) == compiled and f.get("--compile.no-enable", False) != compiled
            # FP8 (torchao's Float8Linear, tensorwise) on the FP8 row only, the output layer left in bf16 as ours
            fp8 = (f.get("--model.converters"), f.get("--quantize.linear.float8.recipe_name"),
                   f.get("--quantize.linear.float8.filter_fqns"))
            assert fp8 == (("quantize.linear.float8", "tensorwise", "output") if run == "torchtitan-fp8"
                           else (None, None, None)), run
    assert titan_peer.TITAN_RUNS["torchtitan"] == (True, "none")  # the main row: compiled, no recomputation


def test_torchtitan_dry_run_prints_its_worker_command():
    import train_bench as tb

    ours, titan = _dry_run("--shapes", "8b", "--runs", "bf16", "--torchtitan", "torchtitan-sac")
    assert "megatron_patch.pretrain" in ours
    assert _opt(titan, "--nproc_per_node") == "1" and titan[titan.index("--shape") - 1].endswith("titan_peer.py")
    assert [_opt(titan, f) for f in ("--row", "--iters", "--micro-batches")] == ["torchtitan-sac", "12", "8"]
    assert json.loads(_opt(titan, "--shape")) == {**tb.SHAPES["8b"], "vocab": tb.VOCAB}


def test_table_row_counts_megatron_flops_for_every_side():
    """Megatron's count is the textbook one (every matmul, causal attention halved, the output layer) x 3 for
    forward + backward; a row's TFLOP/s is that count over the measured step, whichever side measured it."""
    import train_bench as tb

    for shape, s in tb.SHAPES.items():
        h, L, q, F = s["hidden_size"], s["num_hidden_layers"], s["seq"], s["intermediate_size"]
        kv = s["num_key_value_heads"] * h // s["num_attention_heads"]
        matmuls = 2 * q * (L * (2 * h * h + 2 * h * kv + 3 * h * F) + h * tb.VOCAB)
        assert tb.flops_per_sample(shape) == 3 * (matmuls + L * 2 * q * q * h), shape
    flops = tb.flops_per_sample("8b")
    row = tb.table_row("8b", "torchtitan", {"s_per_iter": 2.0, "samples": 8, "peak_gb": 61.04}, flops, 1, 30000.0)
    assert row == {"shape": "8b", "run": "torchtitan", "gpus": 1, "tokens_per_s": 32768, "peak_gb": 61.0,
                   "tflops_per_gpu": round(flops * 8 / 2.0 / 1e12, 1), "vs_hf": round(32768 / 30000, 3)}
    two = tb.table_row("8b-full", "ours fp8 dp2", {"s_per_iter": 2.0, "samples": 16, "peak_gb": None},
                       tb.flops_per_sample("8b-full"), 2, 30000.0)
    assert two["tokens_per_s"] == 65536 and two["vs_hf"] == round(32768 / 30000, 3) and two["peak_gb"] is None
    assert "resident_gb" not in two  # measured where the side reports it
    held = tb.table_row("8b", "hf", {"s_per_iter": 2.0, "samples": 8, "peak_gb": 45.1, "resident_gb": 20.84}, flops, 1,
                        None)
    assert (held["peak_gb"], held["resident_gb"]) == (45.1, 20.8)


def _fake_torchtitan(root, init: str, modules: dict[str, str] | None = None) -> None:
    for name, text in {"__init__": init, **(modules or {})}.items():
        path = root / "torchtitan" / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def no_torchtitan_modules():
    yield
    for name in [m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")]:
        del sys.modules[name]


def test_torchtitan_row_fails_softly(tmp_path, monkeypatch, no_torchtitan_modules):
    """Not installed: the row says so (no process started). Installed but not importable against this torch
    (torchtitan 0.3.0 on torch 2.11): its worker process reports the import error as the row. Another release
    line than the one driven here: the row names the version."""
    import titan_peer
    import train_bench as tb

    s = tb.SHAPES["8b"]
    assert importlib.util.find_spec("torchtitan") is None  # this venv, as a GPU machine before staging
    assert titan_peer.run(s, tb.VOCAB, "torchtitan", 2, 8) == {
        "error": "torchtitan not installed / incompatible: no module named torchtitan"}
    broken = "raise ImportError(\"cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'\")\n"
    _fake_torchtitan(tmp_path / "broken", broken)
    monkeypatch.syspath_prepend(str(tmp_path / "broken"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "broken"), os.environ.get("PYTHONPATH", "")]))
    assert titan_peer.run(s, tb.VOCAB, "torchtitan", 2, 8) == {
        "error": "torchtitan not installed / incompatible: ImportError: cannot import name 'DataParallelMeshDims' "
                 "from 'torch.distributed.fsdp'"}
    _fake_torchtitan(tmp_path / "newer", "__version__ = '0.3.0'\n", {
        "models/__init__": "", "models/llama3/__init__": "TransformerModelArgs = get_train_spec = None\n",
        "train": "Trainer = None\n"})
    monkeypatch.syspath_prepend(str(tmp_path / "newer"))
    assert titan_peer.unavailable() == ("torchtitan not installed / incompatible: torchtitan 0.3.0; this benchmark "
                                        "drives the 0.2.x Trainer (0.2.2 on torch 2.11)")


def test_torchtitan_peak_survives_its_logs_resets():
    """torchtitan 0.2.2's `MetricsProcessor.log` ends with `device_memory_monitor.reset_peak_stats()` and
    `train_step` logs every step (`--metrics.log_freq 1`): a peak read after the steps is only what was allocated
    since the last log, the trainer's resident memory (the row's 41.7 GiB = 16 bytes a parameter of 2.80 B).
    `keep_peaks` reads the peak before each reset."""
    import titan_peer

    memory = {"now": 0, "peak": 0}

    def allocate(n):
        memory["now"] += n
        memory["peak"] = max(memory["peak"], memory["now"])

    class Monitor:  # torchtitan's DeviceMemoryMonitor.reset_peak_stats: torch.cuda.reset_peak_memory_stats
        def reset_peak_stats(self):
            memory["peak"] = memory["now"]

    def steps(monitor):
        allocate(40)  # weights, gradients, optimizer state: resident
        for _ in range(3):  # train_step: activations come and go, then its log resets the peak
            allocate(15)
            allocate(-15)
            monitor.reset_peak_stats()
        return memory["peak"]

    assert steps(Monitor()) == 40  # the defect: the peak of the last log's window, resident memory only
    memory.update(now=0, peak=0)
    monitor = Monitor()
    peaks = titan_peer.keep_peaks(monitor, lambda: memory["peak"])
    last = steps(monitor)
    assert (peaks, max(peaks + [last])) == ([55, 55, 55], 55)


def test_stage_wheels_without_names_is_one_error_line(tmp_path):
    """benchmarks/stage_wheels.sh needs what to stage (fa4, titan, lmeval or NAME==VER) and says so on one line,
    touching nothing, also in a copy of the tree without git (CI's checkout has no .git/info: the script wrote there,
    failed)."""
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(os.path.join(ROOT, "benchmarks", "stage_wheels.sh"), tmp_path / "benchmarks")
    p = subprocess.run(["bash", "benchmarks/stage_wheels.sh"], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 1 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    assert os.listdir(tmp_path) == ["benchmarks"]


def test_run_pretrain_reads_the_log_with_the_shared_parser():
    """train_bench.run_pretrain: the median step time of the second half of the iterations, the peak memory
    report, the memory held after the second iteration (resident: weights, gradients, optimizer state), the global
    batch and every loss, from Megatron's printed log (megatron_patch.training.log)."""
    import train_bench as tb

    lines = [f" [t] iteration {i}/ 6 | elapsed time per iteration (ms): {ms} | global batch size: 8 | "
             f"lm loss: {10 - i}.0 |" for i, ms in enumerate([900, 800, 520, 500, 510, 530], 1)]
    # Megatron reports memory after iterations 1 and 2; the second holds the optimizer state: the resident figure
    lines.append("[Rank 0] (after 1 iterations) memory (MB) | allocated: 1.0 | max allocated: 61440.00 | reserved: 2.0")
    lines.append("[Rank 0] (after 2 iterations) memory (MB) | allocated: 30720.00 | max allocated: 61440.00 | "
                 "reserved: 2.0")
    cmd = [sys.executable, "-c", f"print({chr(10).join(lines)!r})"]
    row = tb.run_pretrain(cmd, dict(os.environ))
    assert row == {"s_per_iter": 0.51, "peak_gb": 60.0, "resident_gb": 30.0, "samples": 8,
                   "losses": [9.0, 8.0, 7.0, 6.0, 5.0, 4.0]}
    assert "error" in tb.run_pretrain([sys.executable, "-c", "print(' iteration 1/ 2 | lm loss: 1.0 |')"],
                                      dict(os.environ))


def test_trace_run_writes_its_trace_where_the_summary_looks(tmp_path):
    """`train_bench.py --trace RUN` (issue 28: it ended with 'no trace (.json / .json.gz) under .../trace'):
    megatron-core 0.19 writes the PyTorch profiler's trace beside the TensorBoard folder (`../torch_profile`),
    so the TensorBoard folder is a subfolder of the trace folder. A CPU run of 8 iterations: the trace is under
    the folder `summarise_folder` reads (here it finds no GPU kernels, which is the next check, not this one)."""
    import train_bench as tb
    from trace_summary import summarise_folder

    from tests.models import llama_config

    cfg = llama_config("gqa")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    trace = tmp_path / "trace"
    cmd, env = tb.pretrain_command(1, ["--hf-config", str(tmp_path / "config.json")], 32, 1, 1, 8, "fp32", "none",
                                   [], vocab=cfg["vocab_size"], cpu=True, trace_dir=str(trace))
    env = {**env, "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": ROOT}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    with pytest.raises(ValueError, match="no GPU kernel events"):
        summarise_folder(str(trace))


def test_rows_are_printed_as_measured(capsys):
    """train_bench printed the HF rows only in the final table, so a call cut by its time limit lost them (issue
    28): each row is printed when measured, HF's being the reference of the rows after it, and a run's losses
    compared with its precision's `none` run (measured before it)."""
    import train_bench as tb

    rows: list[dict] = []
    table = tb.ShapeRows("8b", 1e12, 1, 3, rows)  # 1 TFLOP per sample
    table.add("hf", {"s_per_iter": 2.0, "samples": 8, "peak_gb": 45.0})
    assert json.loads(capsys.readouterr().out) == rows[0]
    assert rows[0]["tokens_per_s"] == 8 * 8192 / 2 and rows[0]["vs_hf"] == 1.0
    table.add("ours bf16 none", {"s_per_iter": 1.0, "samples": 8, "peak_gb": 60.0, "losses": [11.0, 10.0, 9.0]})
    table.add("ours bf16", {"s_per_iter": 0.8, "samples": 8, "peak_gb": 60.0, "losses": [11.0, 10.001, 9.0]})
    table.add("torchtitan", {"error": "torchtitan not installed"})
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == rows[1:]
    assert rows[1]["vs_hf"] == 2.0 and rows[2]["vs_hf"] == 2.5 and rows[2]["tflops_per_gpu"] == 10.0
    assert rows[2]["max_loss_diff"] == pytest.approx(0.001, abs=1e-9) and rows[2]["loss_reference"] == "bf16 none"
    assert rows[3] == {"shape": "8b", "run": "torchtitan", "error": "torchtitan not installed"}
    assert "max_loss_diff" not in rows[1]  # a reference is not compared with itself
    assert rows[1]["losses"] == [11.0, 10.0, 9.0] and rows[2]["losses"] == [11.0, 10.001, 9.0]  # shown as well
    # HybridModel is compared with GPTModel at its settings; LoRA (other weights trained) with nothing
    table.add("ours bf16 +hybrid", {"s_per_iter": 0.8, "samples": 8, "peak_gb": 60.0, "losses": [11.0, 10.0, 9.002]})
    table.add("ours bf16 +lora", {"s_per_iter": 0.6, "samples": 8, "peak_gb": 20.0, "losses": [11.0, 10.5, 10.0]})
    assert rows[4]["loss_reference"] == "bf16" and rows[4]["max_loss_diff"] == pytest.approx(0.002, abs=1e-9)
    assert "max_loss_diff" not in rows[5]


def test_loss_references_are_measured_first():
    """`--losses` runs every reference before the runs compared with it."""
    import train_bench as tb

    assert [tb.loss_reference(r) for r in ("bf16", "fp8 tensorwise", "bf16 +hybrid", "bf16 +lora")] == \
        ["bf16 none", "fp8 none", "bf16", None]
    assert all(r is None or r in tb.RUNS for r in map(tb.loss_reference, tb.RUNS))
    assert tb.with_references(["bf16 +hybrid", "bf16 +lora", "fp8"]) == \
        ["bf16 none", "bf16", "bf16 +hybrid", "bf16 +lora", "fp8 none", "fp8"]


def test_attention_rows_name_their_backend_and_the_rest_leave_it_to_the_profile():
    """The `+flash-attn` / `+fused-attn` ablation rows pass their backend once; the other rows pass none, so the
    throughput profile chooses it as in a user's run (`training.profiles.flash_attention_suits`)."""
    runs = ["bf16 +flash-attn", "fp8 +flash-attn", "bf16 +fused-attn", "fp8 +fused-attn", "bf16", "fp8 none"]
    for run, cmd in zip(runs, _dry_run("--torchtitan", "none", "--hf", "none", "--shapes", "8b", "--runs", *runs),
                        strict=True):
        backends = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--attention-backend"]
        expected = ["flash"] if "flash-attn" in run else ["fused"] if "fused-attn" in run else []
        assert backends == expected, (run, backends)


def test_attention_probe_reference_is_causal_grouped_attention_and_its_gradients():
    """attention_probe's float64 reference (one KV head's query group at a time) equals torch's SDPA with the KV
    heads repeated for their groups and a causal mask, output and the three input gradients; its distance is 0 to
    itself and reports the bf16 rounding; without a GPU the script says so in one line."""
    import attention_probe as ap
    import torch
    import torch.nn.functional as F

    q, k, v, grad = ap.inputs(24, 2, 8, 2, 16, "cpu")
    out, dq, dk, dv = ap.reference(q, k, v, grad, 16 ** -0.5)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in leaves)  # [b, h, s, d]
    kb, vb = kb.repeat_interleave(4, 1), vb.repeat_interleave(4, 1)
    theirs = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True).permute(2, 0, 1, 3)
    theirs.backward(grad.double())
    for mine, ref in ((out, theirs.detach()), (dq, leaves[0].grad), (dk, leaves[1].grad), (dv, leaves[2].grad)):
        assert mine.shape == ref.shape and torch.allclose(mine, ref, rtol=1e-10, atol=1e-12)
    d = ap.distance(out, out)
    assert d["max_abs_diff"] == 0 and d["rel_l2"] == 0 and 0 < d["bf16_rounding"] < 2.0 ** -8
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "attention_probe.py"), "--seq", "8"],
                       capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 1 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr


def test_hf_rows_run_in_their_own_process(monkeypatch):
    """train_bench.hf starts one process per HF row (Liger patches transformers' Llama classes process-wide; each
    row's memory figures are its own) and reads its HF_RESULT line; a worker that printed none is an error row
    with its output's tail."""
    import train_bench as tb

    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        out = 'loading\nHF_RESULT {"s_per_iter": 1.5, "peak_gb": 40.0, "resident_gb": 20.0, "samples": 8}\n'
        return subprocess.CompletedProcess(cmd, 0, out if "hf-liger" in cmd else "", "Traceback\nOOM")

    monkeypatch.setattr(tb.subprocess, "run", fake_run)
    assert tb.hf("8b", "hf-liger", 12, 8) == {"s_per_iter": 1.5, "peak_gb": 40.0, "resident_gb": 20.0, "samples": 8}
    assert tb.hf("8b", "hf-compile", 12, 8) == {"error": "Traceback\nOOM"}
    cmd = seen[0]
    assert cmd[cmd.index("--hf-worker") + 1] == "hf-liger" and cmd[cmd.index("--shapes") + 1] == "8b"
    assert (cmd[cmd.index("--iters") + 1], cmd[cmd.index("--micro-batches") + 1]) == ("12", "8")


def test_table_shows_the_loss_difference_to_two_figures():
    import train_bench as tb

    row = {"max_loss_diff": 0.00020700000000006824, "loss_reference": "bf16 none"}
    assert tb._loss_cell(row) == "0.00021 (vs bf16 none)"
    assert tb._loss_cell({"max_loss_diff": None, "loss_reference": "fp8"}) == "n/a (vs fp8)"
    assert tb._loss_cell({}) == ""


def test_every_run_parses_as_the_pretrain_command_line(monkeypatch):
    """Every row of train_bench's RUNS reaches `megatron_patch.pretrain` as flags its parser (Megatron-LM's and ours)
    accepts: on the H200 (2026-12-05) `fp8 +qkv-rope` ended at argparse (`--fused-single-qkv-rope` is a
    TransformerConfig field that megatron-core's parser does not offer), a row lost to a name."""
    import train_bench
    from megatron.training.arguments import parse_args as megatron_parse_args

    from megatron_patch.training.arguments import add_patch_args

    one = [r for r in train_bench.RUNS if not r.endswith(("dp2", "tp2", "pp2"))]
    two = [r for r in train_bench.RUNS if r.endswith(("dp2", "tp2", "pp2"))]
    peers = ("--torchtitan", "none", "--hf", "none")
    commands = (_dry_run(*peers, "--shapes", "8b", "--runs", *one)
                + _dry_run(*peers, "--shapes", "8b-full", "--gpus", "2", "--runs", *two))
    assert len(commands) == len(one) + len(two)
    for run, cmd in zip(one + two, commands):
        argv = cmd[cmd.index("megatron_patch.pretrain") + 1:]
        monkeypatch.setattr(sys, "argv", ["pretrain", *argv])
        try:
            megatron_parse_args(add_patch_args)
        except SystemExit as e:
            pytest.fail(f"{run}: the pretrain parser refused {argv} (exit {e.code})")


def test_one_table_over_several_calls_with_a_results_file(monkeypatch, tmp_path, capsys):
    """`--results FILE` (benchmarks/results_file.py): the GPU machine gives 10 minutes a call, the ablation takes
    several; run again with the same file, train_bench takes the rows kept by the earlier call and measures only
    the rest (a failed row again), and the table holds them all; another setting, machine or code is refused in
    one line."""
    import titan_peer
    import train_bench as tb

    measured: list[str] = []
    fp8_calls = []

    def fake_ours(shape, run, iters, micro_batches, gpus, tmp, trace_dir=None):
        measured.append(run)
        fp8_calls.extend([run] if run == "fp8" else [])
        if fp8_calls == ["fp8"] and run == "fp8":
            return {"error": "cut by the call's time limit"}
        return {"s_per_iter": 1.0, "samples": 8, "peak_gb": 60.0, "losses": [11.0, 10.0, 9.0]}

    def fake_hf(shape, name, iters, micro_batches):
        measured.append(name)
        return {"s_per_iter": 2.0, "samples": 8, "peak_gb": 45.0}

    monkeypatch.setattr(tb, "torchdynamo_on", lambda argv: None)  # (it restarts the process where dynamo is off)
    monkeypatch.setattr(tb, "ours", fake_ours)
    monkeypatch.setattr(tb, "hf", fake_hf)
    monkeypatch.setattr(titan_peer, "run", lambda *a: pytest.fail("torchtitan is not asked for"))
    results = tmp_path / "out" / "tb.jsonl"
    argv = ["train_bench.py", "--shapes", "8b", "--torchtitan", "none", "--losses", "3", "--runs", "bf16", "fp8",
            "--results", str(results)]

    def table(args):
        monkeypatch.setattr(sys, "argv", args)
        tb.main()
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]

    first = table(argv)
    assert measured == ["hf", "bf16 none", "bf16", "fp8 none", "fp8"] and "error" in first[-1]
    measured.clear()
    second = table(argv)
    assert measured == ["fp8"]  # only the failed row again
    assert [r["run"] for r in second] == ["hf", "ours bf16 none", "ours bf16", "ours fp8 none", "ours fp8"]
    assert second[:4] == first[:4] and second[-1]["vs_hf"] == 2.0 and second[-1]["max_loss_diff"] == 0.0
    kept = [json.loads(line) for line in results.read_text().splitlines()]
    assert list(kept[0]) == ["identity"] and [k["key"] for k in kept[1:]] == \
        ["8b|hf", "8b|ours bf16 none", "8b|ours bf16", "8b|ours fp8 none", "8b|ours fp8"]
    # `--report FILE`: the same table from the file alone, measuring nothing (a machine without a GPU)
    measured.clear()
    monkeypatch.setattr(sys, "argv", ["train_bench.py", "--report", str(results)])
    tb.main()
    out = capsys.readouterr().out.strip().splitlines()
    assert measured == [] and json.loads(out[-1])["rows"] == second
    assert "| 8b | ours fp8 | 65,536 |" in "\n".join(out) and out[0].endswith("8 micro-batches per step")
    for bad, why in ((tmp_path / "none.jsonl", "no results file there"),
                     (tmp_path / "out", "no results file there")):
        with pytest.raises(SystemExit, match=why):
            tb.report(str(bad))
    with pytest.raises(SystemExit) as e:
        table([*argv, "--iters", "20"])
    assert str(e.value).startswith(f"error: --results {results} holds results of another settings (")
    assert "'iters': 12" in str(e.value) and "'iters': 20" in str(e.value)


def test_a_results_file_is_tied_to_the_code_and_the_machine(tmp_path, monkeypatch):
    from machine import code_hash
    from results_file import ResultsFile

    identity = {"machine": {"host": "a", "gpu_uuid": "GPU-1"}, "code": code_hash(), "settings": {"iters": 12}}
    path = str(tmp_path / "r.jsonl")
    first = ResultsFile(path, identity)
    assert first.measured("8b|hf", lambda: {"s": 1}) == {"s": 1}
    assert ResultsFile(path, identity).measured("8b|hf", lambda: pytest.fail("kept")) == {"s": 1}
    for part, other in (("machine", {"host": "a", "gpu_uuid": "GPU-2"}), ("code", "0" * 16)):
        with pytest.raises(SystemExit, match=f"holds results of another {part} "):
            ResultsFile(path, {**identity, part: other})
    assert ResultsFile(None, identity).measured("k", lambda: {"s": 2}) == {"s": 2}  # no file: nothing kept
    with open(path, "a") as f:  # a line cut short by the call's end: dropped, its row measured again
        f.write('{"key": "8b|ours bf16", "result": {"s"')
    again = ResultsFile(path, identity)
    assert again.get("8b|hf") == {"s": 1} and again.get("8b|ours bf16") is None
    again.measured("8b|ours bf16", lambda: {"s": 3})
    assert ResultsFile(path, identity).get("8b|ours bf16") == {"s": 3}  # the next line starts a line
    # the hash follows the sources: a changed file is other code
    root = tmp_path / "tree"
    (root / "megatron_patch").mkdir(parents=True)
    (root / "benchmarks").mkdir()
    (root / "megatron_patch" / "a.py").write_text("x = 1\n")
    before = code_hash(str(root))
    (root / "megatron_patch" / "a.py").write_text("x = 2\n")
    assert code_hash(str(root)) != before


def test_the_tied_1b_shape_and_the_fp8_head_rows():
    """`1b-tied` is Llama-3.2-1B as released (one weight for the embedding and the output layer), where
    `--fp8-output-layer` takes megatron-core's own output layer (`training.fp8_head`); torchtitan's Llama-3 has no
    tied form, so its rows are left out (an error row in a measured table). `fp8 +fp8-head-torch` is the same
    implementation on an untied shape, against Transformer Engine's (`fp8 +fp8-head`), both compared with fp8."""
    import train_bench as tb

    assert tb.config("1b-tied")["tie_word_embeddings"] is True and tb.config("1b")["tie_word_embeddings"] is False
    commands = _dry_run("--shapes", "1b-tied", "--runs", "fp8 +fp8-head", "--torchtitan", "torchtitan")
    assert len(commands) == 1 and "--fp8-output-layer" in commands[0]
    assert tb.RUNS["fp8 +fp8-head-torch"][2] == ["--fp8-output-layer", "--fp8-output-layer-impl", "torch"]
    assert tb.loss_reference("fp8 +fp8-head-torch") == tb.loss_reference("fp8 +fp8-head") == "fp8"
    # the default profile has Transformer Engine's FP8 output layer on an untied shape: `-fp8-head` leaves it out
    assert tb.RUNS["fp8 -fp8-head"][2] == ["--no-fp8-output-layer"] and tb.loss_reference("fp8 -fp8-head") == "fp8"


def test_gpu_clocks_are_summarised_over_the_busy_samples():
    """The GPUs' clocks while a side ran (issue 28: on 2026-12-06 our fp8 row at 1B measured 1.04-1.22 s a step
    on one H100 within 20 minutes, HF's and torchtitan's within 0.3%): idle samples, samples of a GPU held but not
    computing (under BUSY_PERCENT utilization) and unreadable lines left out,
    the median and lowest SM clock, median power, hottest reading and each slowdown reason's share of the samples."""
    from machine import summarise_clocks

    text = "\n".join(["210, 70.1, 35, 0x0000000000000001, 0",   # idle: nothing on the GPU yet
                      # the process holds the GPU (no idle bit) but runs no kernel: checkpoint load, compiling
                      "1980, 127.0, 40, 0x0000000000000000, 0",
                      "1980, 650.0, 55, 0x0000000000000000, 100",
                      "1755, 700.2, 61, 0x0000000000000004, 98",  # power cap
                      "1650, 699.8, 66, 0x0000000000000024, 100",  # power cap and software thermal slowdown
                      "[N/A], [N/A], 60, [N/A], 100", "1700, 69"])  # a field not read, a line cut by the stop
    assert summarise_clocks(text) == {"sm_mhz": 1755, "sm_mhz_min": 1650, "power_w": 700, "temp_c_max": 66,
                                      "samples": 3, "slowed": {"power cap": 0.67, "sw thermal": 0.33}}
    assert summarise_clocks("210, 70.1, 35, 0x1\n") is None and summarise_clocks("") is None


def test_gpu_clocks_sample_nvidia_smi_while_a_side_runs(tmp_path, monkeypatch):
    """`GpuClocks` runs nvidia-smi's sampling loop (here a stand-in on PATH) for the `with` block and summarises
    what it printed; each row carries the summary and the table shows it. Without nvidia-smi: no summary."""
    import train_bench as tb
    from machine import GpuClocks

    started = tmp_path / "started"
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\ncase \"$*\" in *--loop-ms=*) ;; *) echo '1980, 650, 55, 0x0'; exit 0;; esac\n"
                    f"while true; do echo '1755, 700, 61, 0x4, 99'; touch {started}; sleep 0.05; done\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with GpuClocks() as clocks:
        while not started.exists():  # the sampler printed at least once
            time.sleep(0.01)
    assert clocks.summary["sm_mhz"] == 1755 and clocks.summary["slowed"] == {"power cap": 1.0}
    rows: list[dict] = []
    tb.ShapeRows("8b", 1e12, 1, 0, rows).add("hf", {"s_per_iter": 2.0, "samples": 8, "peak_gb": 45.0,
                                                    "gpu_clock": clocks.summary})
    assert rows[0]["gpu_clock"] == clocks.summary
    assert tb._clock_cell(rows[0]) == "1,755 MHz, 700 W (power cap 100%)"
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    with GpuClocks() as none:
        pass
    assert none.summary is None and tb._clock_cell({"shape": "8b"}) == ""
