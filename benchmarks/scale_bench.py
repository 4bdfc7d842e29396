"""Scale-out on one host: full Llama-3-8B (32 layers, seq 8192) and a Mixtral-shape mixture of experts on 1, 2,
4 and 8 GPUs through our pretrain path (`python -m megatron_patch.pretrain`, Transformer Engine, mock data),
each GPU count in the layouts that can be fastest there; tokens/s and TFLOP/s per GPU, scaling efficiency, and
loss equality across layouts from the same HF start. docs/benchmarks.md holds the table and the reasoning.

    python benchmarks/scale_bench.py layouts                      # the layout table: valid? memory per GPU (CPU)
    python benchmarks/scale_bench.py run --shapes 8b-full --gpus 2 --precisions bf16 fp8 --out scale.jsonl
    python benchmarks/scale_bench.py run --shapes 8b-full --gpus 8 --layouts dp "cp2" --out scale.jsonl
    python benchmarks/scale_bench.py losses --shapes 8b-full --gpus 2 4 8 --iters 20 --out scale.jsonl
    python benchmarks/scale_bench.py losses --cpu --shapes tiny --gpus 2 --iters 6   # DP2 vs TP2 vs PP2, fp32
    python benchmarks/scale_bench.py table scale.jsonl            # markdown table, fastest layout per GPU count

`run` measures each layout of LAYOUTS[shape][gpus] (or the `--layouts` named) that is valid for the shape
(`check`: TP divides the heads and kv groups, PP x VP the layers, EP the experts, whole replicas, and the
weights, gradients and Adam state fit in STATIC_SHARE of the GPU's memory); a layout that is not is a row
saying why. Every run: the distributed optimizer, overlapped gradient reduce and parameter gather, bf16
gradient reduction (NVIDIA's Megatron-LM Llama-3-8B recipe), sequence parallelism with TP, the interleaved
schedule with VP, the alltoall dispatcher and grouped GEMM for experts; `--micro-batches` per replica and
optimizer step (weak scaling: the global batch grows with DP). Rows go to `--out` (JSON lines, appended), so a
table fills over several device calls; `table` keeps the latest row of each cell.

`losses` trains each layout `--iters` iterations from the same random HF checkpoint (`--load-hf`, made once
in `--work`), on the same global batch, and compares every layout's losses with the first one's within
TOLERANCE (the virtual pipeline too: `--load-hf` fills each model chunk). With `--cpu` the same commands run on
Megatron's CPU path (gloo, fp32).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_bench as tb  # noqa: E402  (the pretrain command, its log, Megatron's FLOP formula, the HF config)

SHAPES = {
    "8b-full": tb.SHAPES["8b-full"],
    # Mixtral-8x7B's widths (8 experts of FFN 14336, top-2, vocab 32000), 8 of its 32 layers: EP=2 holds it on
    # two H200s (the whole model needs more than 8 GPUs' memory at EP=8 without recomputation)
    "mixtral-8l": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8, num_attention_heads=32,
                       num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, seq=4096, mbs=1,
                       vocab=32000),
    # the CPU loss-equality check (`losses --cpu`); vocab 1024: no padding at TP 1 or 2
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, seq=64, mbs=2, vocab=1024),
    "tiny-moe": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, seq=64, mbs=2, vocab=1024),
}
GPU_SHAPES = ("8b-full", "mixtral-8l")
STATIC_SHARE = 0.7  # of the GPU's memory for weights, gradients and optimizer state; the rest for activations
H200_GIB = 140  # what torch reports for an H200 (141 GB)
TOLERANCE = {"fp32": 1e-5, "bf16": 0.05, "fp8": 0.1}  # max |loss difference| over the iterations compared
NVIDIA_TFLOPS = 744  # NVIDIA's published Llama-3-8B FP8 figure, TFLOP/s per GPU on 8xH100 (the target)
GPU_FLAGS = ["--overlap-grad-reduce", "--overlap-param-gather", "--grad-reduce-in-bf16"]
GRAD_BYTES = 2  # --grad-reduce-in-bf16: the gradient buffers are bf16


@dataclasses.dataclass(frozen=True)
class Parallel:
    """A layout of `gpus` GPUs: world = TP x PP x CP x DP; experts split over EP inside DP (x CP)."""

    tp: int = 1
    pp: int = 1
    vp: int = 1  # virtual stages per pipeline rank (the interleaved schedule)
    cp: int = 1
    ep: int = 1

    def dp(self, gpus: int) -> int:
        return gpus // (self.tp * self.pp * self.cp)

    @property
    def label(self) -> str:
        """The name without DP (the same layout at any GPU count): "dp", "tp2", "pp2 vp4", "cp2", "ep8"."""
        parts = [f"{k}{getattr(self, k)}" for k in ("tp", "pp", "vp", "cp", "ep") if getattr(self, k) > 1]
        return " ".join(parts) or "dp"

    def name(self, gpus: int) -> str:
        return ("" if self.label == "dp" else self.label + " ") + f"dp{self.dp(gpus)}"


_DENSE = [Parallel(), Parallel(cp=2), Parallel(tp=2), Parallel(pp=2, vp=4)]
LAYOUTS: dict[str, dict[int, list[Parallel]]] = {
    "8b-full": {1: [Parallel()], 2: _DENSE, 4: _DENSE, 8: _DENSE},
    "mixtral-8l": {2: [Parallel(ep=2)], 4: [Parallel(ep=4)], 8: [Parallel(ep=8), Parallel(ep=4)]},
    "tiny": {1: [Parallel()], 2: [Parallel(), Parallel(tp=2), Parallel(pp=2), Parallel(pp=2, vp=2)]},
    "tiny-moe": {1: [Parallel()], 2: [Parallel(), Parallel(ep=2)]},
}


def parameters(shape: str) -> tuple[int, int, int]:
    """(dense parameters of one layer, expert parameters of one layer, embedding = output layer) of a shape."""
    s = SHAPES[shape]
    h, f, heads, kv = s["hidden_size"], s["intermediate_size"], s["num_attention_heads"], s["num_key_value_heads"]
    d = h // heads
    attention = h * heads * d * 2 + 2 * h * kv * d
    experts = s.get("num_local_experts", 0)
    dense = attention + 2 * h + (h * experts if experts else 3 * h * f)  # norms; the router or the MLP
    return dense, experts * 3 * h * f, s.get("vocab", tb.VOCAB) * h


def static_gib(shape: str, par: Parallel, gpus: int, grad_bytes: int = 4) -> float:
    """Weights (bf16), gradients (`grad_bytes`) and the distributed optimizer's fp32 copy and Adam moments
    (12 bytes, sharded over the data-parallel ranks) on the fullest GPU: the first or last pipeline stage."""
    dense, expert, embedding = parameters(shape)
    layers = SHAPES[shape]["num_hidden_layers"] // par.pp
    stage_dense = layers * dense + embedding * (2 if par.pp == 1 else 1)
    dense_dp = par.dp(gpus) * par.cp
    expert_dp = max(1, gpus // (par.pp * par.tp * par.ep))
    per_gpu = (stage_dense / par.tp * (2 + grad_bytes + 12 / dense_dp)
               + layers * expert / (par.tp * par.ep) * (2 + grad_bytes + 12 / expert_dp))
    return per_gpu / 2**30


def check(shape: str, par: Parallel, gpus: int, global_batch: int | None = None, gpu_gib: float | None = None,
          grad_bytes: int = 4) -> list[str]:
    """Why `par` cannot run `shape` on `gpus` GPUs (empty: it can)."""
    from megatron_patch.models import Layout

    s = SHAPES[shape]
    layers, experts = s["num_hidden_layers"], s.get("num_local_experts", 0)
    problems = []
    replica = par.tp * par.pp * par.cp
    if gpus % replica:
        problems.append(f"TP x PP x CP = {replica} does not divide {gpus} GPUs")
    try:  # the library's one layout check: heads, query groups, layers, PP x VPP, experts
        Layout(tp=par.tp, pp=par.pp, ep=par.ep, cp=par.cp, vpp=par.vp if par.vp > 1 else None).check(
            layers, s["num_attention_heads"], s["num_key_value_heads"], experts)
    except ValueError as e:
        problems.append(str(e))
    if par.cp > 1 and s["seq"] % (2 * par.cp):
        problems.append(f"CP={par.cp} needs the sequence ({s['seq']}) in 2 x CP equal chunks")
    if par.ep > 1 and (gpus // (par.pp * par.tp)) % par.ep:
        problems.append(f"EP={par.ep} does not divide the {gpus // (par.pp * par.tp)} ranks of a pipeline stage")
    if problems:
        return problems
    dp = par.dp(gpus)
    if global_batch is not None:
        if global_batch % (s["mbs"] * dp):
            problems.append(f"global batch {global_batch} is not a multiple of micro-batch {s['mbs']} x DP {dp}")
        elif par.pp > 1 and global_batch // (s["mbs"] * dp) < par.pp:
            problems.append(f"fewer micro-batches per step than PP={par.pp} stages")
    if gpu_gib is not None:
        need = static_gib(shape, par, gpus, grad_bytes)
        if need > STATIC_SHARE * gpu_gib:
            problems.append(f"does not fit: {need:.0f} GiB of weights, gradients and Adam state per GPU > "
                            f"{STATIC_SHARE:.0%} of {gpu_gib:g} GiB")
    return problems


def layout_flags(shape: str, par: Parallel, cpu: bool = False) -> list[str]:
    """Megatron's flags for a layout, plus (on GPUs) the overlap and gradient-reduce settings of every run."""
    flags = []
    if par.tp > 1:
        flags += ["--tensor-model-parallel-size", str(par.tp), *([] if cpu else ["--sequence-parallel"])]
    if par.pp > 1:
        flags += ["--pipeline-model-parallel-size", str(par.pp)]
    if par.vp > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(par.vp)]
    if par.cp > 1:
        flags += ["--context-parallel-size", str(par.cp)]
    if SHAPES[shape].get("num_local_experts"):
        flags += [*(["--expert-model-parallel-size", str(par.ep)] if par.ep > 1 else []),
                  "--moe-token-dispatcher-type", "allgather" if cpu else "alltoall",
                  *([] if cpu else ["--moe-grouped-gemm"])]
    return flags + ([] if cpu else GPU_FLAGS)


