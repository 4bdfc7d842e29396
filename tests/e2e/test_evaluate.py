"""python -m megatron_patch.evaluate: perplexity equals exp(mean token loss) computed independently
with transformers; the multiple-choice scorer picks the answer known by construction and scores
`" " + choice` without doubling a space; bad input (malformed multiple-choice rows, named by line; an
unwritable --report) is refused before the model loads; --report is written whole."""

import gzip
import json
import math
import os

import pytest
import torch

from megatron_patch.convert import main as convert
from megatron_patch.tokenizer import CORPUS, TINY_TOKENIZER, build_tokenizer
from tests.models import hf_model, llama_config, save_hf


@pytest.fixture(scope="module")
def setup(tmp_path_factory, cpu_megatron):
    root = tmp_path_factory.mktemp("eval")
    hf = hf_model(llama_config("gqa"))
    hf_dir = save_hf(hf, str(root / "hf"))
    tok = build_tokenizer(TINY_TOKENIZER)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (root / "hf" / name).write_bytes((open(f"{TINY_TOKENIZER}/{name}", "rb")).read())
    mc = str(root / "mc")
    assert convert(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--tp", "2", "--pp", "2"]) == 0
    with gzip.open(CORPUS, "rt") as f:
        texts = [json.loads(next(f))["text"][:600] for _ in range(4)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root, hf, tok, texts, mc


def _hf_logprobs(hf, ids):
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_perplexity_is_exp_mean_token_loss(setup, capsys):
    from megatron_patch.evaluate import main

    root, hf, tok, texts, mc = setup
    assert main(["--mcore-dir", mc, "--text", str(root / "docs.jsonl"), "--seq-length", "64",
                 "--report", str(root / "r.json")]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["perplexity"]
    nll, n = 0.0, 0
    for t in texts:  # independently: transformers on the same 65-token windows
        ids = tok.tokenize(t)
        for s in range(0, len(ids) - 1, 64):
            w = ids[s: s + 65]
            if len(w) > 1:
                lp = _hf_logprobs(hf, w)
                nll, n = nll - lp.sum().item(), n + lp.numel()
    assert got["tokens"] == n
    assert abs(got["loss"] - nll / n) <= 1e-5 and abs(got["perplexity"] - math.exp(nll / n)) <= 1e-4 * got["perplexity"]
    assert json.load(open(root / "r.json"))["perplexity"] == got


def test_multiple_choice_picks_the_known_answer(setup, capsys):
    """Each question's answer is, by construction, the choice transformers gives the highest
    log-likelihood (distractors are the other choices); the scorer must find it every time."""
    from megatron_patch.evaluate import main

    root, hf, tok, texts, mc = setup
    rows = []
    for t in texts:
        words = t.split()
        question, choices = " ".join(words[:12]), [" ".join(words[12 + 3 * k: 15 + 3 * k]) for k in range(4)]
        ctx = tok.tokenize(question)
        scores = [_hf_logprobs(hf, ctx + tok.tokenize(" " + c))[len(ctx) - 1:].sum().item() for c in choices]
        rows.append({"question": question, "choices": choices, "answer": max(range(4), key=scores.__getitem__)})
    (root / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--hf-dir", str(root / "hf"), "--choices", str(root / "mc.jsonl")]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["multiple_choice"]
    assert got["acc"] == 1.0 and got["questions"] == 4


def test_bad_input(setup, tmp_path, capsys):
    from megatron_patch.evaluate import main

    root, *_ , mc = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "choices": ["a"]}\n')
    for argv, match in [(["--mcore-dir", str(tmp_path / "none"), "--text", str(root / "docs.jsonl")], "does not exist"),
                        (["--mcore-dir", mc, "--choices", str(bad)], "needs question, choices and answer"),
                        (["--mcore-dir", mc], "nothing to evaluate")]:
        assert main(argv) == 1
        assert match in capsys.readouterr().err


def test_tp2_under_torchrun_matches_tp1(setup, capsys):
    """`torchrun --nproc-per-node 2 -m megatron_patch.evaluate --tp 2` (gloo on CPU): same perplexity."""
    import os
    import subprocess
    import sys

    from megatron_patch.evaluate import main

    root, *_, mc = setup
    argv = ["--mcore-dir", mc, "--text", str(root / "docs.jsonl"), "--seq-length", "64"]
    assert main(argv) == 0
    tp1 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["perplexity"]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                        "megatron_patch.evaluate", *argv, "--tp", "2"], capture_output=True, text=True,
                       env={**os.environ, "TORCHDYNAMO_DISABLE": "1"}, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    tp2 = json.loads(p.stdout.strip().splitlines()[-1])["perplexity"]
    assert tp2["tokens"] == tp1["tokens"] and abs(tp2["loss"] - tp1["loss"]) <= 1e-5


def _model_never_loads(*args, **kwargs):
    raise RuntimeError("the model was loaded")


BAD_CHOICES = [
    ({"question": "q", "choices": ["a", "b"], "answer": 2}, "'answer' 2 is out of range for 2 choices (0-based: 0..1)"),
    ({"question": "q", "choices": "ab", "answer": 0}, "'choices' must be a list of strings, got a string"),
    ({"question": "q", "choices": ["a", "b"], "answer": True},
     "'answer' must be the 0-based index of the right choice, got true"),
    ({"question": "q", "choices": ["a", "b"], "answer": "1"},
     "'answer' must be the 0-based index of the right choice, got \"1\""),
    ({"question": "q", "choices": [], "answer": 0}, "'choices' is empty"),
    ({"question": "q", "choices": ["a", 2], "answer": 0}, "choice 1 must be a string, got 2"),
    ({"question": 3, "choices": ["a"], "answer": 0}, "'question' must be a string, got 3"),
    ({"question": "q", "choices": ["a"]}, "needs question, choices and answer (missing answer)"),
    (["q", ["a"], 0], "needs question, choices and answer (missing question, choices, answer)"),
]


@pytest.mark.parametrize("row,match", BAD_CHOICES, ids=[m.split(" ")[0] for _, m in BAD_CHOICES])
def test_bad_multiple_choice_row_is_refused_with_its_line(setup, tmp_path, capsys, monkeypatch, row, match):
    from megatron_patch.evaluate import main

    *_, mc = setup
    monkeypatch.setattr("megatron_patch.inference.load_model", _model_never_loads)
    path = tmp_path / "mc.jsonl"
    path.write_text(json.dumps({"question": "q", "choices": ["a", "b"], "answer": 1}) + "\n\n" + json.dumps(row) + "\n")
    assert main(["--mcore-dir", mc, "--choices", str(path)]) == 1
    assert f"error: {path}, line 3: {match}" in capsys.readouterr().err


def test_choice_is_scored_after_one_space(setup):
    """`" " + choice` is the continuation, but a space already at the boundary is not doubled; the
    scorer tokenizes exactly those continuations."""
    from megatron_patch.evaluate import Question, Scorer, continuation
    from megatron_patch.inference import load_model
    from megatron_patch.models import Layout, get_family

    root, hf, tok, texts, mc = setup
    assert continuation("Q:", "yes") == " yes" and continuation("Q:", " yes") == " yes"
    assert continuation("Q: ", "yes") == "yes" and continuation("Q:", "\nyes") == "\nyes"
    model, cfg = load_model(mc, None)
    seen = []

    def tokenize(text):
        seen.append(text)
        return tok.tokenize(text)

    got = Scorer(model, get_family(cfg).shapes(cfg, Layout()).vocab_size).multiple_choice(
        [Question("The answer is", ["yes", " no", "\tmaybe"], 0)], tokenize)
    assert seen == ["The answer is", " yes", " no", "\tmaybe"] and got["questions"] == 1


def test_report_is_checked_first_and_written_whole(setup, tmp_path, capsys, monkeypatch):
    from megatron_patch.evaluate import main

    root, *_, mc = setup
    (tmp_path / "a_file").write_text("")
    with monkeypatch.context() as m:
        m.setattr("megatron_patch.inference.load_model", _model_never_loads)
        for report, match in [(tmp_path, "is a folder"), (tmp_path / "missing" / "r.json", "does not exist"),
                              (tmp_path / "a_file" / "r.json", "is a file, not a folder")]:
            assert main(["--mcore-dir", mc, "--text", str(root / "docs.jsonl"), "--report", str(report)]) == 1
            err = capsys.readouterr().err
            assert f"error: --report {report}" in err and match in err, err
    report = tmp_path / "r.json"
    old = os.umask(0o027)
    try:
        assert main(["--mcore-dir", mc, "--text", str(root / "docs.jsonl"), "--seq-length", "64",
                     "--report", str(report)]) == 0
    finally:
        os.umask(old)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.load(open(report)) == {"perplexity": summary["perplexity"]}
    assert os.stat(report).st_mode & 0o777 == 0o640 and sorted(os.listdir(tmp_path)) == ["a_file", "r.json"]
