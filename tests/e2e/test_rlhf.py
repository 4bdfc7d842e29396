"""RLHF on CPU with tiny models: the reward model learns a preference rule (≥ 90% pairwise accuracy on
held-out pairs, scored through the exported HF `AutoModelForSequenceClassification` and our checkpoint
alike), DPO raises the implicit reward margin and accuracy on held-out pairs and its loss matches a hand
computation, GRPO raises the mean reward of a rule-based task, and bad preference rows are refused."""

import contextlib
import io
import json
import math

import pytest
import torch

from megatron_patch.tokenizer import TINY_TOKENIZER, build_tokenizer
from tests import _cpu
from tests.helpers import preferences

CPU_ARGS = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", TINY_TOKENIZER, "--transformer-impl",
            "local", "--use-cpu-initialization", "--no-masked-softmax-fusion", "--no-persist-layer-norm",
            "--no-rope-fusion", "--no-bias-swiglu-fusion", "--distributed-backend", "gloo", "--num-workers", "0",
            "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234",
            "--lr-decay-style", "constant", "--make-vocab-size-divisible-by", "4"]


def _train(rank: int, entry: str, argv: list[str]) -> dict:
    """One megatron.training run of an RLHF entry point; returns the logged metrics per iteration."""
    _cpu.install_training()
    import importlib

    logged = _cpu.record_train_steps()
    with contextlib.redirect_stdout(io.StringIO()):
        assert importlib.import_module(f"megatron_patch.rlhf.{entry}").main(argv) == 0
    return {"logged": logged}


def _pairs(tok, path: str, seq: int) -> dict:
    """All pairs of a preference file as one flattened batch (rows chosen_0, rejected_0, ...)."""
    from megatron_patch.rlhf.data import PreferenceDataset, flatten_pairs, read_preferences

    ds = PreferenceDataset(read_preferences([path], tok), seq, tok.pad)
    return flatten_pairs(torch.utils.data.default_collate([ds[i] for i in range(len(ds))]))


def test_reward_model_learns_the_rule(tiny_lm, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from megatron_patch.inference import load_model
    from megatron_patch.models.reward import scored_values
    from megatron_patch.runtime.logits import megatron_logits

    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in preferences(400, 0)))
    held.write_text("".join(json.dumps(r) + "\n" for r in preferences(64, 1)))
    argv = ["--load-hf", tiny_lm, "--pref-data", str(train), "--seq-length", "32", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--train-iters", "40", "--lr", "2e-3", "--save", str(tmp_path / "ckpt"),
            "--save-interval", "40", "--save-hf", str(tmp_path / "rm_hf"), *CPU_ARGS]
    logged = _cpu.run_world(1, _train, "reward_model", argv)[0]["logged"]
    assert len(logged) == 40 and {"rm loss", "accuracy", "margin"} <= set(logged[0])
    tok = build_tokenizer(TINY_TOKENIZER)
    batch = _pairs(tok, str(held), 32)
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm_hf")).eval()
    with torch.no_grad():  # each pair as a user scores it with the exported model: unpadded, HF's own pooling
        theirs = torch.stack([hf(input_ids=batch["tokens"][i: i + 1, :n]).logits[0, 0]
                              for i, n in enumerate(batch["lengths"])])
    model, cfg = load_model(str(tmp_path / "ckpt"), None)
    assert cfg["architectures"] == ["LlamaForSequenceClassification"]
    ours = scored_values(megatron_logits(model, batch["tokens"], 1), batch["tokens"], batch["lengths"],
                         cfg["pad_token_id"])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    accuracy = float((ours.view(-1, 2)[:, 0] > ours.view(-1, 2)[:, 1]).float().mean())
    assert accuracy >= 0.9, (accuracy, logged[-1])


