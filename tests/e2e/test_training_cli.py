"""The training entry points as commands (`python -m megatron_patch.pretrain / .sft / .rlhf.reward_model /
.rlhf.dpo`): `--help` works and lists our options first; bad input is one `error:` line with exit status 1;
a machine without a GPU needs `--cpu` (one up-front error otherwise). The README's training commands run
at tiny sizes with `--cpu` in tests/e2e/test_readme.py."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_patch.tokenizer import CORPUS, TINY_TOKENIZER
from tests import _cpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, TORCHDYNAMO_DISABLE="1")
ENTRIES = {"pretrain": "megatron_patch.pretrain", "sft": "megatron_patch.sft",
           "reward_model": "megatron_patch.rlhf.reward_model", "dpo": "megatron_patch.rlhf.dpo"}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny HF model with the tiny tokenizer, 400 corpus documents and preference rows."""
    from megatron_patch.conversion.hf_io import copy_side_files
    from tests.helpers import preferences
    from tests.models import hf_model, llama_config, save_hf

    root = tmp_path_factory.mktemp("training_cli")
    save_hf(hf_model(llama_config("gqa")), str(root / "model"))
    copy_side_files(TINY_TOKENIZER, str(root / "model"), ["tokenizer.json", "tokenizer_config.json",
                                                          "special_tokens_map.json"])
    with gzip.open(CORPUS, "rt") as f, open(root / "corpus.jsonl", "w") as out:
        for _, line in zip(range(400), f):
            out.write(line)
    (root / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in preferences(40, 0)))
    return root


