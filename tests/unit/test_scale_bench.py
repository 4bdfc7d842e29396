"""The scale-out benchmark's CPU-checkable parts (benchmarks/scale_bench.py): the layout table is valid for
its shapes (TP divides heads and kv groups, PP x VP the layers, EP the experts, DP = GPUs / (TP x PP x CP)),
the memory estimate, the generated commands carry the layout, overlap and distributed-optimizer flags, and
the TFLOP/s, scaling-efficiency and loss-comparison arithmetic. The CPU loss equality across layouts runs in
tests/distributed/test_scale_bench_losses.py."""

import os
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import scale_bench as sb  # noqa: E402
import train_bench as tb  # noqa: E402

P = sb.Parallel


def _opt(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_layout_table_is_valid_for_the_shapes():
    """Every layout of LAYOUTS runs its shape on its GPU count; the issue's GPU counts and EP sizes are there;
    at H200 memory only the whole Llama-3-8B on one GPU does not fit (Adam state alone is 96 GB)."""
    for shape, by_gpus in sb.LAYOUTS.items():
        s = sb.SHAPES[shape]
        for gpus, layouts in by_gpus.items():
            for p in layouts:
                assert sb.check(shape, p, gpus) == [], (shape, gpus, p)
                heads, kv, layers = s["num_attention_heads"], s["num_key_value_heads"], s["num_hidden_layers"]
                assert heads % p.tp == 0 and kv % p.tp == 0 and layers % (p.pp * p.vp) == 0
                assert s.get("num_local_experts", 1) % p.ep == 0 and (p.ep == 1 or "num_local_experts" in s)
                assert gpus % (p.tp * p.pp * p.cp) == 0 and p.dp(gpus) == gpus // (p.tp * p.pp * p.cp) >= 1
                assert p.vp == 1 or p.pp > 1
                fits = sb.check(shape, p, gpus, gpu_gib=sb.H200_GIB, grad_bytes=sb.GRAD_BYTES) == []
                assert fits == ((shape, gpus) != ("8b-full", 1)), (shape, gpus, p)
    assert set(sb.LAYOUTS["8b-full"]) == {1, 2, 4, 8}
    labels = {p.label for gpus in (2, 4, 8) for p in sb.LAYOUTS["8b-full"][gpus]}
    assert labels == {"dp", "cp2", "tp2", "pp2 vp4"}  # data, context, tensor and interleaved pipeline parallel
    assert {p.ep for ps in sb.LAYOUTS["mixtral-8l"].values() for p in ps} >= {2, 4, 8}
    assert sb.SHAPES["8b-full"] == tb.SHAPES["8b-full"]  # one definition of the shape
    assert (sb.SHAPES["8b-full"]["num_hidden_layers"], sb.SHAPES["8b-full"]["seq"]) == (32, 8192)


@pytest.mark.parametrize("shape, par, gpus, match", [
    ("8b-full", P(tp=3), 3, "does not divide the 32 attention heads"),
    ("8b-full", P(pp=3), 3, "does not divide the 32 layers"),
    ("8b-full", P(pp=2, vp=3), 2, "PP x VPP dividing the 32 layers"),
    ("8b-full", P(vp=2), 2, "VPP=2: a virtual pipeline needs PP > 1"),
    ("8b-full", P(cp=3), 3, "2 x CP equal chunks"),
    ("8b-full", P(tp=2, pp=2), 6, "TP x PP x CP = 4 does not divide 6 GPUs"),
    ("8b-full", P(ep=2), 2, "EP=2: the model has no experts to split"),
    ("mixtral-8l", P(ep=3), 3, "EP=3 does not divide the 8 experts"),
    ("mixtral-8l", P(tp=2, ep=4), 4, "EP=4 does not divide the 2 ranks"),
])
def test_check_refuses_layouts_that_cannot_run(shape, par, gpus, match):
    problems = sb.check(shape, par, gpus)
    assert any(match in p for p in problems), problems


def test_check_refuses_batches_and_memory_that_do_not_work():
    assert "not a multiple of micro-batch 1 x DP 8" in sb.check("8b-full", P(), 8, global_batch=12)[0]
    assert "fewer micro-batches per step than PP=2" in sb.check("8b-full", P(pp=2), 2, global_batch=1)[0]
    assert sb.check("8b-full", P(pp=2), 2, global_batch=2) == []
    assert "does not fit: 120 GiB" in sb.check("8b-full", P(), 1, gpu_gib=140, grad_bytes=2)[0]
    assert sb.check("8b-full", P(), 1, gpu_gib=180, grad_bytes=2) == []  # a larger GPU would hold it


def test_static_memory_arithmetic():
    """Llama-3-8B's 8,030,261,248 parameters; per GPU: bf16 weights + gradients + 12 bytes of fp32 master and
    Adam moments over the data-parallel ranks; TP and PP split the weights, EP the experts."""
    dense, expert, embedding = sb.parameters("8b-full")
    assert expert == 0 and 32 * dense + 2 * embedding + 4096 == 8_030_261_248  # + the final norm
    gib = 8_030_261_248 / 2**30
    assert sb.static_gib("8b-full", P(), 1) == pytest.approx(gib * 18)
    assert sb.static_gib("8b-full", P(), 8, grad_bytes=2) == pytest.approx(gib * (4 + 12 / 8))
    assert sb.static_gib("8b-full", P(cp=2), 8, grad_bytes=2) == pytest.approx(gib * (4 + 12 / 8))  # CP shards too
    assert sb.static_gib("8b-full", P(tp=2), 2) == pytest.approx(gib / 2 * 18)
    # PP: the first stage holds 16 layers and the embedding (the last: 16 layers and the output layer)
    assert sb.static_gib("8b-full", P(pp=2), 2) == pytest.approx((16 * dense + embedding) * 18 / 2**30)
    d, e, emb = sb.parameters("mixtral-8l")
    assert e == 8 * 3 * 4096 * 14336 and emb == 32000 * 4096
    # EP=8 on 8 GPUs: one expert per GPU and layer, not sharded further (expert data parallel = 1)
    expected = (8 * d + 2 * emb) * (4 + 12 / 8) + 8 * e / 8 * (4 + 12)
    assert sb.static_gib("mixtral-8l", P(ep=8), 8, grad_bytes=2) == pytest.approx(expected / 2**30)


def test_commands_carry_the_layout_and_overlap_flags():
    for shape, by_gpus in sb.LAYOUTS.items():
        if shape not in sb.GPU_SHAPES:
            continue
        for gpus, layouts in by_gpus.items():
            for p in layouts:
                batch = 8 * p.dp(gpus)
                cmd, env = sb.command(shape, p, gpus, "fp8", 10, batch, ["--hf-config", "c.json"])
                assert _opt(cmd, "--nproc_per_node") == str(gpus) and _opt(cmd, "--global-batch-size") == str(batch)
                assert _opt(cmd, "--precision") == "fp8" and _opt(cmd, "--transformer-impl") == "transformer_engine"
                for flag in ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                             "--grad-reduce-in-bf16"):
                    assert flag in cmd, (shape, gpus, p, flag)
                assert ("--sequence-parallel" in cmd) == (p.tp > 1)
                for flag, value in (("--tensor-model-parallel-size", p.tp), ("--pipeline-model-parallel-size", p.pp),
                                    ("--num-virtual-stages-per-pipeline-rank", p.vp),
                                    ("--context-parallel-size", p.cp), ("--expert-model-parallel-size", p.ep)):
                    assert (_opt(cmd, flag) if flag in cmd else "1") == str(value), (shape, p, flag)
                moe = "num_local_experts" in sb.SHAPES[shape]
                assert ("--moe-grouped-gemm" in cmd) == moe and ("alltoall" in cmd) == moe
                assert _opt(cmd, "--seq-length") == str(sb.SHAPES[shape]["seq"])
                assert _opt(cmd, "--vocab-size") == str(sb.SHAPES[shape].get("vocab", tb.VOCAB))
                assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    # on the CPU: Megatron's CPU path, no GPU-only flags, the layout kept
    cmd, _ = sb.command("tiny", P(tp=2), 2, "fp32", 6, 8, ["--load-hf", "hf"], cpu=True)
    assert "--cpu" in cmd and "--standalone" in cmd and _opt(cmd, "--tensor-model-parallel-size") == "2"
    assert not {"--use-distributed-optimizer", "--overlap-grad-reduce", "--sequence-parallel",
                "--transformer-impl"} & set(cmd)


