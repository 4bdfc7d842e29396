"""Data builders shared by the CPU tests (fixtures over them live in tests/conftest.py): preference rows
with a learnable rule, chats with a learnable rule, the arguments of a tiny CPU pretraining run and the
bundled corpus as an indexed dataset; the rotary-embedding table and float64 reference of the decode RoPE kernel's
tests (CPU and GPU); running a file's Triton kernel tests under Triton's interpreter. Tests import these, never each
other."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys

import pytest
import torch

from megatron_patch.testing import TINY_LLAMA
from megatron_patch.tokenizer import CORPUS, TINY_TOKENIZER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Triton reads TRITON_INTERPRET when it is imported: kernel tests run in a process that set it first
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
GOOD = "yes right good fine true correct".split()
BAD = "no wrong bad poor false broken".split()
TOPICS = "the module returns a list of values when the function is called".split()
WORDS = ("the module returns a list of values when the function is called with an argument and the "
         "interpreter raises an error if the name is not defined in the current scope").split()


def preferences(n: int, seed: int) -> list[dict]:
    """Chosen answers use words from GOOD, rejected ones from BAD (random order and length)."""
    g = torch.Generator().manual_seed(seed)

    def words(pool, k):
        return " ".join(pool[int(i)] for i in torch.randint(0, len(pool), (k,), generator=g))

    rows = []
    for _ in range(n):
        k = int(torch.randint(2, 6, (1,), generator=g))
        rows.append({"prompt": "Is " + words(TOPICS, 3) + "?", "chosen": words(GOOD, k), "rejected": words(BAD, k)})
    return rows


def conversations(n: int, seed: int = 0) -> list[dict]:
    """Synthetic chats (and instruction rows) whose answers follow a learnable rule: repeat the words."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        k = int(torch.randint(3, 12, (1,), generator=g))
        words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (k,), generator=g)]
        text = " ".join(words)
        if i % 3 == 2:
            out.append({"instruction": "Repeat the text.", "input": text, "output": text})
        else:
            out.append({"messages": [{"role": "system", "content": "You repeat."},
                                     {"role": "user", "content": f"Repeat: {text}"},
                                     {"role": "assistant", "content": text}]})
    return out


def corpus_dataset(root: str, documents: int = 400) -> str:
    """The first `documents` documents of the bundled corpus as a Megatron indexed dataset; its prefix."""
    from megatron_patch.preprocess_data import preprocess

    with gzip.open(CORPUS, "rt") as f, open(os.path.join(root, "docs.jsonl"), "w") as out:
        for _, line in zip(range(documents), f):
            out.write(line)
    preprocess([os.path.join(root, "docs.jsonl")], os.path.join(root, "docs"), TINY_TOKENIZER, append_eod=True)
    return os.path.join(root, "docs_text_document")


def pretrain_argv(data: str, save: str, *extra: str, model=("--hf-config", TINY_LLAMA)) -> list[str]:
    """A tiny CPU pretraining run of `python -m megatron_patch.pretrain`: 15 iterations of 2 micro-batches,
    saved every 10; `extra` comes last (it wins)."""
    return [*model, "--data-path", data, "--split", "100,0,0", "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", TINY_TOKENIZER, "--seq-length", "64", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "15", "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--transformer-impl", "local",
            "--use-cpu-initialization", "--no-masked-softmax-fusion",
            "--no-persist-layer-norm", "--no-rope-fusion", "--no-bias-swiglu-fusion", "--distributed-backend",
            "gloo", "--num-workers", "0", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
            "--save", save, "--save-interval", "10", "--seed", "1234", "--data-cache-path",
            os.path.join(os.path.dirname(save), "cache"), *extra]


def tiny_lm_folder(path: str, variant: str = "gqa", reward: bool = False, seed: int = 0) -> str:
    """A tiny random causal LM (a `tests.models` LLaMA variant; with `reward`, that model as a one-label
    reward model, `...ForSequenceClassification`) saved as an HF folder together with the tiny tokenizer's
    files."""
    from megatron_patch.conversion.hf_io import copy_side_files
    from megatron_patch.models.reward import as_reward_config
    from tests.models import hf_model, llama_config, save_hf

    cfg = llama_config(variant)
    save_hf(hf_model(as_reward_config(cfg) if reward else cfg, seed), path)
    copy_side_files(TINY_TOKENIZER, path, ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    return path


def ppo_steps(rank: int, argv: list[str], steps: int = 2) -> list[tuple[dict, list]]:
    """`steps` PPO steps on this rank (a `_cpu.run_world` worker): each step's metrics and the rollouts' tokens."""
    from megatron_patch.rlhf.loop import OnlineRL
    from megatron_patch.rlhf.ppo import PPO, parser

    trainer = OnlineRL(parser().parse_args(argv), PPO)
    out = []
    for step in range(steps):
        row, rollouts = trainer.step(step)
        out.append((row, rollouts.tokens.tolist()))
    return out


def rope_table(rot: int, positions: int, device: str = "cpu") -> torch.Tensor:
    """megatron-core's rotary angle table [positions, 1, 1, rot] (fp32, `cat(f, f)`, Llama-3's base 500,000)."""
    inv = 1.0 / (500000.0 ** (torch.arange(0, rot, 2, device=device, dtype=torch.float32) / rot))
    angles = torch.outer(torch.arange(positions, device=device, dtype=torch.float32), inv)
    return torch.cat([angles, angles], -1)[:, None, None, :].contiguous()


def rope_reference(x: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float64: x [n, ..., d] (token i at angle table row positions[i], of [., 1, 1, r]); the
    first r dimensions rotate, the rest pass through."""
    f = freqs[positions.long(), 0, 0].double().view(x.shape[0], *[1] * (x.dim() - 2), -1)
    half = f.shape[-1] // 2
    x = x.double()
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * f[..., :half].cos() - x2 * f[..., :half].sin(),
                      x2 * f[..., half:].cos() + x1 * f[..., half:].sin(), rest], -1)


def count_calls(monkeypatch, owner, name: str) -> list:
    """`owner.name` wrapped (for the test) to append 1 to the returned list at each call."""
    calls, original = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    return calls


def run_interpreted(test_file: str, keywords: str) -> None:
    """`test_file`'s tests matching `keywords` (pytest -k) in a process with TRITON_INTERPRET=1: all pass, none
    skipped (those tests skip themselves unless INTERPRETED). Skips where Triton is not installed, and in that
    process itself."""
    pytest.importorskip("triton")
    if INTERPRETED:
        pytest.skip("this is that process")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", keywords,
                        os.path.abspath(test_file)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and "skipped" not in p.stdout.splitlines()[-1], p.stdout[-500:]