def command(shape: str, par: Parallel, gpus: int, precision: str, iters: int, global_batch: int, model: list[str],
            cpu: bool = False, extra: list[str] = ()) -> tuple[list[str], dict[str, str]]:
    s = SHAPES[shape]
    return tb.pretrain_command(gpus, model, s["seq"], s["mbs"], global_batch, iters, precision, "default",
                               [*layout_flags(shape, par, cpu), *extra], vocab=s.get("vocab", tb.VOCAB), cpu=cpu)


def measure(shape: str, precision: str, gpus: int, par: Parallel, result: dict, flops: float) -> dict:
    """A table row from one run's result (`train_bench.run_pretrain`): tokens/s and TFLOP/s per GPU."""
    row = {"kind": "run", "shape": shape, "precision": precision, "gpus": gpus, "layout": par.name(gpus)}
    if "error" in result:
        return {**row, "error": result["error"][-600:]}
    seconds, samples = result["s_per_iter"], result["samples"]
    return {**row, "global_batch": samples, "s_per_iter": round(seconds, 4),
            "tokens_per_s_per_gpu": round(samples * SHAPES[shape]["seq"] / seconds / gpus),
            "tflops_per_gpu": round(flops * samples / seconds / 1e12 / gpus, 1),
            "peak_gb": round(result["peak_gb"], 1) if result.get("peak_gb") else None}


