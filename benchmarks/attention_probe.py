"""Training attention alone, per Transformer Engine backend: is it right, and how fast, at the shape a
training step calls it (issue 28). `train_bench.py`'s `+flash-attn` rows (TE's FlashAttention backend, which runs
FlashAttention-4 on Hopper when it is installed) measured 19% more tokens/s than cuDNN's fused attention, with
losses that part from the reference's by 8 in 20 iterations; this probe says which of forward and backward is
wrong, and what each backend's forward and backward cost.

    python benchmarks/attention_probe.py [--seq 8192] [--heads 32] [--kv-heads 8] [--dim 128] [--batch 1]
        [--backends fused flash [flash-te]] [--iters 20]

Each backend runs in its own process (Transformer Engine picks a backend once per configuration; the
NVTE_FUSED_ATTN / NVTE_FLASH_ATTN variables choose it, as megatron-core's `--attention-backend` does), on the same
bf16 q, k, v and output gradient (seed 0) in megatron-core's layout (sbhd, causal, grouped queries), through
`transformer_engine.pytorch.DotProductAttention`, with the library's patches to TE's calls applied as building a
model applies them (`te_fa4_causal_window`: TE's causal window in FA4's sentinel); `flash-te` is the flash backend
as Transformer Engine calls it, without that patch (with FA4 4.0.0b36 its causal output is all zeros: TE issue
#3528, the cause of the `+flash-attn` loss difference). One JSON row per backend, printed as measured: the backend TE
ran (`te_backend`), forward and forward + backward milliseconds (median of --iters, CUDA events), and for the
output and the three input gradients their distance to a float64 reference of the same inputs: the largest
absolute difference and the relative L2 error ||x - ref|| / ||ref||, beside `bf16_rounding`, the relative L2 error
of the reference itself rounded to bf16 (what a correct bf16 kernel cannot beat). `ok`: every relative error
within `TOLERANCE` (bf16 attention kernels land near 0.3-1%; a wrong mask or gradient lands near 100%).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

TOLERANCE = 0.02  # relative L2 error of a bf16 attention output / gradient against float64
BACKENDS = {"fused": {"NVTE_FUSED_ATTN": "1", "NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
            "flash": {"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"},
            "unfused": {"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "1"}}
BACKENDS["flash-te"] = BACKENDS["flash"]  # the same backend, TE's call without te_fa4_causal_window


def inputs(seq: int, batch: int, heads: int, kv_heads: int, dim: int, device: str):
    """q [s, b, heads, d], k and v [s, b, kv heads, d], the output gradient: bf16, seed 0."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)

    def rand(h):
        return torch.randn(seq, batch, h, dim, generator=g, device=device).to(torch.bfloat16)

    return rand(heads), rand(kv_heads), rand(kv_heads), rand(heads)


def reference(q, k, v, grad_out, scale: float):
    """Causal grouped-query attention and its input gradients in float64, one KV head's group at a time (the
    score matrices of all heads at 8k would not fit): (out, dq, dk, dv) in the inputs' layouts."""
    import torch

    group = q.shape[2] // k.shape[2]
    s = q.shape[0]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    outs, dqs, dks, dvs = [], [], [], []
    for h in range(k.shape[2]):
        qh = q[:, :, h * group:(h + 1) * group].double().requires_grad_()
        kh, vh = k[:, :, h:h + 1].double().requires_grad_(), v[:, :, h:h + 1].double().requires_grad_()
        scores = torch.einsum("sbhd,tbxd->bhst", qh, kh) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out = torch.einsum("bhst,tbxd->sbhd", probs, vh)
        dq, dk, dv = torch.autograd.grad(out, (qh, kh, vh), grad_out[:, :, h * group:(h + 1) * group].double())
        outs.append(out.detach())
        dqs.append(dq)
        dks.append(dk)
        dvs.append(dv)
        del scores, probs, out
    return torch.cat(outs, 2), torch.cat(dqs, 2), torch.cat(dks, 2), torch.cat(dvs, 2)


def distance(x, ref) -> dict:
    """Largest absolute difference and relative L2 error of x against the float64 reference, and the relative L2
    error of the reference rounded to bf16."""
    import torch

    norm, diff = ref.norm().item() or 1.0, x.double() - ref
    return {"max_abs_diff": float(f"{diff.abs().max().item():.4g}"),
            "rel_l2": float(f"{diff.norm().item() / norm:.4g}"),
            "bf16_rounding": float(f"{(ref.to(torch.bfloat16).double() - ref).norm().item() / norm:.4g}")}


def worker(a) -> dict:
    """One backend in this process (its environment chose it): timings and distances."""
    import torch
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa_module

    from megatron_patch import patches

    patched = a.worker != "flash-te" and patches.apply("te_fa4_causal_window")
    q, k, v, grad_out = inputs(a.seq, a.batch, a.heads, a.kv_heads, a.dim, "cuda")
    attention = te.DotProductAttention(a.heads, a.dim, num_gqa_groups=a.kv_heads, attn_mask_type="causal",
                                       qkv_format="sbhd")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves)
    out.backward(grad_out.reshape(out.shape))
    got = (out.detach(), *(t.grad.clone() for t in leaves))  # before the timed calls accumulate more
    row = {"backend": a.worker, "te_fa4_causal_window": patched,
           "te_backend": {key: str(val) for key, val in dpa_module._attention_backends.items()
                          if key.startswith(("use_", "flash_", "fused_"))}}

    def timed(fn) -> float:
        times = []
        for _ in range(a.iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    with torch.no_grad():
        row["forward_ms"] = round(timed(lambda: attention(q, k, v)), 3)
    row["forward_backward_ms"] = round(timed(lambda: attention(*leaves).backward(grad_out.reshape(out.shape))), 3)
    ref = reference(q, k, v, grad_out, a.dim ** -0.5)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        x = x.reshape(r.shape)
        row[name] = distance(x, r)
    row["ok"] = all(row[name]["rel_l2"] <= TOLERANCE for name in ("out", "dq", "dk", "dv"))
    return row


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--backends", nargs="+", default=["fused", "flash"], choices=sorted(BACKENDS))
    ap.add_argument("--iters", type=int, default=20, help="timed calls per measurement (median)")
    ap.add_argument("--worker", choices=sorted(BACKENDS), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.heads % a.kv_heads or min(a.seq, a.batch, a.heads, a.kv_heads, a.dim, a.iters) < 1:
        ap.error("--heads must be a multiple of --kv-heads, every size >= 1")
    return a


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)), flush=True)
        return []
    import torch

    if not torch.cuda.is_available():
        print("error: attention_probe.py needs a GPU and Transformer Engine", file=sys.stderr)
        sys.exit(1)
    rows = []
    args = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in ("seq", "batch", "heads", "kv_heads", "dim", "iters")]
    for name in a.backends:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--worker", name],
                           env={**os.environ, **BACKENDS[name]}, capture_output=True, text=True)
        lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
        row = json.loads(lines[-1]) if p.returncode == 0 and lines else {
            "backend": name, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