def _cli(*args: str) -> list[str]:
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "scale_bench.py"), *args],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip().splitlines()


def test_dry_run_prints_every_command():
    """`run --dry-run` prints one command per valid layout and says why the others cannot run; `losses
    --dry-run` starts every layout from the same HF folder on the same global batch, VP included."""
    lines = _cli("run", "--dry-run", "--shapes", "8b-full", "mixtral-8l", "--gpus", "1", "2", "8",
                 "--precisions", "bf16")
    assert lines[0].startswith("# dp1: does not fit")
    cmds = [shlex.split(line) for line in lines[1:]]
    assert len(cmds) == 4 + 4 + 1 + 2 and all(c[c.index("-m") + 1] == "torch.distributed.run" for c in cmds)
    assert [_opt(c, "--nproc_per_node") for c in cmds] == ["2"] * 4 + ["8"] * 4 + ["2"] + ["8"] * 2
    lines = _cli("losses", "--dry-run", "--shapes", "8b-full", "--gpus", "2", "--precisions", "bf16",
                 "--work", "W", "--layouts", "dp", "pp2 vp4")
    cmds = [shlex.split(line) for line in lines]
    assert len(cmds) == 2 and all(_opt(c, "--load-hf") == os.path.join("W", "hf-8b-full") for c in cmds)
    assert all(_opt(c, "--global-batch-size") == "8" and _opt(c, "--train-iters") == "20" for c in cmds)
    assert _opt(cmds[1], "--pipeline-model-parallel-size") == "2"
    assert _opt(cmds[1], "--num-virtual-stages-per-pipeline-rank") == "4"  # --load-hf fills each model chunk


