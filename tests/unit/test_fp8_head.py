"""`training.fp8_head`: the output layer's three GEMMs in FP8 (`--fp8-output-layer-impl torch`), on a CPU
(`torch._scaled_mm`'s CPU kernel; the Triton cast and the CUDA GEMM: tests/gpu/test_paths.py).

Each GEMM is checked against the exact product of its dequantized FP8 operands (float64): what is left is the
GEMM's fp32 accumulation and one rounding of the output, so the tolerance is the output dtype's half ulp plus the
fp32 accumulation's bound."""

import pytest
import torch

from megatron_patch.training import fp8_head, wgrad
from megatron_patch.training.fp8_head import E4M3, E5M2, fp8_matmul, quantize
from tests.helpers import INTERPRETED, run_interpreted

pytestmark = pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no FP8 dtypes in this torch")


def _grid(dtype):
    """Every finite value of the FP8 format, sorted (no duplicates: +0 only)."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(dtype).float()
    return torch.unique(codes[torch.isfinite(codes)])


def _deq(q, inv):
    return q.double() * inv.double()


def _close(got, want, dtype, k):
    """|got - want| within half an ulp of `dtype` at |want| plus the fp32 accumulation of k products."""
    eps = torch.finfo(dtype).eps
    bound = want.abs() * eps / 2 + k * 2.0 ** -23 * want.abs().max() + 1e-30
    assert bool(((got.double() - want).abs() <= bound).all()), (got.double() - want).abs().max()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_rounds_each_scaled_value_to_the_nearest_fp8_value(dtype):
    torch.manual_seed(0)
    x = torch.randn(64, 48, dtype=torch.bfloat16) * 3
    q, inv, q_t = quantize(x, dtype)
    assert q_t is None and q.dtype == dtype and q.shape == x.shape and inv.dtype == torch.float32 and inv.dim() == 0
    # the scale in fp32 as documented: the format's largest over amax, one division; scale_inv its reciprocal
    scale = torch.tensor(torch.finfo(dtype).max) / x.float().abs().max()
    assert torch.equal(inv, scale.reciprocal())
    scaled = (x.float() * scale).double()  # the fp32 product the cast rounds
    grid = _grid(dtype).double()
    nearest = grid[(scaled.reshape(-1, 1) - grid).abs().argmin(dim=1)].reshape(x.shape)
    distance = (scaled - nearest).abs()
    # ties (two grid values equally near) may go either way (to even); elsewhere the nearest value exactly
    other = (scaled - q.double()).abs()
    assert bool((other <= distance + 1e-12).all())
    assert q.float().abs().max().item() == torch.finfo(dtype).max  # the largest |x| maps to the format's largest


def test_quantize_of_zeros_and_in_chunks():
    q, inv, _ = quantize(torch.zeros(4, 16, dtype=torch.bfloat16), E4M3)
    assert inv.item() == 1.0 and not q.float().any()
    x = torch.randn(33, 17, dtype=torch.bfloat16)
    whole = quantize(x, E5M2)
    fp8_head_chunk = fp8_head.CHUNK_ELEMENTS
    try:
        fp8_head.CHUNK_ELEMENTS = 100  # several chunks, the last one short
        chunked = quantize(x, E5M2)
    finally:
        fp8_head.CHUNK_ELEMENTS = fp8_head_chunk
    assert torch.equal(whole[0].view(torch.uint8), chunked[0].view(torch.uint8)) and torch.equal(whole[1], chunked[1])


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_kernel_layouts_equal_the_torch_path(dtype, monkeypatch):
    """The Triton cast (the GPU's, here under the interpreter) writes the torch path's bytes in x's layout and in
    the transposed one, edge tiles on both dimensions masked ([70, 131] against 64-element tiles). Values on the
    format's grid with a power-of-two scale, so no rounding happens: Triton's interpreter drops the carry of a
    rounding into the exponent (the module's note), which the GPU test checks on rounded values instead."""
    if not INTERPRETED:
        pytest.skip("run by test_the_kernel_tests_under_triton_interpreter (TRITON_INTERPRET=1)")
    grid = _grid(dtype)
    grid = grid[grid.abs() <= 448]  # 448: E4M3's largest, a power-of-two ratio to E5M2's (57344 = 448 x 128)
    x = grid[torch.randint(0, len(grid), (70, 131), generator=torch.Generator().manual_seed(0))]
    x[0, 0] = 448.0
    x = x.bfloat16()
    monkeypatch.setattr(fp8_head, "_in_kernel", lambda t: True)
    kernel = quantize(x, dtype, transpose=True), quantize(x, dtype)
    monkeypatch.setattr(fp8_head, "_in_kernel", lambda t: False)
    ref = quantize(x, dtype, transpose=True)
    assert not bool(torch.isnan(ref[0].float()).any()) and ref[0].float().abs().max().item() == torch.finfo(dtype).max
    for got in kernel:
        assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(got[1], ref[1])
    assert torch.equal(kernel[0][2].view(torch.uint8), ref[2].view(torch.uint8))


def test_the_kernel_tests_under_triton_interpreter():
    run_interpreted(__file__, "kernel_layouts")


def test_quantize_with_the_transposed_layout():
    """`transpose=True` adds q^T laid out row by row (what the backward's GEMMs take): the same bytes as q, the
    same scale, nothing else changed."""
    x = torch.randn(33, 17, dtype=torch.bfloat16) * 5
    q, inv, _ = quantize(x, E4M3)
    q2, inv2, q_t = quantize(x, E4M3, transpose=True)
    assert q_t.shape == (17, 33) and q_t.is_contiguous() and q_t.dtype == E4M3
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(inv2, inv)
    assert torch.equal(q_t.view(torch.uint8), q.view(torch.uint8).t())


def _operands(seed=0, tokens=(4, 8), hidden=64, vocab=96):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*tokens, hidden, generator=g) * 2).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).bfloat16().requires_grad_()
    grad_y = (torch.randn(*tokens, vocab, generator=g) * 1e-3).bfloat16()
    return x, w, grad_y