def scaling(rows: list[dict]) -> dict[tuple[str, str, int], dict]:
    """The fastest layout per (shape, precision, GPU count), with its scaling efficiency: tokens/s per GPU
    relative to the fastest layout at the smallest GPU count measured for that shape and precision."""
    best: dict[tuple[str, str, int], dict] = {}
    for r in rows:
        key = (r["shape"], r["precision"], r["gpus"])
        if r.get("tokens_per_s_per_gpu") and (key not in best or
                                              r["tokens_per_s_per_gpu"] > best[key]["tokens_per_s_per_gpu"]):
            best[key] = r
    out = {}
    for (shape, precision, gpus), r in best.items():
        base_gpus = min(g for (s, p, g) in best if (s, p) == (shape, precision))
        base = best[(shape, precision, base_gpus)]["tokens_per_s_per_gpu"]
        out[(shape, precision, gpus)] = {**r, "base_gpus": base_gpus,
                                         "efficiency": round(r["tokens_per_s_per_gpu"] / base, 3)}
    return out


def compare_losses(runs: dict[str, list[float] | None], iterations: int, tolerance: float) -> dict:
    """Every layout's losses against the first layout's (the reference) over `iterations` iterations: the
    largest absolute difference; a run that failed or logged fewer iterations does not pass."""
    names = list(runs)
    reference = runs[names[0]] or []
    rows = []
    for name in names[1:]:
        losses = runs[name] or []
        complete = len(losses) >= iterations and len(reference) >= iterations
        diff = tb.loss_difference(losses, reference, iterations) if complete else None
        rows.append({"layout": name, "max_abs_diff": diff, "ok": diff is not None and diff <= tolerance})
    return {"reference": names[0], "iterations": iterations, "tolerance": tolerance, "rows": rows,
            "ok": len(reference) >= iterations and all(r["ok"] for r in rows)}


