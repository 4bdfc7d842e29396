"""GRPO's guards: a reward that is not a finite number is refused naming the prompt and sample (a NaN
reward would write an all-NaN policy), a group of one (advantage always 0) is refused, --out is checked
before any rollout (existing without --overwrite; no --out is warned about), and the exported policy's
config states its dtype; an MoE actor's rollouts on the dropless MoE layers train as on megatron-core's."""

import json
import math

import pytest
import torch


def nan_reward(prompt: str, completion: str) -> float:
    return math.nan if prompt.startswith("A list") else 1.0


def text_reward(prompt: str, completion: str):
    return "good"


def constant_reward(prompt: str, completion: str) -> float:
    return float(len(completion) % 3)


def content_reward(prompt: str, completion: str) -> float:
    return float(sum(map(ord, completion)) % 7)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["The module", "A list of values"]))
    return str(path)


def _grpo(tiny_lm, prompts, reward, *extra):
    from megatron_patch.rlhf.grpo import main

    return main(["--hf-dir", tiny_lm, "--prompts", prompts, "--reward", f"tests.e2e.test_grpo:{reward}", "--steps", "1",
                 "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", *extra])


def test_non_finite_or_non_numeric_reward_is_refused(cpu_megatron, tiny_lm, prompts, tmp_path, capsys):
    out = tmp_path / "policy"
    assert _grpo(tiny_lm, prompts, "nan_reward", "--out", str(out)) == 1
    err = capsys.readouterr().err
    assert "error: --reward tests.e2e.test_grpo:nan_reward returned nan for prompt 2 ('A list of values'), sample 1 " \
           "of its group: a reward must be a finite number" in err, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    assert _grpo(tiny_lm, prompts, "text_reward") == 1
    assert "returned 'good' for prompt 1" in capsys.readouterr().err


def test_group_of_one_is_refused(cpu_megatron, tiny_lm, prompts, capsys):
    from megatron_patch.rlhf.grpo import main

    assert main(["--hf-dir", tiny_lm, "--prompts", prompts, "--reward", "tests.e2e.test_grpo:constant_reward",
                 "--group-size", "1"]) == 1
    assert "error: --group-size must be >= 2" in capsys.readouterr().err


def test_out_checked_first_warned_when_missing_and_written_with_its_dtype(cpu_megatron, tiny_lm, prompts,
                                                                         tmp_path, capsys):
    out = tmp_path / "policy"
    out.mkdir()
    assert _grpo(tiny_lm, prompts, "constant_reward", "--out", str(out)) == 1
    assert "already exists (pass --overwrite to replace it)" in capsys.readouterr().err
    assert _grpo(tiny_lm, prompts, "constant_reward", "--out", str(out), "--overwrite") == 0
    assert json.load(open(out / "config.json"))["dtype"] == "float32"
    assert _grpo(tiny_lm, prompts, "constant_reward", "--out", str(out), "--overwrite", "--dtype", "bf16") == 0
    from transformers import AutoModelForCausalLM

    cfg = json.load(open(out / "config.json"))
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(str(out), dtype="auto").dtype == torch.bfloat16
    assert _grpo(tiny_lm, prompts, "constant_reward") == 0
    assert "warning: no --out: the trained policy will not be saved" in capsys.readouterr().err


