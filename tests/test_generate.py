"""python -m megatron_patch.generate on CPU: greedy continuations of a batch of prompts with different
lengths equal transformers' `generate` token for token (from a converted TP2xPP2 checkpoint, run at TP=1
and at TP=2); sampling with a fixed seed is reproducible; bad input is refused."""

import json

import pytest
import torch

from megatron_patch.tokenizer import TINY_TOKENIZER
from tests.models import hf_model, llama_config, save_hf
from toolkits.checkpoint_converter.__main__ import main as convert

PROMPTS = ["The interpreter", "A module is a file containing Python definitions and statements.", "def f(x):"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, cpu_megatron):
    root = tmp_path_factory.mktemp("gen")
    hf = hf_model(llama_config("gqa"))
    hf_dir = save_hf(hf, str(root / "hf"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (root / "hf" / name).write_bytes(open(f"{TINY_TOKENIZER}/{name}", "rb").read())
    mc = str(root / "mc")
    assert convert(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--tp", "2", "--pp", "2"]) == 0
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root, hf, mc


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_greedy_equals_transformers_generate(setup, capsys):
    from megatron_patch.generate import main
    from megatron_patch.tokenizer import build_tokenizer

    root, hf, mc = setup
    out = root / "greedy.jsonl"
    assert main(["--mcore-dir", mc, "--prompts", str(root / "prompts.jsonl"), "--out", str(out), "--greedy",
                 "--max-new-tokens", "12"]) == 0
    tok = build_tokenizer(TINY_TOKENIZER)
    for row, prompt in zip(_rows(out), PROMPTS):
        ids = tok.tokenize(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=tok.eod,
                          pad_token_id=tok.pad)[0, len(ids):].tolist()
        assert row["generated_tokens"] == ref, (prompt, row["generated_tokens"], ref)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["prompts"] == 3


def test_cli_in_a_plain_process_equals_the_in_process_run(setup):
    """As a user runs it on a CPU machine: a fresh process without the test harness's CUDA redirects
    (megatron's inference controller moves its buffers with `.cuda()`; the library's `cpu_cuda_calls`
    patch keeps them on the CPU). Same tokens as the greedy run checked against transformers above."""
    import os
    import subprocess
    import sys

    from megatron_patch.generate import main

    root, _, mc = setup
    argv = ["--mcore-dir", mc, "--prompts", str(root / "prompts.jsonl"), "--greedy", "--max-new-tokens", "12"]
    assert main([*argv, "--out", str(root / "in_process.jsonl")]) == 0
    p = subprocess.run([sys.executable, "-m", "megatron_patch.generate", *argv, "--out", str(root / "plain.jsonl")],
                       capture_output=True, text=True, env={**os.environ, "TORCHDYNAMO_DISABLE": "1"}, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert ([r["generated_tokens"] for r in _rows(root / "plain.jsonl")]
            == [r["generated_tokens"] for r in _rows(root / "in_process.jsonl")])


def test_sampling_is_reproducible(setup):
    from megatron_patch.generate import main

    root, _, mc = setup
    runs = []
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        assert main(["--hf-dir", str(root / "hf"), "--prompts", str(root / "prompts.jsonl"), "--out",
                     str(root / f"{name}.jsonl"), "--temperature", "1.0", "--top-k", "50", "--seed", seed,
                     "--max-new-tokens", "10"]) == 0
        runs.append([r["generated_tokens"] for r in _rows(root / f"{name}.jsonl")])
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_bad_input(setup, tmp_path, capsys):
    from megatron_patch.generate import main

    root, _, mc = setup
    notjson = tmp_path / "p.jsonl"
    notjson.write_text("hello\n")
    small = tmp_path / "small"
    small.mkdir()
    cfg = json.load(open(root / "hf" / "config.json"))
    for argv, match in [
        (["--mcore-dir", str(tmp_path / "none"), "--prompts", str(root / "prompts.jsonl")], "does not exist"),
        (["--mcore-dir", mc, "--prompts", str(notjson)], "line 1: not JSON"),
        (["--mcore-dir", mc, "--prompts", str(root / "prompts.jsonl"), "--impl", "transformer_engine"],
         "holds the local implementation's names"),
    ]:
        assert main(argv) == 1
        assert match in capsys.readouterr().err
    # a tokenizer with more tokens than the model's vocab
    json.dump({**cfg, "vocab_size": 500}, open(small / "config.json", "w"))
    model = hf_model({**llama_config("gqa"), "vocab_size": 500})
    model.save_pretrained(str(small))
    assert main(["--hf-dir", str(small), "--tokenizer", TINY_TOKENIZER, "--prompts", str(root / "prompts.jsonl")]) == 1
    assert "tokenizer has 1000 tokens but the model's vocab_size is 500" in capsys.readouterr().err


def _generate_tp2(rank: int, mc: str) -> list[list[int]]:
    from megatron_patch.inference import generate, load_model
    from megatron_patch.tokenizer import build_tokenizer
    from tests import _cpu

    _cpu.init_model_parallel(2, 1)
    model, _ = load_model(mc, None, 2, 1)
    tok = build_tokenizer(TINY_TOKENIZER)
    return generate(model, tok, [tok.tokenize(p) for p in PROMPTS], 12, top_k=1, stop_id=tok.eod)


def test_greedy_at_tp2_equals_transformers(setup):
    """The same batch at TP=2 (two gloo processes, the checkpoint's TP2 x PP2 resharded to TP2 x PP1)."""
    from megatron_patch.tokenizer import build_tokenizer
    from tests import _cpu

    root, hf, mc = setup
    tok = build_tokenizer(TINY_TOKENIZER)
    per_rank = _cpu.run_world(2, _generate_tp2, mc)
    for i, prompt in enumerate(PROMPTS):
        ids = tok.tokenize(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=tok.eod,
                          pad_token_id=tok.pad)[0, len(ids):].tolist()
        assert per_rank[0][i] == per_rank[1][i] == ref


def test_single_prompt_streams_to_terminal(setup, tmp_path, capsys):
    """--stream prints the text step by step to stderr; the streamed text is the final generation, and
    the library's per-step callback sees the tokens grow one at a time."""
    from megatron_patch.generate import main
    from megatron_patch.inference import generate, load_model
    from megatron_patch.tokenizer import build_tokenizer

    root, _, mc = setup
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": PROMPTS[1]}) + "\n")
    assert main(["--mcore-dir", mc, "--prompts", str(one), "--out", str(tmp_path / "o.jsonl"), "--greedy",
                 "--max-new-tokens", "8", "--stream"]) == 0
    row = _rows(tmp_path / "o.jsonl")[0]
    assert row["generated_text"] and capsys.readouterr().err.endswith(row["generated_text"] + "\n")
    tok = build_tokenizer(TINY_TOKENIZER)
    model, _ = load_model(mc, None)
    seen = []
    out = generate(model, tok, [tok.tokenize(PROMPTS[1])], 8, top_k=1, on_tokens=lambda i, t: seen.append((i, t)))
    assert [len(t) for _, t in seen] == list(range(1, len(out[0]) + 1)) and seen[-1] == (0, out[0])