def test_help_lists_our_options_first():
    """`--help` works on every entry point (megatron-core 0.19.2 has a help string with a stray `%` that
    made argparse raise) and lists our options before Megatron-LM's several hundred."""
    script = ("import contextlib, importlib, io, json, sys\n"
              "out = {}\n"
              f"for name, module in {ENTRIES!r}.items():\n"
              "    buf = io.StringIO()\n"
              "    with contextlib.redirect_stdout(buf):\n"
              "        try:\n"
              "            importlib.import_module(module).main(['--help'])\n"
              "        except SystemExit as e:\n"
              "            out[name] = (e.code, buf.getvalue())\n"
              "print(json.dumps(out))\n")
    p = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    helps = json.loads(p.stdout.strip().splitlines()[-1])
    own = {"pretrain": [], "sft": ["--sft-data"], "reward_model": ["--pref-data"], "dpo": ["--pref-data", "--beta"]}
    for name, (code, text) in helps.items():
        assert code in (0, None), (name, text)
        assert text.startswith(f"usage: python -m {ENTRIES[name]} [--hf-config PATH]"), text[:300]
        megatron = text.index("--tensor-model-parallel-size TENSOR_MODEL_PARALLEL_SIZE\n")
        for flag in ("--hf-config", "--load-hf", "--save-hf", "--precision", "--cpu", *own[name]):
            assert -1 < text.index(f"  {flag}") < megatron, (name, flag)
        assert "--moe-paged-stash-buffer-size-factor-cuda" in text  # the help string with the stray %


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible")
def test_no_gpu_without_cpu_is_one_error_line(tmp_path):
    """Without --cpu on a machine with no CUDA GPU: one `error:` line before megatron initialises (not
    megatron's `AssertionError: Megatron requires CUDA.` traceback 20-30 s later)."""
    from megatron_patch.testing import TINY_LLAMA

    p = subprocess.run([sys.executable, "-m", "megatron_patch.pretrain", "--hf-config", TINY_LLAMA, "--mock-data"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == "error: no CUDA GPU found; pass --cpu to run a tiny model on the CPU"
    assert "Traceback" not in p.stderr and "initializing torch distributed" not in p.stdout


def _errors(rank: int, cases: list[tuple[str, list[str]]]) -> list[tuple[int, str]]:
    """(exit status, stderr) of each entry point's `main(argv)` in this process."""
    import importlib

    out = []
    for entry, argv in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = importlib.import_module(ENTRIES[entry]).main(argv)
        out.append((code, err.getvalue()))
    return out


def test_bad_input_is_one_error_line(work, tmp_path):
    """Each bad input: exit status 1 and one `error:` line naming the flag, file or split, no traceback;
    all before megatron initialises (a dataset builder that would loop forever, a division by zero, a bare
    assertion of megatron's are among them)."""
    from megatron_patch.preprocess_data import preprocess

    with open(work / "corpus.jsonl") as f, open(tmp_path / "small.jsonl", "w") as out:
        for _, line in zip(range(50), f):
            out.write(line)
    small = preprocess([str(tmp_path / "small.jsonl")], str(tmp_path / "small"), TINY_TOKENIZER, append_eod=True)
    big = preprocess([str(work / "corpus.jsonl")], str(tmp_path / "big"), TINY_TOKENIZER, append_eod=True)
    no_tokenizer = tmp_path / "bare"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text(open(work / "model" / "config.json").read())
    model = str(work / "model")
    base = ["--cpu", "--hf-config", model, "--data-path", big["data_path"], "--seq-length", "64",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3"]
    cases = {
        "--make-vocab-size-divisible-by must be at least 1, got 0": (
            "pretrain", ["--make-vocab-size-divisible-by", "0"]),
        "--micro-batch-size must be at least 1, got 0": ("pretrain", ["--micro-batch-size", "0"]),
        "--lr must be a finite number, got nan": ("pretrain", ["--lr", "nan"]),
        "--min-lr 0.1 is above --lr 0.001": ("pretrain", ["--min-lr", "0.1"]),
        "--eval-interval must be at least 1, got 0": ("pretrain", ["--eval-interval", "0"]),
        "(megatron/training/arguments.py:": ("pretrain", ["--global-batch-size", "3"]),  # megatron's assertion
        "--transformer-impl transformer_engine cannot run on the CPU": (
            "pretrain", ["--transformer-impl", "transformer_engine"]),
        "--use-distributed-optimizer cannot run on the CPU": ("pretrain", ["--use-distributed-optimizer"]),
        "--sequence-parallel cannot run on the CPU": ("pretrain", ["--sequence-parallel"]),
        "--distributed-backend nccl cannot run on the CPU": ("pretrain", ["--distributed-backend", "nccl"]),
        f"the validation split of {small['data_path']} is empty: --split 99,1,0 gives it documents 50..50 of 50": (
            "pretrain", ["--data-path", small["data_path"]]),
        f"the test split of {small['data_path']} is empty": (
            "pretrain", ["--data-path", small["data_path"], "--split", "949,50,1"]),
        "--eval-iters 3: there is no validation data to evaluate on (--split 100,0,0 gives validation no share)": (
            "pretrain", ["--split", "100,0,0", "--eval-iters", "3"]),
        "--split '0,0,0': expected up to three shares": ("pretrain", ["--split", "0,0,0"]),
        f"no tokenizer: {no_tokenizer} holds none": ("pretrain", ["--hf-config", str(no_tokenizer)]),
        f"dataset prefix {tmp_path / 'nope'}: no": ("pretrain", ["--data-path", str(tmp_path / "nope")]),
        "no SFT data: pass --sft-data": ("sft", ["--load-hf", model]),
        "--sft-weight must be a finite number >= 0, got -1.0": (
            "dpo", ["--load-hf", model, "--pref-data", str(work / "prefs.jsonl"), "--sft-weight", "-1"]),
    }
    runs = [(entry, base + argv) for entry, argv in cases.values()]
    results = _cpu.run_world(1, _errors, runs)[0]
    for match, (code, err) in zip(cases, results):
        lines = err.strip().splitlines()
        assert code == 1 and lines and lines[-1].startswith("error: ") and match in lines[-1], (match, err[-2000:])
        assert "Traceback" not in err, err
