"""The one-token GEMMs of a decode step, alone: cuBLAS (torch's F.linear, the kernels megatron-core's layers
reach), cuBLAS GEMV (torch.mv) and our Triton kernel (`megatron_patch.inference.gemv`), per weight shape and for
a whole step's chain of them, in CUDA graphs (no launch overhead) over weights that do not fit in L2.

    python benchmarks/gemv_probe.py [--shape 8b] [--rows 1] [--sweep]

Per shape and implementation, one JSON row printed as soon as measured: microseconds per call, GB/s (weight
bytes / time) and the share of --bandwidth-tb-s; `max_abs_diff` to an fp32 reference. `--sweep` also tries
each Triton launch configuration of a small grid per shape and prints the best. The `step` rows chain every
layer's GEMMs (QKV, attention output, FC1, FC2) and the output layer as one decode step does. QKV and FC1 carry
their RMSNorm as in the engine (TE's LayerNormLinear): a kernel of its own before cuBLAS (torch's RMSNorm), folded
into ours (rows with `"norm": true`; the sweep tries the configurations on the layer as the engine calls it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from machine import bandwidth_tb_s  # noqa: E402  (beside this script)

from megatron_patch.inference.gemv import Norm, config_for, gemv  # noqa: E402

# (name, N, K) of one layer's GEMMs, then the output layer; layers
SHAPES = {
    "8b": ([("qkv", 6144, 4096), ("proj", 4096, 4096), ("fc1", 28672, 4096), ("fc2", 4096, 14336)],
           ("output", 128256, 4096), 32),
    "1b": ([("qkv", 3072, 2048), ("proj", 2048, 2048), ("fc1", 16384, 2048), ("fc2", 2048, 8192)],
           ("output", 128256, 2048), 16),
}


NORMED = ("qkv", "fc1")  # the layers whose RMSNorm the engine's linear layer applies (TE's LayerNormLinear)


def _normed(x: torch.Tensor, norm: Norm | None) -> torch.Tensor:
    """x through the norm as a separate kernel (torch's RMSNorm), or x."""
    return x if norm is None else F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)


def impls(rows: int) -> dict:
    """The implementations compared for calls of `rows` tokens (torch.mv takes one): fn(x, w, norm) with the
    norm (None or an RMSNorm) a kernel of its own before cuBLAS, folded into ours."""
    out = {"cublas": lambda x, w, norm: F.linear(_normed(x, norm), w),
           "cublas_gemv": lambda x, w, norm: torch.mv(w, _normed(x, norm)[0])[None],
           "triton": lambda x, w, norm: gemv(x, w, None, norm)}
    if rows != 1:
        del out["cublas_gemv"]
    return out


def timed(fn, reps: int) -> float:
    """Microseconds per replay of fn captured in a CUDA graph."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def per_call(fn, xs: torch.Tensor, ws: list[torch.Tensor], norm: Norm | None, reps: int) -> float:
    """Microseconds per call of fn(xs, w, norm), over the copies ws in turn."""
    return timed(lambda: [fn(xs, w, norm) for w in ws], reps) / len(ws)


def weights(n: int, k: int, min_bytes: int) -> list[torch.Tensor]:
    copies = max(1, -(-min_bytes // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, default=1, help="tokens per call (1 = batch-1 decode)")
    p.add_argument("--bandwidth-tb-s", type=float, default=None,
                   help="HBM bandwidth, TB/s (default: the GPU's, benchmarks/machine.py)")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args(argv)
    layer, output, layers = SHAPES[a.shape]
    torch.manual_seed(0)
    x = torch.randn(a.rows, max(k for _, _, k in layer + [output]), device="cuda", dtype=torch.bfloat16)
    bw = bandwidth_tb_s(a.bandwidth_tb_s) * 1e12
    norms = {k: Norm("RMSNorm", 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16), None, 1e-5)
             for k in {k for _, _, k in layer + [output]}}
    for name, n, k in layer + [output]:
        ws = weights(n, k, 512 << 20)  # several copies: a call reads its weight from HBM, not from the 50 MB L2
        xs = x[:, :k].contiguous()
        norm = norms[k] if name in NORMED else None
        ref = _normed(xs.float(), norm) @ ws[0].float().T
        for impl, fn in impls(a.rows).items():
            diff = (fn(xs, ws[0], norm).float() - ref).abs().max().item()
            us = per_call(fn, xs, ws, norm, a.reps)
            gbs = n * k * 2 / (us * 1e-6) / 1e9
            print(json.dumps(dict(shape=a.shape, gemm=name, n=n, k=k, rows=a.rows, norm=norm is not None, impl=impl,
                                  us=round(us, 2), gb_s=round(gbs), of_bandwidth=round(gbs * 1e9 / bw, 3),
                                  max_abs_diff=diff,
                                  **({"config": config_for(n, k, norm is not None)} if impl == "triton" else {}))),
                  flush=True)
        if a.sweep:
            best = None
            grid = itertools.product((1, 2, 4), (1024, 2048, 4096), (4, 8, 16), (2, 3))
            for bn, bk, warps, stages in grid:
                if bk > k:
                    continue
                cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                try:
                    us = per_call(lambda x, w, norm, cfg=cfg: gemv(x, w, None, norm, cfg), xs, ws, norm, a.reps)
                except Exception as e:  # noqa: BLE001 (a configuration the compiler refuses: next)
                    print(json.dumps(dict(gemm=name, config=cfg, error=str(e).splitlines()[0][:120])), flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            us, cfg = best
            print(json.dumps(dict(shape=a.shape, gemm=name, rows=a.rows, norm=norm is not None, impl="triton_best",
                                  us=round(us, 2),
                                  of_bandwidth=round(n * k * 2 / (us * 1e-6) / bw, 3), config=cfg)), flush=True)
        del ws
        torch.cuda.empty_cache()
    # a whole step: every layer's GEMMs with its own weights, then the output layer
    all_w = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _, n, k in layer]
             for _ in range(layers)]
    out_w = torch.randn(output[1], output[2], device="cuda", dtype=torch.bfloat16) * 0.02
    step_bytes = (sum(n * k for _, n, k in layer) * layers + output[1] * output[2]) * 2
    for impl, fn in impls(a.rows).items():

        def step(fn=fn):
            for ws in all_w:
                for (name, _n, k), w in zip(layer, ws):
                    fn(x[:, :k], w, norms[k] if name in NORMED else None)
            fn(x[:, :output[2]], out_w, None)

        us = timed(step, a.reps)
        print(json.dumps(dict(shape=a.shape, gemm="step", rows=a.rows, impl=impl, ms=round(us / 1000, 3),
                              bound_ms=round(step_bytes / bw * 1000, 3),
                              of_bandwidth=round(step_bytes / (us * 1e-6) / bw, 3))), flush=True)


if __name__ == "__main__":
    main()