def test_flop_count_is_megatrons_formula():
    """train_bench.flops_per_sample (Megatron's count) equals the closed form: per layer QKV + output
    projections 4sh^2(1 + g/n), causal attention 2s^2h, SwiGLU MLP 6shf (x top-k experts); the output layer
    2shV; x3 for forward and backward."""
    def closed_form(s):
        h, f, n, g, seq = (s[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads", "seq"))
        mlp = 6 * seq * h * f * s.get("num_experts_per_tok", 1)
        layer = 4 * seq * h * h * (1 + g / n) + 2 * seq * seq * h + mlp
        return 3 * (s["num_hidden_layers"] * layer + 2 * seq * h * s.get("vocab", tb.VOCAB))

    for shape in ("8b-full", "mixtral-8l"):
        assert tb.flops_per_sample(sb.SHAPES[shape]) == pytest.approx(closed_form(sb.SHAPES[shape]), rel=1e-12)
    assert tb.flops_per_sample("8b-full") == tb.flops_per_sample(sb.SHAPES["8b-full"])
    # per token: 6 x the parameters that multiply (all but the input embedding) + causal attention 6 x L x s x h
    per_token = 6 * (8_030_261_248 - 128256 * 4096) + 6 * 32 * 8192 * 4096
    assert tb.flops_per_sample(sb.SHAPES["8b-full"]) / 8192 == pytest.approx(per_token, rel=1e-4)


def test_measure_and_scaling_arithmetic():
    flops = 1e15
    row = sb.measure("8b-full", "fp8", 2, P(), {"s_per_iter": 2.0, "samples": 16, "peak_gb": 80.04}, flops)
    assert row["tokens_per_s_per_gpu"] == 16 * 8192 / 2.0 / 2 and row["tflops_per_gpu"] == 1e15 * 16 / 2 / 1e12 / 2
    assert (row["layout"], row["global_batch"], row["peak_gb"]) == ("dp2", 16, 80.0)
    assert "error" in sb.measure("8b-full", "fp8", 2, P(), {"error": "OOM"}, flops)

    def r(gpus, layout, rate, precision="fp8"):
        return {"shape": "8b-full", "precision": precision, "gpus": gpus, "layout": layout,
                "tokens_per_s_per_gpu": rate}

    rows = [r(2, "dp2", 7000), r(2, "tp2 dp1", 6000), r(4, "dp4", 6860), r(8, "cp2 dp4", 6100), r(8, "dp8", 6440),
            r(4, "dp4", 3500, "bf16"), r(8, "dp8", 3150, "bf16"),
            {"shape": "8b-full", "precision": "fp8", "gpus": 1, "layout": "dp1", "error": "OOM"}]
    out = sb.scaling(rows)
    assert out[("8b-full", "fp8", 2)]["layout"] == "dp2" and out[("8b-full", "fp8", 8)]["layout"] == "dp8"
    assert [out[("8b-full", "fp8", g)]["efficiency"] for g in (2, 4, 8)] == [1.0, 0.98, 0.92]
    assert out[("8b-full", "fp8", 8)]["base_gpus"] == 2  # the failed 1-GPU row is no base
    assert out[("8b-full", "bf16", 8)]["efficiency"] == 0.9 and out[("8b-full", "bf16", 8)]["base_gpus"] == 4


def test_loss_comparison():
    ref = [10.0, 9.5, 9.0]
    ok = sb.compare_losses({"a": ref, "b": [10.0, 9.52, 8.97], "c": [10.01, 9.5, 9.0]}, 3, 0.05)
    assert ok["ok"] and ok["reference"] == "a"
    assert [(x["layout"], round(x["max_abs_diff"], 6)) for x in ok["rows"]] == [("b", 0.03), ("c", 0.01)]
    far = sb.compare_losses({"a": ref, "b": [10.0, 9.6, 9.0]}, 3, 0.05)
    assert not far["ok"] and round(far["rows"][0]["max_abs_diff"], 6) == 0.1
    assert not sb.compare_losses({"a": ref, "b": None}, 3, 0.05)["ok"]  # a run that failed
    assert not sb.compare_losses({"a": ref, "b": ref[:2]}, 3, 0.05)["ok"]  # fewer iterations than compared
    assert not sb.compare_losses({"a": ref[:2], "b": ref[:2]}, 3, 0.05)["ok"]  # nor the reference
    assert sb.compare_losses({"a": ref}, 3, 0.05)["ok"]


def test_loss_reports_compare_runs_from_several_calls():
    """Rows of `losses` calls (several device calls append to one file): grouped by shape, precision,
    iterations and global batch; the reference is the first layout at the smallest GPU count; a layout run
    again counts with its latest losses."""
    def run(gpus, layout, losses, precision="bf16"):
        return {"kind": "loss_run", "shape": "8b-full", "precision": precision, "iterations": 2, "global_batch": 8,
                "gpus": gpus, "layout": layout, "losses": losses}

    rows = [run(8, "dp8", [11.0, 10.5]), run(2, "dp2", [11.0, 10.0]), run(2, "tp2 dp1", [11.0, 10.3]),
            run(2, "tp2 dp1", [11.0, 10.01]), run(2, "dp2", [11.0, 10.2], "fp8"), {"kind": "run"}]
    bf16, fp8 = sb.loss_reports(rows)
    assert (bf16["reference"], bf16["precision"], fp8["precision"]) == ("2 x dp2", "bf16", "fp8")
    assert [(r["layout"], round(r["max_abs_diff"], 6), r["ok"]) for r in bf16["rows"]] == [
        ("2 x tp2 dp1", 0.01, True), ("8 x dp8", 0.5, False)]
    assert not bf16["ok"] and fp8["ok"] and fp8["rows"] == []


def test_table_marks_the_fastest_layout_and_what_was_not_run():
    rows = [{"kind": "run", "shape": "8b-full", "precision": "fp8", "gpus": g, "layout": lay,
             "tokens_per_s_per_gpu": rate, "tflops_per_gpu": tf, "peak_gb": 90.0}
            for g, lay, rate, tf in ((2, "dp2", 7000, 690.0), (2, "tp2 dp1", 6000, 590.0), (8, "dp8", 6440, 760.0))]
    rows.append({"kind": "run", "shape": "8b-full", "precision": "fp8", "gpus": 2, "layout": "cp2 dp1",
                 "error": "Traceback\ntorch.OutOfMemoryError: CUDA out of memory"})
    rows += [{"kind": "loss_run", "shape": "8b-full", "precision": "bf16", "iterations": 3, "global_batch": 8,
              "gpus": 2, "layout": lay, "losses": losses} for lay, losses in (("dp2", [11.9, 11.0, 10.0]),
                                                                              ("tp2 dp1", [11.9, 11.03, 10.0]))]
    text = sb.table(rows, ["8b-full"], ["fp8"])
    assert "| 8b-full | fp8 | 2 | **dp2** | **7,000** | 690.0 | 100.0% (vs 2 GPUs) | 90.0 |" in text
    assert "| 8b-full | fp8 | 8 | **dp8** | **6,440** | 760.0 | 92.0% (vs 2 GPUs) | 90.0 |" in text
    assert "| 8b-full | fp8 | 2 | tp2 dp1 | 6,000 | 590.0 |  | 90.0 |" in text
    assert "| 8b-full | fp8 | 2 | cp2 dp1 | torch.OutOfMemoryError: CUDA out of memory |" in text
    assert "| 8b-full | fp8 | 1 | dp1 | does not fit: 120 GiB" in text
    assert "| 8b-full | fp8 | 4 | dp4 | not run: needs nvidia-h200-x4 |" in text
    assert "| 8b-full | fp8 | 8 | cp2 dp4 | not run: needs nvidia-h200-x8 |" in text
    assert "760.0 TFLOP/s per GPU = 1.02 x NVIDIA's 744" in text
    assert "losses 8b-full bf16, 3 iterations, global batch 8: max |diff| vs 2 x dp2: 2 x tp2 dp1 0.0" in text
    assert "(tolerance 0.05): equal" in text