def test_the_three_gemms_are_the_products_of_their_fp8_operands():
    x, w, grad_y = _operands()
    y = fp8_matmul(x, w)
    assert y.shape == (4, 8, 96) and y.dtype == torch.bfloat16
    xq, x_inv, _ = quantize(x.detach().reshape(-1, 64), E4M3)
    wq, w_inv, _ = quantize(w.detach(), E4M3)
    _close(y.reshape(-1, 96), _deq(xq, x_inv) @ _deq(wq, w_inv).t(), torch.bfloat16, 64)
    y.backward(grad_y)
    gq, g_inv, _ = quantize(grad_y.reshape(-1, 96), E5M2)
    _close(x.grad.reshape(-1, 64), _deq(gq, g_inv) @ _deq(wq, w_inv), torch.bfloat16, 96)
    _close(w.grad, _deq(gq, g_inv).t() @ _deq(xq, x_inv), torch.bfloat16, 32)
    # and near the bf16 product: FP8's rounding, a few percent of the output's scale
    ref = x.detach().float() @ w.detach().float().t()
    assert (y.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_no_weight_gradient_for_a_frozen_weight():
    x, w, grad_y = _operands()
    w.requires_grad_(False)
    fp8_matmul(x, w).backward(grad_y)
    assert w.grad is None and x.grad is not None


@pytest.mark.parametrize("tied", [True, False])
def test_the_weight_gradient_goes_to_main_grad_with_megatron_core_s_dummy(tied):
    """With weight-gradient fusion: the fp32 GEMM output added to `main_grad`; autograd gets megatron-core's dummy
    (zeros for a tied weight, `zero_out_wgrad`, so the embedding's own gradient summed into it stays right) and
    `grad_added_to_main_grad` is set."""
    x, w, grad_y = _operands()
    start = torch.randn(96, 64)
    w.main_grad, w.grad_added_to_main_grad = start.clone(), False
    if tied:
        w.zero_out_wgrad = True
    fp8_matmul(x, w, fuse_main_grad=True).backward(grad_y)
    xq, x_inv, _ = quantize(x.detach().reshape(-1, 64), E4M3)
    gq, g_inv, _ = quantize(grad_y.reshape(-1, 96), E5M2)
    _close(w.main_grad - start, _deq(gq, g_inv).t() @ _deq(xq, x_inv), torch.float32, 32)
    assert w.grad_added_to_main_grad is True and w.grad.shape == (96, 64)
    # Transformer Engine's in-GEMM accumulation declines a CPU main_grad (the GPU test checks it): the torch path,
    # the same sum as the layer's backward
    direct = start.clone()
    assert not wgrad.accumulate_fp8(xq.t().contiguous(), x_inv, gq.t().contiguous(), g_inv, direct)
    assert torch.equal(direct, w.main_grad)
    if tied:
        assert not w.grad.any()
    w2 = w.detach().clone().requires_grad_()
    w2.main_grad = torch.zeros(96, 64)  # megatron-core's DDP without the flag: no gradient for autograd
    fp8_matmul(x.detach(), w2, fuse_main_grad=True).backward(grad_y)
    assert w2.grad is None and w2.main_grad.any()


def test_what_fp8_does_not_take():
    x, w, _ = _operands()
    assert fp8_head.fp8_takes(x, w)
    assert not fp8_head.fp8_takes(x[:1, :1], w)  # one token (a decode step)
    assert not fp8_head.fp8_takes(x, w[:90])  # a vocabulary not a multiple of 16
    assert not fp8_head.fp8_takes(x[..., :24], w[:, :24])


def _layer_world(rank: int, tp: int, sequence_parallel: bool, fuse: bool, hidden: int) -> list:
    """megatron-core's ColumnParallelLinear as the tied output layer (the weight handed in at each call) at
    `tp`, with `fp8_head.install`; the output and the gradients against `fp8_matmul` on this rank's shard with
    the communication done by hand. Returns the checks that failed."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests import _cpu

    _cpu.init_model_parallel(tp=tp)
    import torch.distributed as dist

    vocab, seq, batch = 64, 16, 2
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=2, use_cpu_initialization=True,
                               gradient_accumulation_fusion=False, tensor_model_parallel_size=tp,
                               sequence_parallel=sequence_parallel, params_dtype=torch.bfloat16)
    layer = ColumnParallelLinear(hidden, vocab, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                 gather_output=False, skip_weight_param_allocation=True)
    layer.gradient_accumulation_fusion = fuse
    g = torch.Generator().manual_seed(7)
    x_full = torch.randn(seq, batch, hidden, generator=g).bfloat16()
    w_full = (torch.randn(vocab, hidden, generator=g) * 0.1).bfloat16()
    grad_full = (torch.randn(seq, batch, vocab, generator=g) * 1e-2).bfloat16()
    part = vocab // tp
    w = w_full[rank * part:(rank + 1) * part].clone().requires_grad_()
    grad_y = grad_full[..., rank * part:(rank + 1) * part]
    rows = slice(rank * seq // tp, (rank + 1) * seq // tp) if sequence_parallel else slice(None)
    x = x_full[rows].clone().requires_grad_()
    if fuse:
        w.main_grad, w.grad_added_to_main_grad, w.zero_out_wgrad = torch.zeros(part, hidden), False, True
    plain_y, _ = layer(x.detach(), weight=w.detach())
    fp8_head.install(layer)
    assert fp8_head.installed(layer)
    y, _ = layer(x, weight=w)
    y.backward(grad_y)

    x_ref, w_ref = x_full.clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = fp8_matmul(x_ref, w_ref)
    y_ref.backward(grad_y)
    grad_x = x_ref.grad.clone()
    dist.all_reduce(grad_x)  # the input's gradient summed over the vocabulary shards
    failed = []
    if not torch.equal(y, y_ref):
        failed.append("output")
    if not torch.equal(x.grad, grad_x[rows]):
        failed.append("input gradient")
    got_w = w.main_grad if fuse else w.grad
    if not torch.equal(got_w, w_ref.grad.float() if fuse else w_ref.grad):
        # the fused path adds the fp32 GEMM output; the other returns it in bf16: compare in fp32 within bf16
        if not (fuse and torch.allclose(got_w, w_ref.grad.float(), rtol=2 ** -8, atol=0)):
            failed.append("weight gradient")
    if fuse and (w.grad is None or w.grad.any() or not w.grad_added_to_main_grad):
        failed.append("dummy gradient")
    if (y.float() - plain_y.float()).abs().max() > 0.1 * plain_y.float().abs().max():
        failed.append("far from megatron-core's bf16 output")
    return failed


@pytest.mark.parametrize("tp, sequence_parallel, fuse", [(1, False, False), (1, False, True), (2, False, False),
                                                         (2, True, True)])
def test_megatron_core_s_output_layer_with_the_fp8_gemms(tp, sequence_parallel, fuse):
    """The seam, built: megatron-core's output layer given the weight at run time (tied embeddings), its matrix
    multiply replaced; at TP=2 the input's gradient all-reduced (or, with sequence parallelism, the input gathered
    and its gradient reduce-scattered) as megatron-core's own linear does."""
    from tests import _cpu

    assert _cpu.run_world(tp, _layer_world, tp, sequence_parallel, fuse, 32) == [[]] * tp


def _fallback_world(rank: int) -> bool:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests import _cpu

    _cpu.init_model_parallel()
    config = TransformerConfig(num_layers=1, hidden_size=24, num_attention_heads=2, use_cpu_initialization=True,
                               gradient_accumulation_fusion=False)
    layer = ColumnParallelLinear(24, 40, config=config, init_method=torch.nn.init.normal_, bias=False)
    x = torch.randn(3, 1, 24)
    plain, _ = layer(x)
    fp8_head.install(layer)
    fp8, _ = layer(x)
    return torch.equal(plain, fp8)


def test_shapes_fp8_does_not_take_keep_megatron_core_s_path():
    from tests import _cpu

    assert _cpu.run_world(1, _fallback_world) == [True]