def test_loss_reports_its_kl_without_a_scalar_conversion_warning():
    """grpo_loss returns the mean KL as a plain float taken from detached values (float() of a tensor
    that requires grad warned on every step)."""
    import warnings

    from megatron_patch.rlhf.grpo import grpo_loss

    logps = torch.tensor([[-1.0, -2.0], [-1.5, -0.5]], requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, kl = grpo_loss(logps, logps.detach(), logps.detach() - 0.1, torch.tensor([1.0, -1.0]),
                             torch.ones(2, 2), 0.2, 0.1)
    assert isinstance(kl, float) and kl > 0 and loss.requires_grad


def test_completions_that_stopped_are_trained_with_their_end_token():
    """Generation leaves the sampled end-of-document token out; a completion shorter than
    --max-new-tokens ended with it, and the policy must learn that choice too."""
    from megatron_patch.rlhf.rollout import batch_of, with_end_token

    completions = with_end_token([[5, 6], [7, 8, 9]], max_new_tokens=3, eod=0)
    assert completions == [[5, 6, 0], [7, 8, 9]]
    tokens, labels, mask = batch_of([[1, 2], [3]], completions, pad=99, device="cpu")
    # the end token is a trained label of the first row (position 3 predicts it)
    assert labels[0, 3] == 0 and mask[0, 3] == 1 and mask[0].sum() == 3 and mask[1].sum() == 3


def test_non_finite_loss_stops_before_the_step_and_writes_nothing(cpu_megatron, tiny_lm, prompts, tmp_path,
                                                                 monkeypatch, capsys):
    """A loss that is not finite (a diverged run) stops GRPO before the optimizer writes NaN into the weights
    (`loop.check_finite`); the policy is not exported."""
    from megatron_patch.rlhf import grpo

    real = grpo.grpo_loss
    monkeypatch.setattr(grpo, "grpo_loss", lambda *a, **k: (real(*a, **k)[0] * math.nan, 0.0))
    out = tmp_path / "policy"
    assert _grpo(tiny_lm, prompts, "constant_reward", "--out", str(out)) == 1
    err = capsys.readouterr().err
    assert "error: step 1: the loss is nan (non-finite); stopping before the model is corrupted" in err, err
    assert not out.exists()


def test_export_with_non_finite_weights_is_refused(cpu_megatron, tiny_lm, tmp_path):
    """The online trainers' HF export (`loop.save_hf`, the converter's writer) refuses weights with NaN /
    Inf, naming the tensor, and leaves no folder."""
    from megatron_patch.inference import load_model
    from megatron_patch.rlhf.loop import save_hf

    model, cfg = load_model(None, tiny_lm)
    with torch.no_grad():
        model.decoder.layers[1].mlp.linear_fc2.weight[0, 0] = math.inf
    out = tmp_path / "policy"
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*(Inf|inf|non-finite)"):
        save_hf(model, cfg, tiny_lm, str(out))
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_help_describes_grpo_alone(capsys):
    """GRPO trains one model and has no value head: its --help says nothing of a value head, a critic or "each
    model" (options it shares with PPO say what they do here); PPO's still names its value head's seed."""
    from megatron_patch.rlhf import grpo, ppo

    with pytest.raises(SystemExit):
        grpo.main(["--help"])
    text = capsys.readouterr().out
    assert "--seed" in text and "--clip-grad" in text
    for word in ("value head", "critic", "each model"):
        assert word not in text, word
    assert "value head" in ppo.parser().format_help()


def test_resume_equals_an_uninterrupted_run(cpu_megatron, tiny_lm, prompts, tmp_path, capsys):
    """GRPO keeps checkpoints like PPO (`rlhf.checkpoint`, through the shared loop): 2 steps saved, then resumed
    to 3, give the uninterrupted 3-step run's history and weights bit for bit."""
    from megatron_patch.conversion.hf_io import read_all

    straight, resumed, ckpt = (str(tmp_path / n) for n in ("straight", "resumed", "ckpt"))
    fast = ("--lr", "3e-3", "--epochs", "2")
    assert _grpo(tiny_lm, prompts, "constant_reward", "--steps", "3", "--out", straight, *fast) == 0
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert _grpo(tiny_lm, prompts, "constant_reward", "--steps", "2", "--save", ckpt, "--save-interval", "1",
                 *fast) == 0
    assert open(tmp_path / "ckpt" / "latest").read().strip() == "2"
    capsys.readouterr()
    assert _grpo(tiny_lm, prompts, "constant_reward", "--steps", "3", "--load", ckpt, "--save", ckpt, "--out",
                 resumed, *fast) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["resumed_at"] == 2 and again["history"] == whole["history"]
    assert len({row["loss"] for row in whole["history"]}) > 1  # the steps trained on different policies
    x, y = read_all(straight), read_all(resumed)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert any(not torch.equal(x[k], v) for k, v in read_all(tiny_lm).items())  # trained


def test_moe_actor_rollouts_run_dropless_with_the_same_history(cpu_megatron, prompts, tmp_path, capsys,
                                                               monkeypatch):
    """GRPO with a small Mixtral actor: with `dynamic.MOE_DROPLESS` its rollouts run through the dropless MoE layers
    (`inference/moe_dropless.py`, on the weights where the training wrappers keep them, between optimizer steps)
    and two steps give the same history and the same exported weights, bit for bit, as megatron-core's
    dispatchers (fp32 on a CPU: the same products and sums)."""
    from megatron_patch.conversion.hf_io import copy_side_files, read_all
    from megatron_patch.inference import dynamic, moe_dropless
    from megatron_patch.tokenizer import TINY_TOKENIZER
    from tests.helpers import count_calls
    from tests.models import any_config, hf_model, save_hf

    actor = str(tmp_path / "mixtral")
    save_hf(hf_model(any_config("mixtral"), 0), actor)
    copy_side_files(TINY_TOKENIZER, actor, ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    calls = count_calls(monkeypatch, moe_dropless.DroplessDispatcher, "dispatch_postprocess")
    runs = {}
    for dropless in (False, True):
        monkeypatch.setattr(dynamic, "MOE_DROPLESS", dropless)
        calls.clear()
        out = str(tmp_path / f"policy-{dropless}")
        assert _grpo(actor, prompts, "content_reward", "--steps", "2", "--out", out, "--lr", "3e-3") == 0
        dynamic.release_engine()
        runs[dropless] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["history"], read_all(out), \
            len(calls)
    assert runs[False][2] == 0 and runs[True][2] > 0
    assert runs[True][0] == runs[False][0] and len({row["loss"] for row in runs[True][0]}) > 1
    x, y = runs[False][1], runs[True][1]
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert any(not torch.equal(x[k], v) for k, v in read_all(actor).items())  # trained