def hf_start(shape: str, folder: str) -> str:
    """A random HF checkpoint of the shape (transformers' own initialisation, seed 0), made once."""
    return tb.random_hf(tb.config(SHAPES[shape]), folder)


def _visible_gpus(cpu: bool) -> int:
    if cpu:
        return os.cpu_count() or 1
    import torch

    return torch.cuda.device_count()


def _selected(shape: str, gpus: int, labels: list[str] | None) -> list[Parallel]:
    return [p for p in LAYOUTS[shape].get(gpus, []) if not labels or p.label in labels]


def _emit(row: dict, out: str | None) -> None:
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def run(a: argparse.Namespace) -> int:
    extra = shlex.split(a.extra)
    meta = {} if a.dry_run else tb.versions()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in a.shapes:
            path = os.path.join(tmp, f"{shape}.json")
            with open(path, "w") as f:
                json.dump(tb.config(SHAPES[shape]), f)
            flops = None
            for gpus in a.gpus:
                for precision in a.precisions:
                    for par in _selected(shape, gpus, a.layouts):
                        global_batch = a.micro_batches * SHAPES[shape]["mbs"] * par.dp(gpus)
                        row = {"kind": "run", "shape": shape, "precision": precision, "gpus": gpus,
                               "layout": par.name(gpus)}
                        problems = check(shape, par, gpus, global_batch, a.gpu_memory_gib, GRAD_BYTES)
                        cmd, env = command(shape, par, gpus, precision, a.iters, global_batch,
                                           ["--hf-config", path], extra=extra)
                        if a.dry_run:
                            print(f"# {row['layout']}: {'; '.join(problems)}" if problems else shlex.join(cmd))
                            continue
                        if problems:
                            row["skipped"] = "; ".join(problems)
                        elif gpus > _visible_gpus(False):
                            row["skipped"] = f"needs {gpus} GPUs, {_visible_gpus(False)} visible"
                        else:
                            flops = flops or tb.flops_per_sample(SHAPES[shape])
                            row = measure(shape, precision, gpus, par, tb.run_pretrain(cmd, env), flops)
                        row.update(extra=a.extra, micro_batches=a.micro_batches, iters=a.iters, meta=meta)
                        rows.append(row)
                        _emit(row, a.out)
    if not a.dry_run:
        print(table(read_rows(a.out) if a.out else rows, a.shapes, a.precisions))
    return 0


