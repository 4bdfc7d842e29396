"""`training.wgrad` (`--wgrad-fusion-without-apex`): main_grad += dyᵀ·x in main_grad's dtype and the embedding's
rows scattered into main_grad, against float64, and the `apex_free_wgrad_fusion` patch's seams in megatron-core's
layers (the end-to-end run: tests/e2e/test_pretrain.py::test_wgrad_fusion_without_apex_trains_like_megatrons)."""

import importlib

import pytest
import torch

from megatron_patch import patches
from megatron_patch.training.wgrad import WgradAccumulation, accumulate


def test_accumulates_in_fp32_from_bf16_inputs():
    """Two micro-batches of bf16 activations [s, b, in] and gradients [s, b, out] summed into an fp32 main_grad:
    equal to the float64 sum of the two products of the same bf16 numbers within fp32 rounding (no bf16 rounding
    of the gradient, which the unfused path adds)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 2, 24, generator=g).bfloat16() for _ in range(2)]
    dys = [torch.randn(16, 2, 40, generator=g).bfloat16() for _ in range(2)]
    main_grad = torch.full((40, 24), 0.5)
    for x, dy in zip(xs, dys):
        WgradAccumulation.wgrad_gemm_accum_fp32(x, dy, main_grad)
    truth = 0.5 + sum(dy.double().reshape(-1, 40).t() @ x.double().reshape(-1, 24) for x, dy in zip(xs, dys))
    assert main_grad.dtype == torch.float32
    assert (main_grad.double() - truth).abs().max().item() <= 1e-5 * truth.abs().max().item()
    half = torch.zeros(40, 24, dtype=torch.bfloat16)  # a half-precision main_grad accumulates in its own dtype
    WgradAccumulation.wgrad_gemm_accum_fp16(xs[0], dys[0], half)
    assert half.dtype == torch.bfloat16 and torch.allclose(half.double(), truth - 0.5 - (
        dys[1].double().reshape(-1, 40).t() @ xs[1].double().reshape(-1, 24)), rtol=2e-2, atol=2e-2)


def test_a_main_grad_of_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"main_grad \(24, 40\) is not \[40, 24\]"):
        accumulate(torch.zeros(8, 24), torch.zeros(8, 40), torch.zeros(24, 40))


def test_the_patch_stands_in_for_apex_and_reverts():
    """Applied: megatron-core's linear layers see the fusion available and call ours by Apex's module name, and
    `import fused_weight_gradient_mlp_cuda` (core/utils.py's deferred embedding wgrad) finds it; reverted: as
    before."""
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None:
        pytest.skip("Apex is installed: megatron-core uses it itself")
    from megatron.core.tensor_parallel import layers

    assert layers._grad_accum_fusion_available is False
    with patches.applied("apex_free_wgrad_fusion") as active:
        assert active and layers._grad_accum_fusion_available is True
        module = importlib.import_module("fused_weight_gradient_mlp_cuda")
        assert layers.fused_weight_gradient_mlp_cuda is module
        assert module.wgrad_gemm_accum_fp32 is WgradAccumulation.wgrad_gemm_accum_fp32
        from megatron_patch.training.model import _apex_wgrad_available
        from megatron_patch.training.wgrad import FUNCTIONAL

        assert _apex_wgrad_available()  # so the model's config keeps gradient_accumulation_fusion
        assert layers.F is FUNCTIONAL  # VocabParallelEmbedding's lookup
    assert layers._grad_accum_fusion_available is False and not hasattr(layers, "fused_weight_gradient_mlp_cuda")
    assert layers.F is torch.nn.functional
    with pytest.raises(ImportError):
        importlib.import_module("fused_weight_gradient_mlp_cuda")


def _ddp_param(weight: torch.Tensor) -> torch.nn.Parameter:
    """A parameter as megatron-core's DDP leaves it: an fp32 main_grad and the flag its hook reads."""
    p = torch.nn.Parameter(weight)
    p.main_grad = torch.full(weight.shape, 0.25, dtype=torch.float32)
    p.grad_added_to_main_grad = False
    return p


def test_the_embedding_scatters_its_gradient_into_main_grad():
    """Repeated ids summed: main_grad = 0.25 + the float64 sum of each id's gradient rows (fp32 rounding), the
    rows of ids not in the batch untouched; autograd gets a dummy gradient and the flag that makes megatron-core's
    hook skip its add; the lookup itself is F.embedding's."""
    from megatron_patch.training.wgrad import FUNCTIONAL

    g = torch.Generator().manual_seed(1)
    weight = _ddp_param(torch.randn(50, 16, generator=g).bfloat16())
    ids = torch.tensor([[3, 7, 3, 49], [0, 3, 7, 7]])
    out = FUNCTIONAL.embedding(ids, weight)
    assert torch.equal(out, torch.nn.functional.embedding(ids, weight.detach()))
    grad = torch.randn(2, 4, 16, generator=g).bfloat16()
    out.backward(grad)
    truth = torch.full((50, 16), 0.25, dtype=torch.float64)
    truth.index_add_(0, ids.reshape(-1), grad.double().reshape(-1, 16))
    assert weight.grad_added_to_main_grad is True and weight.grad is not None  # the dummy: the hook still runs
    assert (weight.main_grad.double() - truth).abs().max().item() <= 1e-6
    assert torch.equal(weight.main_grad[1], torch.full((16,), 0.25))  # an id not in the batch


def test_the_embedding_without_ddp_is_torchs():
    """No main_grad (no DDP), a zeroed dummy asked for, or no gradient: the ordinary F.embedding, its gradient in
    .grad."""
    from megatron_patch.training.wgrad import FUNCTIONAL

    ids = torch.tensor([1, 2, 1])
    plain = torch.nn.Parameter(torch.randn(4, 3))
    FUNCTIONAL.embedding(ids, plain).sum().backward()
    assert torch.equal(plain.grad, torch.tensor([[0.0] * 3, [2.0] * 3, [1.0] * 3, [0.0] * 3]))
    zeroed = _ddp_param(torch.randn(4, 3))
    zeroed.zero_out_wgrad = True
    FUNCTIONAL.embedding(ids, zeroed).sum().backward()
    assert zeroed.grad_added_to_main_grad is False and torch.equal(zeroed.main_grad, torch.full((4, 3), 0.25))
    assert FUNCTIONAL.softmax is torch.nn.functional.softmax  # the rest of torch.nn.functional, as it is
