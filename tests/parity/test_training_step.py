"""Training through the modules megatron-core lacks (ALiBi, embedding LayerNorm, post-sublayer norms,
NormHead, parallel attention + MLP), on CPU: forward + backward reach every parameter, and a few optimizer steps
on one batch lower the loss. TP=PP=1; the TP-split forward is covered by tests/distributed."""

import pytest
import torch

from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
from megatron_patch.models import Layout, build_model
from tests.models import case


@pytest.mark.parametrize("variant", ["bloom", "glm4", "baichuan2_13b", "starcoder", "mistral_swa", "falcon_7b",
                                     "falcon_40b"])
def test_few_steps_forward_backward(cpu_megatron, variant):
    from megatron_patch.runtime.logits import causal_mask

    c = case(variant)
    ranks = hf_to_megatron(make_plan(c.cfg, Layout()), c.sd.__getitem__, c.sd.keys())
    model = build_model(c.cfg)
    load_rank_state_dict(model, ranks[(0, 0, 0)])
    model.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (2, 33), generator=g)
    tokens, labels = ids[:, :-1], ids[:, 1:]
    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = model(tokens, pos, causal_mask(tokens.shape[1]), labels=labels).float().mean()
        loss.backward()
        if not losses:
            no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
            assert not no_grad, f"parameters without gradient: {no_grad}"
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


def test_te_wgrad_fusion_without_apex():
    """Megatron's --gradient-accumulation-fusion (its default) stays on for TE-style layers (anything with
    `fuse_wgrad_accumulation`) and off for megatron's own linear layers when Apex is missing."""
    import torch.nn as nn

    from megatron_patch.training.model import _apex_wgrad_available, fuse_te_wgrad

    class TELike(nn.Linear):
        fuse_wgrad_accumulation = False

    model = nn.Sequential(TELike(2, 2), nn.Linear(2, 2), nn.Sequential(TELike(2, 2)))
    assert fuse_te_wgrad(model, wanted=False) == 0 and not model[0].fuse_wgrad_accumulation
    assert fuse_te_wgrad(model, wanted=True) == 2
    assert model[0].fuse_wgrad_accumulation and model[2][0].fuse_wgrad_accumulation
    assert not hasattr(model[1], "fuse_wgrad_accumulation")
    assert _apex_wgrad_available() is False  # this CPU environment has no Apex: megatron's layers fuse nothing