def test_prompt_and_answer_are_joined_as_the_readmes_say():
    """How a preference row becomes tokens, as rlhf/README.md and megatron_patch/rlhf/README.md say: plain text is
    the prompt's tokens, then the answer's, then the end-of-document token, each text tokenized alone with nothing
    put between them (so a prompt that wants a separator ends with it); only the answer and the end token are
    trained on. Chat rows (or --chat) are the chat template's rendering of a user turn and an assistant turn."""
    import os

    from megatron_patch.rlhf.data import encode

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    said = "the prompt's tokens, then the answer's, then the end-of-document token"
    for readme in ("rlhf/README.md", "megatron_patch/rlhf/README.md"):
        text = " ".join(open(os.path.join(root, readme), encoding="utf-8").read().split())
        assert said in text and "nothing is put between them" in text, readme
    tok = build_tokenizer(TINY_TOKENIZER)
    prompt, answer = "Is the module right?", "Yes, it returns a list."
    ids, mask = encode(tok, prompt, answer, chat=False)
    head, tail = tok.tokenize(prompt), tok.tokenize(answer)
    assert ids == head + tail + [tok.eod] and mask == [0] * len(head) + [1] * (len(tail) + 1)
    assert ids[:-1] != tok.tokenize(prompt + " " + answer)  # no space put in
    ids, mask = encode(tok, [{"role": "user", "content": prompt}], answer, chat=False)
    enc = tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}])
    assert (ids, mask) == (list(enc.ids), list(enc.loss_mask)) == encode(tok, prompt, answer, chat=True)


def test_bad_preference_rows(tmp_path):
    from megatron_patch.rlhf.data import read_preferences

    tok = build_tokenizer(TINY_TOKENIZER)
    for row, match in [({"prompt": "a", "chosen": "b"}, "missing rejected"),
                       ({"prompt": "a", "chosen": " ", "rejected": "c"}, "empty 'chosen'"),
                       ({"prompt": "a", "chosen": "b", "rejected": ""}, "empty 'rejected'")]:
        path = tmp_path / "p.jsonl"
        path.write_text(json.dumps({"prompt": "x", "chosen": "y", "rejected": "z"}) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(ValueError, match=f"row 2: {match}"):
            read_preferences([str(path)], tok)


def test_dpo_loss_matches_hand_computation():
    from megatron_patch.rlhf.dpo import dpo_loss, loss_func

    policy = torch.tensor([[-10.0, -12.0], [-7.5, -7.0]])
    ref = torch.tensor([[-11.0, -11.5], [-7.0, -8.0]])
    beta = 0.2
    loss, chosen, rejected = dpo_loss(policy, ref, beta)
    for i in range(2):
        z = beta * ((policy[i, 0] - ref[i, 0]) - (policy[i, 1] - ref[i, 1]))
        assert abs(float(loss[i]) - math.log(1 + math.exp(-float(z)))) < 1e-6
    assert torch.allclose(chosen, beta * (policy[:, 0] - ref[:, 0]))
    # through megatron's loss protocol: per-token losses whose masked sums are -policy
    token_loss = torch.zeros(4, 3)
    token_loss[:, 1] = -policy.reshape(-1)
    mask = torch.tensor([[0.0, 1, 0]] * 4)
    total, n, report = loss_func(mask, ref.reshape(-1), beta, 0.0, token_loss)
    assert int(n) == 2 and abs(float(total) - float(loss.sum())) < 1e-6
    assert report["reward accuracy"].tolist() == [1.0, 2.0]  # pair 0 prefers chosen, pair 1 does not


def _held_out_margins(policy, reference, batch, beta: float) -> tuple[float, float]:
    from megatron_patch.runtime.logits import megatron_logits

    def logps(model):
        logits = megatron_logits(model, batch["tokens"], 1000).log_softmax(-1)
        token = logits.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
        return (token * batch["loss_mask"]).sum(-1).view(-1, 2)

    p, r = logps(policy), logps(reference)
    margin = beta * ((p[:, 0] - r[:, 0]) - (p[:, 1] - r[:, 1]))
    return float(margin.mean()), float((margin > 0).float().mean())


def test_dpo_raises_margin_and_accuracy_on_held_out_pairs(tiny_lm, tmp_path):
    from megatron_patch.inference import load_model

    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in preferences(400, 0)))
    held.write_text("".join(json.dumps(r) + "\n" for r in preferences(64, 1)))
    argv = ["--load-hf", tiny_lm, "--pref-data", str(train), "--seq-length", "32", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--train-iters", "30", "--lr", "1e-3", "--beta", "0.1", "--save",
            str(tmp_path / "ckpt"), "--save-interval", "30", *CPU_ARGS]
    logged = _cpu.run_world(1, _train, "dpo", argv)[0]["logged"]
    # the policy starts as the reference (the two forward passes differ only in fp32 rounding)
    assert len(logged) == 30 and abs(logged[0]["reward margin"]) < 1e-3
    assert abs(logged[0]["dpo loss"] - math.log(2)) < 1e-3
    batch = _pairs(build_tokenizer(TINY_TOKENIZER), str(held), 32)
    policy, _ = load_model(str(tmp_path / "ckpt"), None)
    reference, _ = load_model(None, tiny_lm)
    margin, accuracy = _held_out_margins(policy, reference, batch, 0.1)
    assert margin > 0.5 and accuracy >= 0.9, (margin, accuracy, logged[-1])


