"""PPO and GRPO under pipeline parallelism on CPU (gloo processes): the four PPO models (actor, reference,
reward-model-shaped critic, rule reward) and GRPO's policy run through megatron-core's pipeline schedule
(`megatron_patch.models.pipeline`). Over two steps, the second on the updated weights:

- PP=2 and TP=2 x PP=2 give PP=1's rollouts token for token and its metrics (<= 1e-4 relative): the forward
  passes, the gradients through both stages, the tied embedding's gradient shared by the first and last
  stage (a tied LLaMA), and the gradient-norm clip over all model-parallel ranks;
- a PPO checkpoint saved at PP=2 resumes exactly at PP=2, its per-rank files named by TP and PP rank, and
  the HF export gathered from both stages equals PP=1's export.

All layouts sample on the dynamic inference engine (the one that runs PP > 1), so rollouts are comparable."""

import json
import os

import pytest
import torch

from tests import _cpu
from tests.helpers import ppo_steps, tiny_lm_folder

PROMPTS = ["The module", "A list of", "When the function", "def f(x):"]


def toy_reward(prompt: str, completion: str) -> float:
    """More completion characters outside the letters 'e' and 't' score higher (any fixed rule will do)."""
    return float(sum(c not in "et" for c in completion)) / 8


@pytest.fixture(scope="module", params=["gqa", "tied"])
def start(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"rlhf_pp_{request.param}")
    tiny_lm_folder(str(root / "hf"), request.param)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


def _ppo_argv(start, *extra) -> list[str]:
    return ["--hf-dir", str(start / "hf"), "--prompts", str(start / "prompts.jsonl"), "--reward",
            "tests.distributed.test_rlhf_pipeline:toy_reward", "--max-new-tokens", "8", "--seed", "7",
            "--engine", "dynamic", "--prompts-per-step", "4", "--epochs", "2", "--mini-batches", "2", "--lr", "3e-3",
            "--critic-lr", "3e-3", *extra]


def _same(one, other) -> None:
    for (row1, tokens1), (row2, tokens2) in zip(one, other, strict=True):
        assert tokens1 == tokens2  # the same rollouts, token for token (step 2: after an update)
        for k, v in row1.items():
            assert abs(row2[k] - v) <= 1e-4 * max(1.0, abs(v)), (k, row1, row2)


def _close_weights(x: dict, y: dict) -> None:
    """Two exports of the same training in different layouts: equal up to the summation order. Adam moves a
    weight whose gradient is about zero by up to lr in the sign of that near-zero gradient, so a rare entry
    may differ by a fraction of one step (lr 3e-3); every tensor's mean difference stays at rounding level."""
    assert x.keys() == y.keys()
    for k in x:
        diff = (x[k].float() - y[k].float()).abs()
        assert diff.max().item() <= 1e-3 and diff.mean().item() <= 1e-7, (k, diff.max().item(), diff.mean().item())


@pytest.mark.parametrize("tp,pp,reward", [(1, 2, "rule"), (2, 2, "rule"), (1, 2, "model")])
def test_ppo_pipeline_equals_one_stage(cpu_megatron, start, tmp_path, tp, pp, reward):
    """reward "model": a reward model (and the critic started from it) run through the pipeline too."""
    argv = _ppo_argv(start)
    if reward == "model":
        rm = tiny_lm_folder(str(tmp_path / "rm"), reward=True, seed=1)
        argv[argv.index("--reward"):argv.index("--reward") + 2] = ["--reward-model", rm]
    one = ppo_steps(0, argv)
    assert one[1][0]["kl"] > 0 and one[1][0]["clip_frac"] > 0  # the second step ran on an updated policy
    for rank in _cpu.run_world(tp * pp, ppo_steps, argv + ["--tp", str(tp), "--pp", str(pp)]):
        _same(one, rank)


def _ppo_main(rank: int, argv: list[str]) -> list[str]:
    """Run PPO; the files of the checkpoint's step 2."""
    from megatron_patch.rlhf.ppo import main

    assert main(argv) == 0
    return sorted(os.listdir(os.path.join(argv[argv.index("--save") + 1], "step_000002")))


def test_ppo_pipeline_resume_and_export(cpu_megatron, start, tmp_path, capsys):
    from megatron_patch.conversion.hf_io import read_all
    from megatron_patch.rlhf.ppo import main

    straight, resumed, ckpt = (str(tmp_path / n) for n in ("straight", "resumed", "ckpt"))
    argv = _ppo_argv(start)
    assert main(argv + ["--steps", "3", "--out", straight, "--critic-out", straight + "_critic"]) == 0
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    pp2 = ["--pp", "2"]
    files = _cpu.run_world(2, _ppo_main, argv + pp2 + ["--steps", "2", "--save", ckpt, "--save-interval", "1"])
    assert files[0] == ["rank_00_000.pt", "rank_00_001.pt", "state.json"]
    _cpu.run_world(2, _ppo_main, argv + pp2 + ["--steps", "3", "--load", ckpt, "--save", ckpt, "--out", resumed,
                                               "--critic-out", resumed + "_critic"])
    state = json.load(open(os.path.join(ckpt, "step_000003", "state.json")))
    for a, b in zip(whole["history"], state["history"], strict=True):
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])) for k in a), (a, b)
    for a, b in ((straight, resumed), (straight + "_critic", resumed + "_critic")):
        _close_weights(read_all(a), read_all(b))
    capsys.readouterr()
    assert main(argv + ["--steps", "3", "--load", ckpt]) != 0  # saved at PP=2: resuming at PP=1 is refused
    assert "was saved at TP=1 x PP=2: resume it with --tp 1 --pp 2" in capsys.readouterr().err


def _grpo_history(rank: int, argv: list[str]) -> list[dict] | None:
    """GRPO's per-step history, from its summary (the first rank prints it)."""
    import contextlib
    import io

    from megatron_patch.rlhf.grpo import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    lines = buf.getvalue().strip().splitlines()
    return json.loads(lines[-1])["history"] if lines else None


@pytest.mark.parametrize("tp,pp", [(1, 2)])
def test_grpo_pipeline_equals_one_stage(cpu_megatron, start, tmp_path, tp, pp):
    from megatron_patch.conversion.hf_io import read_all

    argv = ["--hf-dir", str(start / "hf"), "--prompts", str(start / "prompts.jsonl"), "--reward",
            "tests.distributed.test_rlhf_pipeline:toy_reward", "--max-new-tokens", "8", "--seed", "7", "--engine",
            "dynamic", "--prompts-per-step", "2", "--group-size", "2", "--steps", "2", "--lr", "3e-3"]
    one = _grpo_history(0, argv + ["--out", str(tmp_path / "one")])
    many = _cpu.run_world(tp * pp, _grpo_history, argv + ["--out", str(tmp_path / "pp"), "--tp", str(tp), "--pp",
                                                           str(pp)])
    assert many[1:] == [None] * (tp * pp - 1)
    for a, b in zip(one, many[0], strict=True):
        assert all(abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])) for k in a), (a, b)
    assert one[1]["kl"] > 0  # the second step ran on an updated policy
    x, y = read_all(str(tmp_path / "one")), read_all(str(tmp_path / "pp"))
    _close_weights(x, y)
    assert not torch.equal(x["model.embed_tokens.weight"], read_all(str(start / "hf"))["model.embed_tokens.weight"])
