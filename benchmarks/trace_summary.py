"""Where a training step's GPU time goes, from PyTorch profiler traces (Chrome trace JSON, as
`--profile --use-pytorch-profiler` of megatron.training or `torch.profiler` write them):

    python benchmarks/trace_summary.py TRACE.json[.gz] | FOLDER

GPU kernels are grouped by name (GEMM, attention, FP8 casts, norms, communication, optimizer, PyTorch's
elementwise kernels (unfused activations, adds, copies, concatenations), other) and
reported as milliseconds and shares of the traced window, with each group's five costliest kernels (name cut
at 120 characters, ms, launches) to say what a group is made of, and, where the trace names the host operator
that launched each kernel, the five costliest operators (with their input shapes where the profiler recorded
them: `--pytorch-profiler-collect-shapes`, which train_bench.py's `--trace` passes) to say whose kernels they are;
`idle` is the part of the window in which no kernel ran (the GPU waiting for the host: launch gaps,
synchronisation). One JSON object on stdout."""

from __future__ import annotations

import gzip
import json
import os
import re
import sys

# first match wins: communication and attention kernels are named before anything they share words with;
# PyTorch's own kernels (at::native) are elementwise work whatever their template arguments say: they are named
# `gpu_kernel_impl_nocast` ("nocast" is not a cast) or, mixing dtypes, `...LoadWithCast...` (the fp32 += bf16
# gradient adds: "fp8 cast" in the 2026-12-05 profiles, in bf16 too); norms that write fp8 are norms
CATEGORIES = (
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter"),
    ("attention", r"flash|fmha|fused_attn|attn|sdpa|softmax"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|matmul"),
    ("optimizer", r"adam|multi_tensor|optimizer"),
    ("norm", r"norm"),
    ("elementwise", r"elementwise|CatArray|at::native"),
    ("fp8 cast", r"(?<!no)cast|quantiz|amax|fp8|transpose"),
)


def _events(path: str, steps: bool = False) -> tuple[list[dict], dict[int, str], list[tuple[float, float]]]:
    """The trace's GPU kernel (and copy) events, and the host operators by their "External id" (the id a kernel
    carries of the operator that launched it) as `name [input dims]` where the trace recorded shapes, and the
    host's `ProfilerStep#` ranges as (start, end) in microseconds. `steps`: only
    the kernels launched inside the host's `ProfilerStep#` ranges (the runtime call, a kernel launch or a CUDA
    graph's, that carries the kernel's "correlation" id starts inside one), so that per-step figures divide the
    work of exactly the steps traced; a trace without step markers (or correlation ids) keeps every kernel."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels, ops, ranges, launches = [], {}, [], {}
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, args = str(e.get("cat", "")).lower(), e.get("args") or {}
        if cat in ("kernel", "gpu_memcpy"):
            kernels.append(e)
        elif cat == "cpu_op" and "External id" in args:
            dims = [d for d in args.get("Input Dims", []) if d]
            ops[args["External id"]] = e.get("name", "") + (f" {dims}" if dims else "")
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launches[args["correlation"]] = e["ts"]
        elif not cat.startswith("gpu") and str(e.get("name", "")).startswith("ProfilerStep#"):
            ranges.append((e["ts"], e["ts"] + e["dur"]))
    if steps and ranges:
        def inside(k: dict) -> bool:
            ts = launches.get((k.get("args") or {}).get("correlation"))
            return ts is not None and any(begin <= ts <= end for begin, end in ranges)

        kernels = [k for k in kernels if inside(k)] or kernels  # (no correlation ids: every kernel)
    return kernels, ops, ranges


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label
    return "other"


def summarise(kernels: list[dict], ops: dict[int, str] | None = None) -> dict:
    """{"window_ms", "categories": {name: {"ms", "share", "top"[, "ops"]}}, "idle_ms", "idle_share"} of kernel
    events; "top": the category's five costliest kernel names as [name, ms, launches]; "ops", where `ops` (host
    operators by External id) names the launching operator of its kernels: the five costliest of those operators
    as [`name [input dims]` (cut at 160 characters), ms, launches]."""
    if not kernels:
        raise ValueError("no GPU kernel events in the trace")
    start = min(k["ts"] for k in kernels)
    end = max(k["ts"] + k["dur"] for k in kernels)
    window = end - start
    totals: dict[str, float] = {}
    by_name: dict[str, dict[str, list[float]]] = {}
    by_op: dict[str, dict[str, list[float]]] = {}
    for k in kernels:
        name = k.get("name", "")
        label = category(name)
        totals[label] = totals.get(label, 0.0) + k["dur"]
        entry = by_name.setdefault(label, {}).setdefault(name[:120], [0.0, 0])
        entry[0] += k["dur"]
        entry[1] += 1
        op = (ops or {}).get((k.get("args") or {}).get("External id"))
        if op:
            entry = by_op.setdefault(label, {}).setdefault(op[:160], [0.0, 0])
            entry[0] += k["dur"]
            entry[1] += 1
    busy, reach = 0.0, start  # union of the kernel intervals (streams overlap)
    for k in sorted(kernels, key=lambda k: k["ts"]):
        begin, finish = max(k["ts"], reach), k["ts"] + k["dur"]
        if finish > begin:
            busy += finish - begin
            reach = finish
    def costliest(entries: dict[str, list[float]]) -> list[list]:
        return [[n, round(d / 1e3, 3), c] for n, (d, c) in sorted(entries.items(), key=lambda kv: -kv[1][0])[:5]]

    return {"window_ms": round(window / 1e3, 3),
            "categories": {label: {"ms": round(us / 1e3, 3), "share": round(us / window, 4),
                                   "top": costliest(by_name[label]),
                                   **({"ops": costliest(by_op[label])} if label in by_op else {})}
                           for label, us in sorted(totals.items(), key=lambda kv: -kv[1])},
            "idle_ms": round((window - busy) / 1e3, 3), "idle_share": round((window - busy) / window, 4)}


def summarise_folder(path: str) -> dict:
    """The summary of the largest trace file under `path` (a file or a folder)."""
    files = [path] if os.path.isfile(path) else [
        os.path.join(root, n) for root, _, names in os.walk(path) for n in names
        if n.endswith((".json", ".json.gz"))]
    if not files:
        raise ValueError(f"no trace (.json / .json.gz) under {path}")
    kernels, ops, _ = _events(max(files, key=os.path.getsize))
    return summarise(kernels, ops)


if __name__ == "__main__":
    print(json.dumps(summarise_folder(sys.argv[1])))
