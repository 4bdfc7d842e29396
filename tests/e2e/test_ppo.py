"""PPO (`python -m megatron_patch.rlhf.ppo`) on CPU with tiny models:

- the loss terms (token rewards with the KL penalty, reward and advantage whitening, GAE, clipped policy
  and value losses, clip fractions, sequence KL, the adaptive KL coefficient) equal a hand computation
  with plain loops on a fixed batch;
- the toy task (reward: the number of completion tokens with an id below 200) rises by more than
  `TOY_RISE` over 16 steps while the per-completion KL stays below `TOY_KL_BOUND`;
- TP=2 gives TP=1's rollouts (token for token) and losses (<= 1e-4 relative) over two steps;
- a run saved after 2 steps and resumed to 3 equals an uninterrupted 3-step run (history and weights); a rerun
  into a --save folder that holds a checkpoint, without --load naming it, is refused (naming --load and
  --overwrite) before anything is read, and --overwrite starts again, leaving the new run's checkpoints only;
- the full workflow SFT -> reward model -> PPO -> HF export through the rlhf/ launchers (`rlhf/example_cpu.sh`)
  per family: the exported actor loads in transformers and generates, and its logits equal our model's;
  the exported critic's per-token values (HF `score(base_model(ids).last_hidden_state)`) equal our
  critic's;
- bad input (a reward model whose vocabulary differs from the policy's, a critic with another tokenizer, a
  causal LM given as the reward model, prompts longer than a model's context) is refused before any
  weight is read or rollout made.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from megatron_patch.tokenizer import TINY_TOKENIZER, build_tokenizer
from tests import _cpu
from tests.helpers import ppo_steps, tiny_lm_folder

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# PPO learns the toy reward: its mean over the last 4 of 16 steps (32 samples each) minus that over the first 4.
# Measured 2026-12-02 on both engines and seeds 3, 7, 11: learning 2.9-6.3; the same runs without learning (lr
# 1e-9) -0.6-0.2 (the sampling noise of the difference of two 128-sample means: sd ~0.4). 1.5 is ~3.5 sd above
# no learning and half the smallest learned rise. (12 steps x 16 samples, the former setting, rose 0.77-1.83
# against a bound of 1.0: the sample stream, not the algorithm, decided.)
TOY_RISE = 1.5
TOY_KL_BOUND = 40.0  # nats per completion (8 tokens), every step; measured 10.5-20.9 in the runs above
PROMPTS = ["The module", "A list of", "When the function", "def f(x):"]

# --- hand computation ------------------------------------------------------------------------------------


def _hand_whiten(x, mask, shift_mean=True):
    values = [float(x[i, t]) for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[i, t]:
                out[i, t] = (float(x[i, t]) - mean) / (var + 1e-8) ** 0.5 + (0 if shift_mean else mean)
    return out


def _hand_gae(rewards, values, mask, gamma, lam):
    adv, ret = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        steps = [t for t in range(rewards.shape[1]) if mask[i, t]]
        following = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_value = float(values[i, steps[k + 1]]) if k + 1 < len(steps) else 0.0
            delta = float(rewards[i, t]) + gamma * next_value - float(values[i, t])
            following = delta + gamma * lam * following
            adv[i, t] = following
            ret[i, t] = following + float(values[i, t])
    return adv, ret


def test_loss_terms_equal_a_hand_computation():
    from megatron_patch.rlhf import ppo_loss as L

    g = torch.Generator().manual_seed(0)
    rows, s = 3, 7
    # row 0: prompt of 2 tokens, completion of 4; row 1: prompt 1, completion 5; row 2: prompt 3, completion 2
    mask = torch.zeros(rows, s)
    for i, (p, c) in enumerate([(2, 4), (1, 5), (3, 2)]):
        mask[i, p - 1: p - 1 + c] = 1
    logps, old, ref = (-torch.rand(rows, s, generator=g) * 3 for _ in range(3))
    values, old_values = torch.randn(rows, s, generator=g), torch.randn(rows, s, generator=g)
    scores = torch.tensor([1.5, -0.5, 0.25])
    kl_coef, gamma, lam, clip, vclip = 0.1, 0.9, 0.8, 0.2, 0.3

    # token rewards: -kl_coef (old - ref) per completion token, the score added at the last one
    hand_rewards = torch.zeros(rows, s)
    for i in range(rows):
        steps = [t for t in range(s) if mask[i, t]]
        for t in steps:
            hand_rewards[i, t] = -kl_coef * (float(old[i, t]) - float(ref[i, t]))
        hand_rewards[i, steps[-1]] += float(scores[i])
    rewards = L.token_rewards(scores, old, ref, mask, kl_coef)
    torch.testing.assert_close(rewards, hand_rewards, atol=1e-6, rtol=0)
    hand_kl = [sum(float(old[i, t]) - float(ref[i, t]) for t in range(s) if mask[i, t]) for i in range(rows)]
    torch.testing.assert_close(L.sequence_kl(old, ref, mask), torch.tensor(hand_kl), atol=1e-6, rtol=0)

    # whitening: rewards keep their mean, advantages are centred
    torch.testing.assert_close(L.whiten(rewards, mask, shift_mean=False), _hand_whiten(rewards, mask, False),
                               atol=1e-5, rtol=0)
    adv, ret = L.gae(rewards, old_values, mask, gamma, lam)
    hand_adv, hand_ret = _hand_gae(rewards, old_values, mask, gamma, lam)
    torch.testing.assert_close(adv, hand_adv, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, hand_ret, atol=1e-5, rtol=0)
    adv = L.whiten(adv, mask)
    torch.testing.assert_close(adv, _hand_whiten(hand_adv, mask), atol=1e-5, rtol=0)

    # clipped policy loss and clip fraction, token by token
    terms, clipped = [], 0
    for i in range(rows):
        for t in range(s):
            if mask[i, t]:
                ratio = float(torch.exp(logps[i, t] - old[i, t]))
                a = float(adv[i, t])
                plain, cut = -a * ratio, -a * min(max(ratio, 1 - clip), 1 + clip)
                terms.append(max(plain, cut))
                clipped += cut > plain
    loss, frac = L.policy_loss(logps, old, adv, mask, clip)
    assert abs(float(loss) - sum(terms) / len(terms)) < 1e-6 and abs(frac - clipped / len(terms)) < 1e-6
    assert 0 < frac < 1  # the batch exercises both branches

    # clipped value loss and value clip fraction
    terms, clipped = [], 0
    for i in range(rows):
        for t in range(s):
            if mask[i, t]:
                v, v_old, r = float(values[i, t]), float(old_values[i, t]), float(hand_ret[i, t])
                v_cut = v_old + min(max(v - v_old, -vclip), vclip)
                terms.append(max((v - r) ** 2, (v_cut - r) ** 2))
                clipped += (v_cut - r) ** 2 > (v - r) ** 2
    vloss, vfrac = L.value_loss(values, old_values, ret, mask, vclip)
    assert abs(float(vloss) - 0.5 * sum(terms) / len(terms)) < 1e-5 and abs(vfrac - clipped / len(terms)) < 1e-6
    assert 0 < vfrac < 1

    # the KL coefficient: fixed without a target; adaptive moves it by the clipped proportional error
    fixed = L.KLController(0.1)
    fixed.update(50.0, 16)
    assert fixed.value == 0.1
    adaptive = L.KLController(0.1, target=6.0, horizon=100)
    adaptive.update(9.0, 16)  # error 0.5, clipped to 0.2
    assert abs(adaptive.value - 0.1 * (1 + 0.2 * 16 / 100)) < 1e-12
    adaptive.update(5.4, 16)  # error -0.1
    assert abs(adaptive.value - 0.1 * (1 + 0.2 * 16 / 100) * (1 - 0.1 * 16 / 100)) < 1e-12


# --- runs ------------------------------------------------------------------------------------------------

_TOK = []


def toy_reward(prompt: str, completion: str) -> float:
    """The toy rule: the number of the completion's tokens with an id below 200."""
    if not _TOK:
        _TOK.append(build_tokenizer(TINY_TOKENIZER))
    return float(sum(i < 200 for i in _TOK[0].tokenize(completion)))


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A tiny LLaMA (HF folder with the tiny tokenizer) and a prompt file."""
    root = tmp_path_factory.mktemp("ppo")
    tiny_lm_folder(str(root / "hf"))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


def _argv(start, *extra) -> list[str]:
    return ["--hf-dir", str(start / "hf"), "--prompts", str(start / "prompts.jsonl"), "--reward",
            "tests.e2e.test_ppo:toy_reward", "--max-new-tokens", "8", "--seed", "7", *extra]


def _summary(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_toy_reward_rises_with_the_kl_bounded(cpu_megatron, start, capsys):
    from megatron_patch.rlhf.ppo import main

    assert main(_argv(start, "--steps", "16", "--prompts-per-step", "32", "--epochs", "2", "--mini-batches", "2",
                      "--lr", "3e-3", "--critic-lr", "3e-3", "--kl-coef", "0.05")) == 0
    summary = _summary(capsys)
    history = summary["history"]
    first = sum(r["reward"] for r in history[:4]) / 4
    last = sum(r["reward"] for r in history[-4:]) / 4
    assert last > first + TOY_RISE, (first, last, history)
    assert summary["kl_max"] < TOY_KL_BOUND, history
    assert history[0]["kl"] == 0.0  # the first rollouts come from the reference itself
    assert all(0 <= r["clip_frac"] <= 1 and r["entropy"] > 0 and r["value_loss"] >= 0 for r in history)


def test_tp2_rollouts_and_losses_equal_tp1(cpu_megatron, start):
    argv = _argv(start, "--prompts-per-step", "4", "--epochs", "2", "--mini-batches", "2", "--lr", "3e-3",
                 "--critic-lr", "3e-3")
    one = ppo_steps(0, argv)
    for rank in _cpu.run_world(2, ppo_steps, argv + ["--tp", "2"]):
        for (row1, tokens1), (row2, tokens2) in zip(one, rank, strict=True):
            assert tokens1 == tokens2  # the same rollouts, token for token (step 2: after an update)
            for k, v in row1.items():
                assert abs(row2[k] - v) <= 1e-4 * max(1.0, abs(v)), (k, row1, row2)
    assert one[1][0]["kl"] > 0 and one[1][0]["clip_frac"] > 0  # the second step ran on an updated policy


def test_resume_equals_an_uninterrupted_run(cpu_megatron, start, tmp_path, capsys):
    from megatron_patch.conversion.hf_io import read_all
    from megatron_patch.rlhf.ppo import main

    argv = _argv(start, "--prompts-per-step", "4", "--lr", "3e-3", "--critic-lr", "3e-3", "--kl-target", "2",
                 "--kl-horizon", "40")
    straight, resumed, ckpt = (str(tmp_path / n) for n in ("straight", "resumed", "ckpt"))
    assert main(argv + ["--steps", "3", "--out", straight, "--critic-out", straight + "_critic"]) == 0
    whole = _summary(capsys)
    assert main(argv + ["--steps", "2", "--save", ckpt, "--save-interval", "1"]) == 0
    assert open(os.path.join(ckpt, "latest")).read().strip() == "2"
    assert main(argv + ["--steps", "3", "--load", ckpt, "--save", ckpt, "--out", resumed, "--critic-out",
                        resumed + "_critic"]) == 0
    again = _summary(capsys)
    assert again["resumed_at"] == 2 and again["history"] == whole["history"]
    assert whole["history"][2]["kl_coef"] != whole["history"][0]["kl_coef"]  # the adaptive coefficient resumed too
    for a, b in ((straight, resumed), (straight + "_critic", resumed + "_critic")):
        x, y = read_all(a), read_all(b)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


TIMING_LINE = ("rollout_s", "score_s", "update_s")
TIMING_SUMMARY = ("rollout_seconds", "score_seconds", "update_seconds")


def test_each_step_says_where_its_seconds_went(cpu_megatron, start, tmp_path, capsys):
    """Each step line splits the step into its rollouts, its scoring (log-probabilities, rewards) and its update;
    the summary sums each over the steps; the history (in the checkpoint and the summary) holds no timing, so a
    resumed run still equals an uninterrupted one."""
    from megatron_patch.rlhf.ppo import main

    ckpt = tmp_path / "ckpt"
    assert main(_argv(start, "--prompts-per-step", "2", "--steps", "2", "--save", str(ckpt))) == 0
    out = capsys.readouterr()
    summary = json.loads(out.out.strip().splitlines()[-1])
    lines = [json.loads(line) for line in out.err.splitlines() if line.startswith('{"step"')]
    assert [line["step"] for line in lines] == [1, 2], out.err
    for line in lines:
        assert all(isinstance(line[k], float) and line[k] >= 0 for k in TIMING_LINE), line
        if "seconds" in line:  # the step's wall time, if the line reports one
            assert sum(line[k] for k in TIMING_LINE) <= line["seconds"] + 0.005 + 1e-5, line
    for lap, total in zip(TIMING_LINE, TIMING_SUMMARY, strict=True):
        assert summary[total] >= 0
        # the summary rounds to 0.01, the step lines to 1e-5
        assert abs(summary[total] - sum(line[lap] for line in lines)) <= 0.005 + 1e-5, (total, summary, lines)
    saved = json.loads((ckpt / "step_000002" / "state.json").read_text())["history"]
    for history in (summary["history"], saved):
        assert len(history) == 2
        assert not [k for row in history for k in row if k in TIMING_LINE + TIMING_SUMMARY or k.endswith("_s")], \
            history


def test_rerun_into_a_saved_run_resumes_with_load_or_starts_again_with_overwrite(cpu_megatron, start, tmp_path,
                                                                                 capsys):
    """The same command run again after an interruption finds --save holding checkpoints: without --load naming
    that folder it would start at step 1 and replace them, so it stops, naming both ways on (megatron.training's
    --load = --save resumes; --overwrite starts again); nothing in the folder is touched. --overwrite trains from
    the start and leaves only its own checkpoints."""
    from megatron_patch.rlhf.ppo import main

    ckpt = tmp_path / "ckpt"
    (ckpt / "step_000002").mkdir(parents=True)
    (ckpt / "step_000002" / "state.json").write_text(json.dumps({"step": 2, "tp": 1, "pp": 1}))
    (ckpt / "latest").write_text("2\n")
    before = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))
    argv = _argv(start, "--prompts-per-step", "2", "--steps", "1", "--save", str(ckpt))
    for extra in ([], ["--load", str(tmp_path / "elsewhere")]):
        assert main(argv + extra) == 1
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1] == (
            f"error: --save {ckpt} already holds a PPO checkpoint (step 2): pass --load {ckpt} to resume it, or "
            "--overwrite to start again and replace it"), err
        assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")) == before
    assert main(argv + ["--overwrite"]) == 0
    assert _summary(capsys)["resumed_at"] == 0
    assert sorted(os.listdir(ckpt)) == ["latest", "step_000001"] and (ckpt / "latest").read_text().strip() == "1"


# --- the workflow through the rlhf/ launchers, per family -------------------------------------------------

FAMILIES = {  # family -> its tiny config (tests/models.py); adding a family is one line
    "llama": "gqa",
    "bloom": "bloom",
    "gptj": "gptj",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_workflow_sft_rm_ppo_export(cpu_megatron, family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from megatron_patch.inference import load_model
    from megatron_patch.runtime import pipeline
    from megatron_patch.runtime.logits import megatron_logits
    from tests.models import any_config

    config, out = tmp_path / "config.json", tmp_path / "example"
    config.write_text(json.dumps(any_config(FAMILIES[family])))
    env = {**os.environ, "PYTHON": sys.executable, "MASTER_PORT": str(_cpu.free_port()), "TORCHDYNAMO_DISABLE": "1",
           "PYTHONPATH": ROOT}
    env.pop("NPROC_PER_NODE", None)
    p = subprocess.run(["bash", os.path.join(ROOT, "rlhf", "example_cpu.sh"), str(out), str(config)], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    check = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(check["samples"]) == 4 and all(s["new_tokens"] > 0 for s in check["samples"]), check
    steps = [json.loads(line) for line in p.stderr.splitlines() if line.startswith('{"step"')]
    assert [s["step"] for s in steps] == [1, 2, 3, 4], p.stderr[-3000:]
    assert os.path.isfile(out / "ppo_ckpt" / "latest")

    # the exported actor computes our model's logits; the exported critic our critic's values at every token
    ids = torch.tensor([[5, 17, 230, 41, 99, 3, 250, 8]])
    actor = AutoModelForCausalLM.from_pretrained(str(out / "ppo_hf")).eval()
    ours, cfg = load_model(None, str(out / "ppo_hf"))
    assert cfg["architectures"] == any_config(FAMILIES[family])["architectures"]
    with torch.no_grad():
        torch.testing.assert_close(megatron_logits(ours, ids, actor.config.vocab_size), actor(ids).logits,
                                   atol=1e-5, rtol=0)
        critic = AutoModelForSequenceClassification.from_pretrained(str(out / "critic_hf")).eval()
        theirs = critic.score(critic.base_model(ids).last_hidden_state)[..., 0]
        ours, cfg = load_model(None, str(out / "critic_hf"))
        assert cfg["architectures"][0].endswith("ForSequenceClassification") and cfg["num_labels"] == 1
        torch.testing.assert_close(pipeline.forward(ours, ids)[..., 0], theirs, atol=1e-5, rtol=0)
        assert torch.allclose(critic(ids).logits[0, 0], theirs[0, -1], atol=1e-6)  # HF's score: the last value
    # PPO moved the policy away from the SFT model it started from
    from megatron_patch.conversion.hf_io import read_all

    sft, ppo = read_all(str(out / "sft_hf")), read_all(str(out / "ppo_hf"))
    assert sft.keys() == ppo.keys() and any(not torch.equal(sft[k], ppo[k]) for k in sft)


# --- bad input -------------------------------------------------------------------------------------------


def _config_only(path, cfg: dict, tokenizer_json: dict | None = None) -> str:
    """A model folder without weights: config.json and the tiny tokenizer (or `tokenizer_json`)."""
    from megatron_patch.conversion.hf_io import copy_side_files

    os.makedirs(path)
    (path / "config.json").write_text(json.dumps(cfg))
    copy_side_files(TINY_TOKENIZER, str(path), ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    if tokenizer_json is not None:
        (path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    return str(path)


def test_bad_models_and_prompts_are_refused_before_any_weight_or_rollout(cpu_megatron, start, tmp_path, capsys,
                                                                         monkeypatch):
    import megatron_patch.inference
    from megatron_patch.models.reward import as_reward_config
    from megatron_patch.rlhf import rollout
    from megatron_patch.rlhf.ppo import main
    from tests.models import any_config, llama_config

    def never(*args, **kwargs):
        raise AssertionError("a model was loaded or a rollout made before the inputs were checked")

    monkeypatch.setattr(megatron_patch.inference, "load_model", never)
    monkeypatch.setattr(rollout, "rollout", never)
    # the same vocabulary size, another tokenizer: two tokens' ids swapped (what another family's tokenizer does)
    other = json.load(open(os.path.join(TINY_TOKENIZER, "tokenizer.json")))
    vocab = other["model"]["vocab"]
    mine = dict(vocab)
    vocab["the"], vocab["module"] = vocab["module"], vocab["the"]
    long_prompt = tmp_path / "long.jsonl"
    long_prompt.write_text(json.dumps({"prompt": "the module returns a list of values " * 60}) + "\n")
    policy = str(start / "hf")
    for extra, message in [
        (["--reward-model", _config_only(tmp_path / "rm_vocab",
                                         as_reward_config(llama_config("gqa", vocab_size=1200)))],
         "--reward-model {0}: its vocabulary differs from the policy's (1200 tokens in its config.json, 1000 in the "
         "policy's); the reward model reads the policy's token ids, so it must use the policy's tokenizer"),
        (["--reward", "tests.e2e.test_ppo:toy_reward", "--critic",
          _config_only(tmp_path / "bloom_critic", any_config("bloom"), other)],
         "--critic {0}: its vocabulary differs from the policy's ({1!r} is token {2} there and {3} in the policy's); "
         "the critic reads the policy's token ids"),
        (["--reward-model", policy], "--reward-model {0} is a LlamaForCausalLM, not a reward model"),
        (["--reward", "tests.e2e.test_ppo:toy_reward", "--prompts", str(long_prompt)],
         "prompt 1 has 421 tokens: with --max-new-tokens 8 it needs 429, more than the model's context of 256 tokens"),
        (["--reward-model", _config_only(tmp_path / "rm_short", as_reward_config(
            llama_config("gqa", max_position_embeddings=10)))],
         "more than the model's context of 10 tokens (max_position_embeddings) of the reward model {0}"),
        # the two exports: the converter's output check, with each other's flag (the same folder, or one inside)
        (["--reward", "tests.e2e.test_ppo:toy_reward", "--out", str(tmp_path / "out"), "--critic-out",
          str(tmp_path / "out")], "--out {0} is the --critic-out folder {0}, which this run also writes"),
        (["--reward", "tests.e2e.test_ppo:toy_reward", "--out", str(tmp_path / "out"), "--critic-out",
          str(tmp_path / "out" / "critic")], "holds the --critic-out folder {0}, which this run also writes"),
    ]:
        argv = ["--hf-dir", policy, "--prompts", str(start / "prompts.jsonl"), "--max-new-tokens", "8", *extra]
        assert main(argv) == 1
        err = capsys.readouterr().err
        first = min(("the", "module"), key=lambda t: mine[t])  # the first token (by the policy's id) that differs
        expected = message.format(extra[-1], first, vocab[first], mine[first])
        assert expected in err and err.strip().splitlines()[-1].startswith("error: "), (expected, err)
        assert "Traceback" not in err


# --- launchers and --help --------------------------------------------------------------------------------


@pytest.mark.parametrize("stage, entry", [("sft", "sft"), ("rm", "rlhf.reward_model"), ("dpo", "rlhf.dpo"),
                                          ("ppo", "rlhf.ppo"), ("grpo", "rlhf.grpo")])
def test_each_stage_launcher_runs_its_entry_point(stage, entry, start):
    """rlhf/<stage>.sh: the training stages through examples/launch.sh (its --dry-run shows the command), the
    online ones through rlhf/online.sh (--help shows the entry point's options; --model is required)."""
    env = {**os.environ, "PYTHON": sys.executable}
    script = os.path.join(ROOT, "rlhf", f"{stage}.sh")
    if stage in ("ppo", "grpo"):
        p = subprocess.run(["bash", script, "--help"], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and f"usage: python -m megatron_patch.{entry}" in p.stdout, p.stderr[-2000:]
        p = subprocess.run(["bash", script, "--prompts", "p.jsonl"], env=env, capture_output=True, text=True)
        assert p.returncode == 1 and "error: --model HF_DIR is required" in p.stderr
        p = subprocess.run(["bash", script, "--model", "m", "--steps", "3", "--tp", "2", "--pp", "2", "--dry-run"],
                           env=env, capture_output=True, text=True)
        assert p.returncode == 0 and p.stdout.split() == [
            sys.executable, "-m", "megatron_patch.torchrun", "--standalone", "--nproc_per_node", "4", "-m",
            f"megatron_patch.{entry}", "--hf-dir", "m", "--tp", "2", "--pp", "2", "--steps", "3"], p.stdout
        return
    p = subprocess.run(["bash", script, "--model", str(start / "hf"), "--data", str(start / "prompts.jsonl"), "--cpu",
                        "--dry-run"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"-m megatron_patch.{entry} --load-hf {start / 'hf'}" in p.stdout, p.stdout


def _stderr_until(p: subprocess.Popen, start: str, lines: list[str]) -> None:
    for line in p.stderr:
        lines.append(line)
        if line.startswith(start):
            return
    raise AssertionError("".join(lines))


def test_under_the_launcher_errors_and_sigterm_end_as_the_tools_do(start, tmp_path):
    """rlhf/grpo.sh / ppo.sh run torchrun through megatron_patch.torchrun: a worker's `error:` line is the whole
    report (exit 1, no torchrun traceback or failure box), and SIGTERM (preemption, `scancel`, `timeout`) reaches the
    workers, which stop as the tools do (nothing half-written), and ends the launcher with 143, without a
    traceback."""
    env = {**os.environ, "PYTHON": sys.executable, "TORCHDYNAMO_DISABLE": "1"}
    common = ["--model", str(start / "hf"), "--prompts", str(start / "prompts.jsonl"), "--max-new-tokens", "4",
              "--prompts-per-step", "2"]
    p = subprocess.run(["bash", os.path.join(ROOT, "rlhf", "grpo.sh"), *common, "--reward", "no_such_module:fn"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: --reward no_such_module:fn"), p.stderr
    for noise in ("Traceback", "ChildFailedError", "FAILED", "exitcode"):
        assert noise not in p.stderr, p.stderr

    save = tmp_path / "ckpt"
    p = subprocess.Popen(["bash", os.path.join(ROOT, "rlhf", "ppo.sh"), *common, "--reward",
                          "tests.e2e.test_ppo:toy_reward", "--steps", "1000", "--save", str(save), "--save-interval",
                          "1"], env=env, cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        _stderr_until(p, '{"step": 2', lines)
        p.send_signal(signal.SIGTERM)
        rest = p.communicate(timeout=300)[1]
    finally:
        p.kill()
    err = "".join(lines) + rest
    assert p.returncode == 143, err
    assert "error: terminated (SIGTERM)" in err and "Traceback" not in err and "SignalException" not in err, err
    assert not [n for n in os.listdir(save) if "partial" in n]
    for step in os.listdir(save):
        assert step == "latest" or not [n for n in os.listdir(save / step) if "partial" in n]


def test_every_option_says_what_it_does():
    from megatron_patch.rlhf.ppo import parser

    for action in parser()._actions:
        assert action.help, action.option_strings


def test_a_failed_checkpoint_save_leaves_no_partial_file(cpu_megatron, tmp_path, monkeypatch):
    """A save that fails (disk full, preemption) leaves neither a half-written rank file nor its temporary file,
    and no tracker (`rlhf.checkpoint`, shared by the online trainers)."""
    from megatron_patch.rlhf import checkpoint

    def full_disk(obj, f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError):
        checkpoint.save(str(tmp_path), 1, {"actor": {}}, {"tp": 1, "pp": 1, "history": []})
    assert os.listdir(tmp_path / "step_000001") == [] and not os.path.exists(tmp_path / "latest")
