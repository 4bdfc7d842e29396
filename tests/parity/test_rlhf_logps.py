"""The RLHF log-probabilities (`logprobs.token_logps`: old and reference log-probs of GRPO / PPO, and through
`logps_of` their losses) are the HF model's: log_softmax over the model's vocabulary, not over megatron's padded
one (1000 tokens padded to 1024 here: the 24 padding columns are zero rows, logit 0, and took a share of the
softmax: on CPU a random model's log-probs were off by ~2e-2, on an H200 a trained one's by 6e-3). At TP = 1 and
at TP = 2 (the second rank's slice holds the padding), CPU fp32, <= 1e-5."""

import torch

from tests import _cpu
from tests.models import case


def _reference(c, tokens, labels):
    with torch.no_grad():
        return torch.log_softmax(c.ref(tokens).logits.float(), -1).gather(2, labels[..., None])[..., 0]


def _inputs(c):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, c.vocab_size, (3, 20), generator=g)
    labels = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)
    return tokens, labels


def _ours(rank: int, variant: str, tp: int) -> torch.Tensor:
    from megatron_patch.conversion.engine import hf_to_megatron, load_rank_state_dict, make_plan
    from megatron_patch.models import Layout, build_model
    from megatron_patch.rlhf.logprobs import token_logps
    from megatron_patch.runtime.parallel import current_rank

    if tp > 1:
        _cpu.init_model_parallel(tp, 1)
    c = case(variant)
    me = current_rank()
    state = hf_to_megatron(make_plan(c.cfg, Layout(tp, 1)), c.sd.__getitem__, c.sd.keys(), tp_ranks=[me[0]])[me]
    model = build_model(c.cfg, layout=Layout(tp)).eval()
    load_rank_state_dict(model, state)
    assert model.vocab_size > c.vocab_size  # padded: the case this test is about
    return token_logps(model, *_inputs(c), c.vocab_size)


def test_token_logps_equal_transformers_at_tp1(cpu_megatron):
    c = case("gqa")
    ours, ref = _ours(0, "gqa", 1), _reference(c, *_inputs(c))
    assert (ours - ref).abs().max().item() <= 1e-5


def test_token_logps_equal_transformers_at_tp2():
    c = case("gqa")
    ref = _reference(c, *_inputs(c))
    for ours in _cpu.run_world(2, _ours, "gqa", 2):
        assert (ours - ref).abs().max().item() <= 1e-5