def losses(a: argparse.Namespace) -> int:
    precisions = ["fp32"] if a.cpu else a.precisions
    rows = []
    for shape in a.shapes:
        folder = os.path.join(a.work, f"hf-{shape}")
        if not a.dry_run:
            hf_start(shape, folder)
        for precision in precisions:
            for gpus in a.gpus:
                seen = set()
                for par in _selected(shape, gpus, a.layouts):
                    problems = check(shape, par, gpus, a.global_batch, None if a.cpu else a.gpu_memory_gib,
                                     GRAD_BYTES)
                    if par in seen or problems or (not a.dry_run and gpus > _visible_gpus(a.cpu)):
                        continue
                    seen.add(par)
                    cmd, env = command(shape, par, gpus, precision, a.iters, a.global_batch,
                                       ["--load-hf", folder], cpu=a.cpu, extra=shlex.split(a.extra))
                    if a.dry_run:
                        print(shlex.join(cmd))
                        continue
                    result = tb.run_pretrain(cmd, env)
                    row = {"kind": "loss_run", "shape": shape, "precision": precision, "gpus": gpus,
                           "layout": par.name(gpus), "iterations": a.iters, "global_batch": a.global_batch,
                           "extra": a.extra, "losses": result.get("losses")}
                    if "error" in result:
                        row["error"] = result["error"][-600:]
                    rows.append(row)
                    _emit(row, a.out)
    if a.dry_run:
        return 0
    reports = loss_reports(read_rows(a.out) if a.out else rows)
    for report in reports:
        print(json.dumps(report))
    return 0 if all(r["ok"] for r in reports) else 1


def loss_reports(rows: list[dict]) -> list[dict]:
    """The loss comparisons of `loss_run` rows (from one or several calls; the latest row of a layout wins):
    per shape, precision, iteration count and global batch, every layout against the first layout run at the
    smallest GPU count."""
    groups: dict[tuple, dict[tuple[int, str], dict]] = {}
    for r in rows:
        if r.get("kind") == "loss_run":
            key = (r["shape"], r["precision"], r["iterations"], r["global_batch"])
            groups.setdefault(key, {})[(r["gpus"], r["layout"])] = r
    reports = []
    for (shape, precision, iterations, batch), runs in groups.items():
        ordered = sorted(runs.values(), key=lambda r: r["gpus"])  # stable: the order they were run in
        compared = compare_losses({f"{r['gpus']} x {r['layout']}": r["losses"] for r in ordered}, iterations,
                                  TOLERANCE[precision])
        reports.append({"kind": "losses", "shape": shape, "precision": precision, "global_batch": batch,
                        **compared, "losses": {f"{r['gpus']} x {r['layout']}": r["losses"] for r in ordered}})
    return reports


def read_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def table(rows: list[dict], shapes: list[str], precisions: list[str]) -> str:
    """The markdown table: every layout of LAYOUTS per shape, precision and GPU count, measured or why not;
    the fastest per GPU count in bold with its scaling efficiency; then the loss comparisons."""
    latest = {(r["shape"], r["precision"], r["gpus"], r["layout"]): r for r in rows if r.get("kind") == "run"}
    fastest = scaling(list(latest.values()))
    lines = ["| model | precision | GPUs | layout | tokens/s per GPU | TFLOP/s per GPU | scaling efficiency "
             "| peak GB |", "|---|---|---|---|---|---|---|---|"]
    for shape in shapes:
        for precision in precisions:
            for gpus, layouts in LAYOUTS[shape].items():
                for par in layouts:
                    name, r = par.name(gpus), latest.get((shape, precision, gpus, par.name(gpus)))
                    why = "; ".join(check(shape, par, gpus, None, H200_GIB, GRAD_BYTES))
                    if r and "tokens_per_s_per_gpu" in r:
                        best = fastest[(shape, precision, gpus)]
                        is_best = best["layout"] == name
                        cells = [f"{r['tokens_per_s_per_gpu']:,}", str(r["tflops_per_gpu"]),
                                 f"{best['efficiency']:.1%} (vs {best['base_gpus']} GPUs)" if is_best else "",
                                 str(r.get("peak_gb") or "")]
                        if is_best:
                            name, cells[0] = f"**{name}**", f"**{cells[0]}**"
                    else:
                        cells = [_status(r, why, gpus), "", "", ""]
                    lines.append(f"| {shape} | {precision} | {gpus} | {name} | " + " | ".join(cells) + " |")
    best8 = fastest.get(("8b-full", "fp8", 8))
    if best8:
        lines.append(f"\n8b-full fp8 on 8 GPUs: {best8['tflops_per_gpu']} TFLOP/s per GPU = "
                     f"{best8['tflops_per_gpu'] / NVIDIA_TFLOPS:.2f} x NVIDIA's {NVIDIA_TFLOPS} (8xH100, FP8)")
    for r in loss_reports(rows):
        diffs = ", ".join(f"{x['layout']} {x['max_abs_diff'] if x['max_abs_diff'] is not None else 'failed'}"
                          for x in r["rows"])
        lines.append(f"\nlosses {r['shape']} {r['precision']}, {r['iterations']} iterations, global batch "
                     f"{r['global_batch']}: max |diff| vs {r['reference']}: {diffs} (tolerance {r['tolerance']}): "
                     f"{'equal' if r['ok'] else 'NOT equal'}")
    return "\n".join(lines)


