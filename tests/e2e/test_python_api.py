"""docs/python-api.md's example runs as written: its Python block, under `torchrun --nproc-per-node 4` (gloo,
TP2 x PP2) in a folder whose `Llama-3.1-8B` is a tiny LLaMA; a plain loop trains three steps, the streamed
weights loaded into `transformers` give the trained Megatron model's logits (fp32, <= 1e-5), a second model
refreshed from them and served by the dynamic engine generates transformers' greedy tokens, and the folder
`save_hf` writes holds the same weights."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch

from tests._cpu import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def docs_example() -> str:
    text = open(os.path.join(ROOT, "docs", "python-api.md"), encoding="utf-8").read()
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return block


def test_docs_example_runs_at_tp2_pp2(cpu_megatron, tmp_path):
    from megatron_patch.conversion.hf_io import copy_side_files, read_all
    from megatron_patch.tokenizer import TINY_TOKENIZER
    from tests.models import hf_model, llama_config, save_hf

    save_hf(hf_model(llama_config("gqa")), str(tmp_path / "Llama-3.1-8B"))
    copy_side_files(TINY_TOKENIZER, str(tmp_path / "Llama-3.1-8B"),
                    ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"])
    (tmp_path / "train_tp2pp2.py").write_text(docs_example())
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master_port",
                        str(free_port()), "train_tp2pp2.py"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"step \d: loss ([\d.]+)", p.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], p.stdout
    diff = float(re.search(r"max \|logits - transformers\| = ([\d.e+-]+)", p.stdout)[1])
    assert diff <= 1e-5, p.stdout
    # the refreshed second model, served by the dynamic engine at TP2 x PP2, generates transformers' greedy tokens
    assert "dynamic engine's greedy tokens = transformers': True" in p.stdout, p.stdout
    read = [int(x.replace(",", "")) for x in re.findall(r"read ([\d,]+) bytes", p.stdout)]
    assert len(read) == 4
    saved = read_all(str(tmp_path / "trained-hf"))
    source = read_all(str(tmp_path / "Llama-3.1-8B"))
    assert sorted(saved) == sorted(source)
    assert any(not torch.equal(saved[k], source[k]) for k in source)  # the trained weights, not the start


def test_readme_example_runs(cpu_megatron, tmp_path):
    """README's "Using the model library" block, as written (one process), on a tiny LLaMA: the exported folder
    holds the HF weights bit for bit."""
    from megatron_patch.conversion.hf_io import read_all
    from tests.models import hf_model, llama_config, save_hf

    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text[text.index("## Using the model library"):text.index("## Supported model families")]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    save_hf(hf_model(llama_config("gqa")), str(tmp_path / "Llama-3.1-8B"))
    (tmp_path / "example.py").write_text(block)
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    source = read_all(str(tmp_path / "Llama-3.1-8B"))
    printed = dict(line.split(" ", 1) for line in p.stdout.splitlines() if line.startswith(("model.", "lm_head.")))
    assert printed == {k: str(tuple(t.shape)) for k, t in source.items()}
    exported = read_all(str(tmp_path / "Llama-3.1-8B-exported"))
    assert sorted(exported) == sorted(source) and all(torch.equal(exported[k], source[k]) for k in source)
