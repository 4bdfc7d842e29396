"""`--lean-cross-entropy` (`megatron_patch.training.cross_entropy`, the `lean_cross_entropy` patch; issue 28): the
language-model loss and its gradient against float64 truth and megatron-core's own cross-entropy, at TP=1 and with
the vocabulary split over two ranks, in fp32 and bf16, through the torch path (row chunks) and the Triton kernels
(under Triton's interpreter); what each keeps for the backward; the patch's seam."""

import pytest
import torch

from megatron_patch import patches
from megatron_patch.training import cross_entropy as ce
from tests import _cpu
from tests.helpers import INTERPRETED, run_interpreted

S, B, V = 6, 3, 1000  # V: not a multiple of the kernels' block, odd halves per rank (500) on purpose


def _inputs(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(S, B, V, generator=g) * 4).to(dtype)  # a spread like a trained model's
    target = torch.randint(0, V, (S, B), generator=g)
    upstream = torch.rand(S, B, generator=g)  # the loss mask's weights reach the loss's gradient like this
    return logits, target, upstream


def _truth(logits: torch.Tensor, target: torch.Tensor, upstream: torch.Tensor):
    """Loss [s, b] and d(Σ upstream · loss)/d logits, in float64, from the same (rounded) logits."""
    x = logits.double().requires_grad_()
    loss = torch.nn.functional.cross_entropy(x.view(-1, V), target.view(-1), reduction="none").view(S, B)
    (loss * upstream.double()).sum().backward()
    return loss.detach(), x.grad


def _ours(logits, target, upstream, group=None, part=slice(None)):
    x = logits[..., part].clone().requires_grad_()
    loss = ce.lean_vocab_parallel_cross_entropy(x, target, group)
    (loss * upstream).sum().backward()
    return loss.detach(), x.grad


def test_lean_cross_entropy_equals_float64_truth_through_row_chunks(monkeypatch):
    """fp32: loss and gradient within fp32 rounding of float64 (a 1000-entry sum: a few ulps); bf16 logits: the
    loss as exact (fp32 inside), the gradient rounded once to bf16 (half a bf16 ulp, 2^-9 relative). Chunks of 4
    rows, so that the 18 rows take 5 chunks, the last one short."""
    monkeypatch.setattr(ce, "CHUNK_ROWS", 4)
    for dtype, grad_tol in ((torch.float32, 1e-6), (torch.bfloat16, 2 ** -8)):
        logits, target, upstream = _inputs(dtype)
        loss, grad = _ours(logits, target, upstream)
        ref_loss, ref_grad = _truth(logits, target, upstream)
        assert loss.dtype == torch.float32 and grad.dtype == dtype
        assert torch.allclose(loss.double(), ref_loss, rtol=1e-6, atol=1e-6), (loss.double() - ref_loss).abs().max()
        err = (grad.double() - ref_grad).abs()
        assert (err <= grad_tol * ref_grad.abs() + 1e-12).all(), (dtype, err.max())


def test_lean_cross_entropy_keeps_the_logits_not_an_fp32_copy():
    """What the backward keeps: megatron-core's fused cross-entropy an fp32 [s, b, V] softmax (4 bytes an entry,
    twice the bf16 logits; its unfused one the same); ours the logits tensor itself (no new storage), two fp32
    numbers and the target a row."""
    from megatron.core.fusions.fused_cross_entropy import _VocabParallelCrossEntropy

    logits, target, _ = _inputs(torch.bfloat16)
    x = logits.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ce.lean_vocab_parallel_cross_entropy(x, target)
    new = [t for t in saved if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()]
    assert any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in saved)
    assert sum(t.numel() * t.element_size() for t in new) == S * B * (2 * 4 + 8)  # maximum, sum (fp32), target (int64)

    saved.clear()

    class _One:  # megatron-core's function all-reduces over its group: one rank, nothing to reduce
        def rank(self):
            return 0

        def size(self):
            return 1

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
        _VocabParallelCrossEntropy.apply(logits.clone().requires_grad_(), target, _One())
    assert max(t.numel() * t.element_size() for t in saved) == S * B * V * 4