_TOK = []


def toy_reward(prompt: str, completion: str) -> float:
    """The toy rule for GRPO: the share of the completion's tokens with an id below 200."""
    if not _TOK:
        _TOK.append(build_tokenizer(TINY_TOKENIZER))
    ids = _TOK[0].tokenize(completion)
    return sum(i < 200 for i in ids) / max(len(ids), 1)


def test_grpo_raises_the_mean_reward(cpu_megatron, tiny_lm, tmp_path, capsys):
    from megatron_patch.rlhf.grpo import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ["The module", "A list of", "When the function", "def f(x):"]))
    out = tmp_path / "policy"
    assert main(["--hf-dir", tiny_lm, "--prompts", str(prompts), "--reward", "tests.e2e.test_rlhf:toy_reward",
                 "--steps", "30", "--prompts-per-step", "4", "--group-size", "8", "--max-new-tokens", "8",
                 "--lr", "3e-3", "--kl-coef", "0.01", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["reward_last"] > summary["reward_first"] + 0.3, summary
    # the exported policy is an HF model that differs from the start
    from megatron_patch.conversion.hf_io import read_all

    start, end = read_all(tiny_lm), read_all(str(out))
    assert start.keys() == end.keys() and any(not torch.equal(start[k], end[k]) for k in start)


def test_grpo_advantages_and_loss_by_hand():
    from megatron_patch.rlhf.grpo import group_advantages, grpo_loss

    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-3)
    logps = torch.tensor([[-1.0, -2.0], [-1.5, -0.5]])
    old = logps.clone()
    mask = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    loss, kl = grpo_loss(logps, old, logps.clone(), torch.tensor([2.0, -1.0]), mask, 0.2, 0.1)
    # ratio 1 and KL 0: loss = mean over rows of -A (each row's token mean)
    assert abs(float(loss) - (-2.0 + 1.0) / 2) < 1e-6 and kl == 0.0


def _entry_error(rank: int, entry: str, argv: list[str]) -> str:
    """What the entry point prints on stderr (its exit status must be 1)."""
    _cpu.install_training()
    import importlib

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = importlib.import_module(f"megatron_patch.rlhf.{entry}").main(argv)
    return err.getvalue() if code == 1 else f"exit status {code}"


def test_bad_input_refused_before_training(tiny_lm, tmp_path):
    """A tokenizer larger than the model's vocabulary, missing preference data, DPO with PP > 1, a DPO beta of
    0, evaluation without a validation set: each one `error:` line from the entry point, exit status 1."""
    small = tmp_path / "small.json"
    small.write_text(json.dumps({**json.load(open(f"{tiny_lm}/config.json")), "vocab_size": 500}))
    prefs = tmp_path / "p.jsonl"
    prefs.write_text(json.dumps(preferences(1, 0)[0]) + "\n")
    base = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1",
            "--lr", "1e-3", *CPU_ARGS]
    for entry, argv, match in [
        ("reward_model", ["--hf-config", str(small), "--pref-data", str(prefs)], "tokenizer has 1000 tokens"),
        ("dpo", ["--load-hf", tiny_lm], "no preference data"),
        ("dpo", ["--load-hf", tiny_lm, "--pref-data", str(prefs), "--pipeline-model-parallel-size", "2"],
         "pipeline parallelism is not supported"),
        ("dpo", ["--load-hf", tiny_lm, "--pref-data", str(prefs), "--beta", "0"],
         "--beta must be a finite number > 0"),
        ("reward_model", ["--load-hf", tiny_lm, "--pref-data", str(prefs), "--eval-iters", "5"],
         "--eval-iters 5: there is no validation data"),
    ]:
        err = _cpu.run_world(2 if "--pipeline-model-parallel-size" in argv else 1, _entry_error, entry,
                             base + argv)[0]
        assert match in err and err.strip().splitlines()[-1].startswith("error: "), (entry, err)
        assert "Traceback" not in err, err
