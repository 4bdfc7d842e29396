"""PPO and GRPO under pipeline parallelism on CPU (gloo processes): the four PPO models (actor, reference,
reward-model-shaped critic, rule reward) and GRPO's policy run through megatron-core's pipeline schedule
(`megatron_patch.runtime.pipeline`). Over two steps, the second on the updated weights:

- PP=2 and TP=2 x PP=2 give PP=1's rollouts token for token and its metrics (<= 1e-4 relative): the forward
  passes, the gradients through both stages, the tied embedding's gradient shared by the first and last
  stage (a tied LLaMA), and the gradient-norm clip over all model-parallel ranks;
- a PPO checkpoint saved at PP=2 resumes at PP=2 bitwise equal to the run that never stopped (weights,
  critic, history), its per-rank files named by TP and PP rank; the HF export gathered from both stages
  equals PP=1's export after one optimizer step, within a bound derived from fp32 arithmetic;
- GRPO at PP=2, with the gradient clip out of the arithmetic, equals PP=1 bitwise.

All layouts sample on the dynamic inference engine (the one that runs PP > 1), so rollouts are comparable.
Every compared run, PP=1 included, is a spawned gloo world (`_cpu.run_world`: fresh processes of one
intra-op thread): CPU kernels split their sums by thread count, so a PP=1 reference run in the pytest process
(torch's default, one thread per core of whatever machine runs the suite, after whatever earlier tests left
behind) was not the arithmetic of the PP=2 workers, and how far they drifted apart depended on the machine."""

import contextlib
import io
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


def _same_bits(x: dict, y: dict) -> None:
    """Two exports of the same arithmetic: equal bit for bit."""
    assert x.keys() == y.keys()
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), (k, (x[k].float() - y[k].float()).abs().max())


def _one_step_apart(x: dict, y: dict, lr: float) -> None:
    """Two exports of one AdamW step (weight decay 0) from the same fp32 weights at PP=1 and PP=2, every
    element within a bound derived from fp32 arithmetic (u = 2^-24, the unit roundoff):

    - Until the clip, the layouts compute the same: each stage runs PP=1's kernels on the same inputs (one
      thread on both sides) and the pipeline moves tensors without arithmetic, so rollouts, losses and
      gradients are bitwise equal (with the clip out, PP=2 equals PP=1 bitwise, as GRPO's test asserts).
    - The gradient norm is the one sum whose order depends on the layout (`pipeline.clip_grad_norm`): PP=1
      adds the n parameters' sums of squares S_i (bitwise equal in both layouts) in one running fp32 sum, PP=2
      per stage and then the two stage sums. Either order is within gamma_(n-1) * sum(S_i) of the exact sum
      (gamma_k = k u / (1 - k u), non-negative terms), so the two norms, after the fp32 square root, the
      clip factor max_norm / (norm + 1e-6) and its rounding to fp32, and the product with each gradient
      element, differ by a relative eta <= (n + 5) u: both clipped gradients are g times a positive factor.
    - Adam's first step moves a weight by U(g) = lr g / (|g| + eps) (m-hat = g, sqrt(v-hat) = |g|), so
      |U(g) - U(g (1 + eta))| <= lr eta eps |g| / (|g| + eps)^2 <= lr eta / 4. Evaluating U in fp32 takes
      about ten rounded operations with the same constants in both layouts: <= 10 u lr on each side.
    - The new weight is rounded once: the two results are at most one ulp of the larger apart beyond that.

    Hence |x - y| <= ulp(max(|x|, |y|)) + lr (eta / 4 + 20 u). n: every exported tensor counts (megatron's
    parameters, the norm's summands, fuse some HF tensors, so they are no more). After a second step no such
    bound holds: Adam divides by sqrt(v-hat), so a gradient near zero turns a rounding difference in the
    weights into any fraction of lr."""
    assert x.keys() == y.keys()
    u = 2.0 ** -24
    slack = lr * ((len(x) + 5) * u / 4 + 20 * u)
    for k in x:
        assert x[k].dtype == y[k].dtype == torch.float32, (k, x[k].dtype)
        top = torch.maximum(x[k].abs(), y[k].abs())
        ulp = torch.nextafter(top, torch.tensor(float("inf"))) - top
        excess = (x[k] - y[k]).abs() - (ulp + slack)
        assert excess.max().item() <= 0, (k, excess.max().item(), slack)


def _one_stage(fn, *args):
    """`fn(0, *args)` in a spawned world of one process: the arithmetic of the PP > 1 workers (one thread,
    a fresh process), not that of the pytest process."""
    return _cpu.run_world(1, fn, *args)[0]


@pytest.mark.parametrize("tp,pp,reward", [(1, 2, "rule"), (2, 2, "rule"), (1, 2, "model")])
def test_ppo_pipeline_equals_one_stage(cpu_megatron, start, tmp_path, tp, pp, reward):
    """reward "model": a reward model (and the critic started from it) run through the pipeline too."""
    argv = _ppo_argv(start)
    if reward == "model":
        rm = tiny_lm_folder(str(tmp_path / "rm"), reward=True, seed=1)
        argv[argv.index("--reward"):argv.index("--reward") + 2] = ["--reward-model", rm]
    one = _one_stage(ppo_steps, argv)
    assert one[1][0]["kl"] > 0 and one[1][0]["clip_frac"] > 0  # the second step ran on an updated policy
    for rank in _cpu.run_world(tp * pp, ppo_steps, argv + ["--tp", str(tp), "--pp", str(pp)]):
        _same(one, rank)