def _split_vocab(rank: int) -> dict:
    """Each of two ranks holds half of the vocabulary: our loss over the world group equals float64 truth; each
    rank's gradient is the truth's slice; megatron-core's fused function over the same group agrees within the
    same rounding."""
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    group = torch.distributed.group.WORLD
    part = slice(rank * V // 2, (rank + 1) * V // 2)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits, target, upstream = _inputs(dtype, seed=1)
        ref_loss, ref_grad = _truth(logits, target, upstream)
        loss, grad = _ours(logits, target, upstream, group, part)
        fused = fused_vocab_parallel_cross_entropy(logits[..., part].clone(), target, group)
        out[str(dtype)] = {"loss": (loss.double() - ref_loss).abs().max().item(),
                           "grad": ((grad.double() - ref_grad[..., part]).abs()
                                    / (ref_grad[..., part].abs() + 1e-12)).max().item(),
                           "fused_loss": (fused.double() - ref_loss).abs().max().item()}
    return out


def test_lean_cross_entropy_over_a_split_vocabulary():
    for rank in _cpu.run_world(2, _split_vocab):
        f32, bf16 = rank[str(torch.float32)], rank[str(torch.bfloat16)]
        assert f32["loss"] <= 2e-6 and f32["grad"] <= 1e-5, f32
        assert bf16["loss"] <= 2e-6 and bf16["grad"] <= 2 ** -8, bf16
        for r in (f32, bf16):  # megatron-core's, for scale: the same rounding
            assert r["fused_loss"] <= 2e-6, r


def test_the_patch_binds_megatron_cores_fused_call_and_undoes_it():
    from megatron.core.models.common.language_module import language_module

    original = language_module.fused_vocab_parallel_cross_entropy
    with patches.applied("lean_cross_entropy") as active:
        assert active
        assert language_module.fused_vocab_parallel_cross_entropy is ce.lean_vocab_parallel_cross_entropy
    assert language_module.fused_vocab_parallel_cross_entropy is original


def test_the_kernel_tests_under_triton_interpreter():
    run_interpreted(__file__, "kernels_")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_the_torch_path(dtype, monkeypatch):
    """The Triton kernels (the GPU's source, here under the interpreter) against the torch path on the same rows:
    statistics within fp32 rounding (the kernel's running maximum rescales its sum block by block), gradients
    within one rounding of the logits' dtype and what the sums' rounding moves; a vocabulary slice (start 300,
    targets outside it too)."""
    if not INTERPRETED:
        pytest.skip("run by test_the_kernel_tests_under_triton_interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setattr(ce, "BLOCK", 256)  # four blocks a row, the last one partial
    logits, target, upstream = _inputs(dtype)
    x, t, scale = logits.view(-1, V), target.view(-1), upstream.view(-1)
    assert ce._in_kernels(x)
    stats = ce.local_statistics(x, t, 300)
    grad = ce.softmax_gradient(x, t, 300, stats[0], stats[1], scale)
    with monkeypatch.context() as m:
        m.setattr(ce, "_in_kernels", lambda x: False)
        ref_stats = ce.local_statistics(x, t, 300)
        ref_grad = ce.softmax_gradient(x, t, 300, ref_stats[0], ref_stats[1], scale)
    assert torch.equal(stats[0], ref_stats[0]) and torch.equal(stats[2], ref_stats[2])
    assert torch.allclose(stats[1], ref_stats[1], rtol=1e-6)
    assert ((t >= 300) & (t < 300 + V)).any() and (stats[2] == 0).any()
    ulp = 2 ** -23 if dtype == torch.float32 else 2 ** -7
    err = (grad.double() - ref_grad.double()).abs()
    # the sums' relative difference (≤ 1e-6) reaches every softmax entry, the target's (p − 1) too: ≤ 2e-6 · scale
    assert (err <= 2 * ulp * ref_grad.double().abs() + 2e-6 * scale.double()[:, None]).all(), err.max()
    loss_kernels = ce.lean_vocab_parallel_cross_entropy(logits, target)
    ref_loss, _ = _truth(logits, target, upstream)
    assert torch.allclose(loss_kernels.double(), ref_loss, rtol=1e-6, atol=1e-6)