def _status(row: dict | None, why: str, gpus: int) -> str:
    """What a table cell without a measurement says: the run's last error line, why it was skipped or cannot
    run, or that it has not been run (and on which machine it can be)."""
    if row and "error" in row:
        return (row["error"].strip().splitlines() or ["error"])[-1][:120]
    if row and "skipped" in row:
        return row["skipped"]
    return why or "not run: needs nvidia-h200" + (f"-x{gpus}" if gpus > 1 else "")


def layouts_table(shapes: list[str], gpu_gib: float) -> str:
    lines = ["| model | GPUs | layout | TP | PP | VP | CP | EP | DP | static GiB per GPU | valid |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape in shapes:
        for gpus, layouts in LAYOUTS[shape].items():
            for p in layouts:
                why = "; ".join(check(shape, p, gpus, None, gpu_gib, GRAD_BYTES)) or "yes"
                lines.append(f"| {shape} | {gpus} | {p.name(gpus)} | {p.tp} | {p.pp} | {p.vp} | {p.cp} | {p.ep} | "
                             f"{p.dp(gpus)} | {static_gib(shape, p, gpus, GRAD_BYTES):.1f} | {why} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("run", "losses"):
        p = sub.add_parser(name)
        p.add_argument("--shapes", nargs="+", default=list(GPU_SHAPES), choices=sorted(SHAPES))
        p.add_argument("--gpus", nargs="+", type=int, default=[2], help="GPU counts (processes) to run")
        p.add_argument("--precisions", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
        p.add_argument("--layouts", nargs="+", help="only these layouts, by label (dp, cp2, tp2, 'pp2 vp4', ep8)")
        p.add_argument("--extra", default="", help="more Megatron flags for every run, one string")
        p.add_argument("--gpu-memory-gib", type=float, default=H200_GIB)
        p.add_argument("--out", help="append the rows to this JSON-lines file")
        p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    run_p, loss_p = sub.choices["run"], sub.choices["losses"]
    run_p.add_argument("--iters", type=int, default=10, help="optimizer steps per run (the first half is warm-up)")
    run_p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per replica and optimizer step")
    loss_p.add_argument("--iters", type=int, default=20)
    loss_p.add_argument("--global-batch", type=int, default=8, help="samples per step, the same for every layout")
    loss_p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "scale_bench"),
                        help="where the HF start is made (once; kept while the machine is)")
    loss_p.add_argument("--cpu", action="store_true", help="Megatron's CPU path (gloo, fp32): the tiny shapes")
    table_p = sub.add_parser("table")
    table_p.add_argument("rows", help="JSON-lines file written by run / losses --out")
    table_p.add_argument("--shapes", nargs="+", default=list(GPU_SHAPES), choices=sorted(SHAPES))
    table_p.add_argument("--precisions", nargs="+", default=["bf16", "fp8"])
    lay_p = sub.add_parser("layouts")
    lay_p.add_argument("--shapes", nargs="+", default=list(GPU_SHAPES), choices=sorted(SHAPES))
    lay_p.add_argument("--gpu-memory-gib", type=float, default=H200_GIB)
    a = ap.parse_args(argv)
    if a.command == "run":
        return run(a)
    if a.command == "losses":
        return losses(a)
    if a.command == "table":
        print(table(read_rows(a.rows), a.shapes, a.precisions))
    else:
        print(layouts_table(a.shapes, a.gpu_memory_gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
