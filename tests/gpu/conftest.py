"""Fixtures shared by the GPU tests (run on the device machine: tests/gpu/run_suite.sh)."""

import gzip
import json
import os

import pytest
import torch

from tests.gpu.test_te import GPU_CFG


def pytest_runtest_logreport(report):
    """Each test's outcome and seconds as it finishes, one JSON line in `$GPU_REPORT.tests` (run_suite.sh: a call
    cut by its time limit still tells which tests ran, which failed and why, and what took the time)."""
    path = os.environ.get("GPU_REPORT")
    if path and (report.when == "call" or report.outcome != "passed"):
        row = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
               "seconds": round(report.duration, 1)}
        if report.failed:
            row["why"] = str(report.longrepr)[-1500:]
        with open(path + ".tests", "a") as f:
            f.write(json.dumps(row) + "\n")


def trained_hf_folder(path: str, steps: int = 400, device: str = "cuda") -> tuple[str, list[list[int]], float]:
    """A small LLaMA (GPU_CFG; end-of-text id 0, the tiny tokenizer's, where megatron's generation stops) trained
    briefly on the corpus, saved with the tiny tokenizer; 5 prompts of 3-64 tokens; the last loss. Random
    weights give near-ties everywhere, which any rounding difference flips: a trained model's choices are
    clear, so greedy tokens and scores can be compared across implementations."""
    from megatron_patch.conversion.hf_io import copy_side_files
    from megatron_patch.tokenizer import CORPUS, TINY_TOKENIZER, build_tokenizer
    from tests.models import hf_model, llama_config

    tok = build_tokenizer(TINY_TOKENIZER)
    with gzip.open(CORPUS, "rt") as f:
        rows = [json.loads(line)["text"] for _, line in zip(range(400), f)]
    ids = torch.tensor([t for r in rows for t in tok.tokenize(r) + [tok.eod]], device=device)
    torch.manual_seed(0)
    cfg = llama_config("gqa", **GPU_CFG, max_position_embeddings=512, eos_token_id=0, bos_token_id=0)
    model = hf_model(cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seq, batch = 128, 32
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), device=device)
        x = torch.stack([ids[s: s + seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval().save_pretrained(path)
    copy_side_files(TINY_TOKENIZER, path, ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    prompts = [tok.tokenize(r)[:n] for r, n in zip(rows[10:], (3, 9, 17, 40, 64))]
    return path, prompts, float(loss)


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(HF folder, prompts, last training loss) of `trained_hf_folder`, once per session."""
    from megatron_patch.runtime.parallel import ensure_model_parallel

    ensure_model_parallel(1, 1)
    return trained_hf_folder(str(tmp_path_factory.mktemp("trained") / "hf"))
