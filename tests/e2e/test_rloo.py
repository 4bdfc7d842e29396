"""RLOO, the third online-RL algorithm on the shared loop (`megatron_patch.rlhf.loop`): its leave-one-out
advantages by hand, the advantages the trainer computes from a batch, and a run through the command line that
trains, exports and resumes exactly."""

import json
import types

import pytest
import torch


def test_leave_one_out_by_hand():
    from megatron_patch.rlhf.rloo import leave_one_out

    rewards = torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0])  # two groups of three
    want = torch.tensor([1 - 4.0, 2 - 3.5, 6 - 1.5, 0 - 1.5, 0 - 1.5, 3 - 0.0])
    assert torch.equal(leave_one_out(rewards, 3), want)
    assert torch.allclose(leave_one_out(rewards, 3).view(2, 3).sum(1), torch.zeros(2))  # a group's sum to zero


def test_advantages_fold_the_kl_into_each_completions_reward():
    """reward_i = score_i - kl_coef * sum_t (log p - log p_ref) over its completion tokens; advantage_i =
    reward_i - the mean of the other rewards of its group. GRPO's advantages on the same batch normalise the
    scores by the group's spread and ignore the KL (it is in GRPO's loss)."""
    from megatron_patch.rlhf.grpo import GRPO
    from megatron_patch.rlhf.loop import Batch
    from megatron_patch.rlhf.rloo import RLOO

    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.float32)
    old = torch.tensor([[9.0, -1.0, -2.0, 9.0], [9.0, -0.5, 9.0, 9.0], [9.0, -1.0, -1.0, -1.0],
                        [9.0, 9.0, -3.0, -0.25]])
    ref = old - torch.tensor([[0.0, 0.5, 0.25, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0],
                              [0.0, 0.0, 0.5, 0.5]])
    rollouts = types.SimpleNamespace(mask=mask)
    scores = torch.tensor([1.0, 0.0, 2.0, 4.0])
    batch = Batch(0, [0, 0, 1, 1], rollouts, old, ref, scores)
    args = types.SimpleNamespace(kl_coef=0.5, group_size=2)
    rloo = RLOO(types.SimpleNamespace(args=args))
    kl = torch.tensor([0.75, 1.0, 2.0, 1.0])
    rewards = scores - 0.5 * kl  # 0.625, -0.5, 1.0, 3.5
    want = torch.tensor([rewards[0] - rewards[1], rewards[1] - rewards[0], rewards[2] - rewards[3],
                         rewards[3] - rewards[2]])
    assert torch.allclose(rloo.advantages(batch), want, atol=1e-6)
    assert rloo.loss_kl_coef() == 0.0
    grpo = GRPO(types.SimpleNamespace(args=args))
    assert torch.allclose(grpo.advantages(batch), torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-3)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["The module", "A list of values"]))
    return str(path)


def _rloo(tiny_lm, prompts, *extra):
    from megatron_patch.rlhf.rloo import main

    return main(["--hf-dir", tiny_lm, "--prompts", prompts, "--reward", "tests.e2e.test_grpo:constant_reward",
                 "--prompts-per-step", "2", "--group-size", "3", "--max-new-tokens", "4", "--lr", "3e-3", *extra])


def test_trains_exports_and_resumes_exactly(cpu_megatron, tiny_lm, prompts, tmp_path, capsys):
    from megatron_patch.conversion.hf_io import read_all

    straight, resumed, ckpt = (str(tmp_path / n) for n in ("straight", "resumed", "ckpt"))
    assert _rloo(tiny_lm, prompts, "--steps", "3", "--out", straight) == 0
    out = capsys.readouterr()
    whole = json.loads(out.out.strip().splitlines()[-1])
    rows = [json.loads(line) for line in out.err.splitlines() if line.startswith('{"step"')]
    assert [r["step"] for r in rows] == [1, 2, 3] and whole["steps"] == 3
    # the leave-one-out advantages of a group sum to zero, and at the first epoch the policy is the sampler
    # (ratio 1): the clipped loss averages the advantages, so it is zero to rounding
    assert abs(rows[0]["loss"]) <= 1e-5 and rows[0]["kl"] == 0.0
    trained = read_all(straight)
    assert any(not torch.equal(trained[k], v) for k, v in read_all(tiny_lm).items())
    assert _rloo(tiny_lm, prompts, "--steps", "2", "--save", ckpt) == 0
    capsys.readouterr()
    assert _rloo(tiny_lm, prompts, "--steps", "3", "--load", ckpt, "--save", ckpt, "--out", resumed) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["resumed_at"] == 2 and again["history"] == whole["history"]
    y = read_all(resumed)
    assert trained.keys() == y.keys() and all(torch.equal(trained[k], y[k]) for k in trained)


def test_help_runs_and_names_the_algorithm(capsys):
    from megatron_patch.rlhf.rloo import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "Leave-One-Out" in capsys.readouterr().out