def _ppo_runs(rank: int, *argvs: list[str]) -> list[dict | None]:
    """Run PPO once per argv, one after the other in this process; each run's summary (printed by the first
    rank; None on the others)."""
    from megatron_patch.rlhf.ppo import main

    summaries = []
    for argv in argvs:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(argv) == 0
        lines = buf.getvalue().strip().splitlines()
        summaries.append(json.loads(lines[-1]) if lines else None)
    return summaries


def test_ppo_pipeline_resume_and_export(cpu_megatron, start, tmp_path, capsys):
    from megatron_patch.conversion.hf_io import read_all
    from megatron_patch.rlhf.ppo import main

    straight, resumed, ckpt, pp1, pp2 = (str(tmp_path / n) for n in ("straight", "resumed", "ckpt", "pp1", "pp2"))
    argv = _ppo_argv(start, "--kl-target", "0.01")  # an adaptive KL coefficient: state the resume must restore
    lr = float(argv[argv.index("--lr") + 1])
    assert lr == float(argv[argv.index("--critic-lr") + 1])
    pp = ["--pp", "2"]
    # one AdamW step of each model, clipped far below these models' gradient norms (about 6 to 9 at the first
    # step): the clip factor, the one part of the arithmetic that depends on the layout, reaches the weights
    one_step = ["--steps", "1", "--epochs", "1", "--mini-batches", "1", "--clip-grad", "1e-3"]
    # PP=2: saved after step 2; three steps without a stop; one optimizer step, for the layout comparison
    _, whole, _ = _cpu.run_world(2, _ppo_runs, argv + pp + ["--steps", "2", "--save", ckpt, "--save-interval", "1"],
                                 argv + pp + ["--steps", "3", "--out", straight, "--critic-out", straight + "_critic"],
                                 argv + pp + one_step + ["--out", pp2, "--critic-out", pp2 + "_critic"])[0]
    assert sorted(os.listdir(os.path.join(ckpt, "step_000002"))) == ["rank_00_000.pt", "rank_00_001.pt", "state.json"]
    [again] = _cpu.run_world(2, _ppo_runs, argv + pp + ["--steps", "3", "--load", ckpt, "--save", ckpt, "--out",
                                                        resumed, "--critic-out", resumed + "_critic"])[0]
    assert again["resumed_at"] == 2
    # the resumed run is the same arithmetic as the straight one: equal bit for bit
    state = json.load(open(os.path.join(ckpt, "step_000003", "state.json")))
    assert again["history"] == state["history"] == whole["history"] and len(whole["history"]) == 3
    for a, b in ((straight, resumed), (straight + "_critic", resumed + "_critic")):
        _same_bits(read_all(a), read_all(b))
    # PP=1 against PP=2: the same up to the gradient norm's summation order (_one_step_apart)
    _one_stage(_ppo_runs, argv + one_step + ["--out", pp1, "--critic-out", pp1 + "_critic"])
    for a, b in ((pp1, pp2), (pp1 + "_critic", pp2 + "_critic")):
        _one_step_apart(read_all(a), read_all(b), lr)
    capsys.readouterr()
    assert main(argv + ["--steps", "3", "--load", ckpt]) != 0  # saved at PP=2: resuming at PP=1 is refused
    assert "was saved at TP=1 x PP=2: resume it with --tp 1 --pp 2" in capsys.readouterr().err


def _grpo_history(rank: int, argv: list[str]) -> list[dict] | None:
    """GRPO's per-step history, from its summary (the first rank prints it)."""
    from megatron_patch.rlhf.grpo import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    lines = buf.getvalue().strip().splitlines()
    return json.loads(lines[-1])["history"] if lines else None


@pytest.mark.parametrize("tp,pp", [(1, 2)])
def test_grpo_pipeline_equals_one_stage(cpu_megatron, start, tmp_path, tp, pp):
    from megatron_patch.conversion.hf_io import read_all

    # the clip out (a bound no gradient norm reaches): the gradient norm is the one sum whose order depends on
    # the layout (per stage, then across stages), so without it PP=2 is PP=1's arithmetic (_one_step_apart)
    argv = ["--hf-dir", str(start / "hf"), "--prompts", str(start / "prompts.jsonl"), "--reward",
            "tests.distributed.test_rlhf_pipeline:toy_reward", "--max-new-tokens", "8", "--seed", "7", "--engine",
            "dynamic", "--prompts-per-step", "2", "--group-size", "2", "--steps", "2", "--lr", "3e-3",
            "--clip-grad", "1e30"]
    one = _one_stage(_grpo_history, argv + ["--out", str(tmp_path / "one")])
    many = _cpu.run_world(tp * pp, _grpo_history, argv + ["--out", str(tmp_path / "pp"), "--tp", str(tp), "--pp",
                                                           str(pp)])
    assert many[1:] == [None] * (tp * pp - 1)
    assert one == many[0]
    assert one[1]["kl"] > 0  # the second step ran on an updated policy
    x, y = read_all(str(tmp_path / "one")), read_all(str(tmp_path / "pp"))
    _same_bits(x, y)
    assert not torch.equal(x["model.embed_tokens.weight"], read_all(str(start / "hf"))["model.embed_tokens.weight"])
