"""The decode GEMV kernel (`megatron_patch.inference.gemv`, issue 27) on a CPU through Triton's interpreter: the
arithmetic of the kernel the GPU runs (the same source), against float64 references of the same bf16 inputs."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_patch.inference import dynamic
from megatron_patch.inference import gemv as gemv_mod

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Triton reads TRITON_INTERPRET when it is imported: the kernel tests run in a process that set it first
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def test_the_kernel_tests_under_triton_interpreter():
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is that process")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "gemv_",
                        os.path.abspath(__file__)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and "skipped" not in p.stdout.splitlines()[-1], p.stdout[-500:]


@pytest.fixture
def interpreted():
    if not INTERPRETED:
        pytest.skip("run by test_the_kernel_tests_under_triton_interpreter (TRITON_INTERPRET=1)")
    return gemv_mod.gemv


def _bound(h: torch.Tensor, w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per output: one bf16 step of the result (Triton's interpreter converts fp32 to bf16 by truncation, the GPU
    rounds to nearest: half a step there) plus fp32 summation error, K * 2^-24 * sum|h w|."""
    k = w.shape[1]
    return ref.abs() * 2.0 ** -7 + k * 2.0 ** -24 * (h.abs() @ w.abs().T) + 1e-30


@pytest.mark.parametrize("m, n, k, block_k", [(1, 40, 96, 32), (3, 17, 130, 64), (2, 64, 2048, 1024), (1, 5, 1000, 256)])
def test_gemv_equals_float64_with_bias(interpreted, m, n, k, block_k):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, 1, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    cfg = dict(BLOCK_N=4, BLOCK_K=block_k, num_warps=4, num_stages=2)
    y = interpreted(x, w, b, config=cfg)
    assert y.shape == (m, 1, n) and y.dtype == torch.bfloat16
    ref = x.double().reshape(m, k) @ w.double().T + b.double()
    assert ((y.double().reshape(m, n) - ref).abs() <= _bound(x.double().reshape(m, k), w.double(), ref)).all()


@pytest.mark.parametrize("kind, zero_centered", [("RMSNorm", False), ("RMSNorm", True), ("LayerNorm", False)])
def test_gemv_folds_the_norm_in(interpreted, kind, zero_centered):
    """The norm in fp32 over K, its output rounded to bf16 (what TE's norm kernel hands the GEMM), then the GEMV:
    equal to float64 arithmetic on that bf16 input within one rounding of the result and fp32 sums (the bf16
    input itself may differ by one rounding where fp32 statistics land on a tie: counted as such)."""
    m, n, k = 2, 24, 768
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(m, k, generator=g) * 3 + 0.5).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    gamma = (torch.randn(k, generator=g) * 0.1 + (0 if zero_centered else 1)).to(torch.bfloat16)
    beta = torch.randn(k, generator=g).to(torch.bfloat16) if kind == "LayerNorm" else None
    eps = 1e-5
    norm = gemv_mod.Norm(kind, gamma, beta, eps, zero_centered)
    y = interpreted(x, w, None, norm)
    xf = x.double()
    if kind == "LayerNorm":
        xf = xf - xf.mean(-1, keepdim=True)
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (gamma.double() + (1 if zero_centered else 0))
    if beta is not None:
        h = h + beta.double()
    h = h.to(torch.bfloat16).double()
    ref = h @ w.double().T
    # one bf16 rounding of an input element may differ: |w| * bf16 step of |h| per element, at most a few
    slack = 4 * (w.double().abs().max() * h.abs().max() * 2.0 ** -7)
    assert ((y.double() - ref).abs() <= _bound(h, w.double(), ref) + slack).all()


def test_gemv_refuses_what_it_does_not_serve(interpreted):
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="features"):
        interpreted(torch.zeros(1, 15, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="rows"):
        interpreted(torch.zeros(gemv_mod.MAX_ROWS + 1, 16, dtype=torch.bfloat16), w)


def test_decode_gemv_needs_a_gpu(monkeypatch):
    """On a CPU the patch does not apply and engines are planned without it; the plan tells engines apart by it
    (their CUDA graphs hold its kernels)."""
    from megatron_patch import patches

    assert not patches.apply("decode_gemv")
    monkeypatch.setattr(dynamic, "DECODE_GEMV", True)
    assert dynamic.decode_gemv() is False
    plan = dynamic.EnginePlan(1, False, 64, 64, 0.1, True, True, False, False)
    assert plan.covers(plan) and not plan.covers(dynamic.EnginePlan(1, False, 64, 64, 0.1, True, True, False, True))
