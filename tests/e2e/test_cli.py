"""The converter CLI end to end: HF -> torch_dist (TP2 x PP2) -> verify -> HF, bitwise; a negative
control; and bad input (clear error, exit 1, no output folder)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_patch.conversion.hf_io import read_all
from megatron_patch.convert import main
from tests.models import hf_model, llama_config, save_hf


@pytest.fixture(scope="module")
def converted(tmp_path_factory, cpu_megatron):
    root = tmp_path_factory.mktemp("cli")
    hf_dir = save_hf(hf_model(llama_config("pad_vocab")), str(root / "hf"))
    mc_dir = str(root / "mcore")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc_dir, "--tp", "2", "--pp", "2"]) == 0
    return root, hf_dir, mc_dir


def test_checkpoint_layout(converted):
    _, _, mc = converted
    assert open(os.path.join(mc, "latest_checkpointed_iteration.txt")).read() == "release"
    assert os.path.isfile(os.path.join(mc, "release", "metadata.json"))
    assert os.path.isfile(os.path.join(mc, "hf", "config.json"))
    manifest = json.load(open(os.path.join(mc, "megatron_patch.json")))
    assert manifest["tp"] == 2 and manifest["pp"] == 2 and manifest["padded_vocab_size"] == 1280
    assert not [n for n in os.listdir(os.path.dirname(mc)) if ".partial-" in n]


def test_verify_passes(converted, capsys):
    _, hf_dir, mc = converted
    assert main(["verify", "--hf-dir", hf_dir, "--mcore-dir", mc]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"] and result["max_abs_logit_diff"] <= 1e-5 and result["top1_agreement"] == 1.0


def test_round_trip_bitwise(converted):
    root, hf_dir, mc = converted
    out = str(root / "hf_back")
    assert main(["mcore-to-hf", "--mcore-dir", mc, "--out", out, "--max-shard-size", "200KB"]) == 0
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1  # sharded
    a, b = read_all(hf_dir), read_all(out)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == 1100


def test_negative_control_one_perturbed_tensor_fails_verify(converted, capsys):
    root, hf_dir, mc = converted
    bad = str(root / "hf_perturbed")
    shutil.copytree(hf_dir, bad)
    file = os.path.join(bad, "model.safetensors")
    tensors = load_file(file)
    tensors["model.layers.2.mlp.down_proj.weight"][0, 0] += 0.5
    save_file(tensors, file, metadata={"format": "pt"})
    assert main(["verify", "--hf-dir", bad, "--mcore-dir", mc]) == 1
    assert "exceeds" in capsys.readouterr().err


def test_bf16_conversion(converted):
    root, hf_dir, _ = converted
    mc = str(root / "mcore_bf16")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--dtype", "bf16"]) == 0
    out = str(root / "hf_bf16")
    assert main(["mcore-to-hf", "--mcore-dir", mc, "--out", out]) == 0
    a, b = read_all(hf_dir), read_all(out)
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(a[k].to(torch.bfloat16), b[k]) for k in a)
    # the exported config says so: transformers (dtype="auto") and serving stacks load bf16, not float32
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16


def test_verify_defaults_to_the_checkpoints_dtype(converted, capsys):
    """A bf16 checkpoint verifies without flags (bf16 compute, bf16 tolerance), and in fp32 against the
    HF weights rounded to bf16 as the conversion rounded them: 1e-4 holds."""
    root, hf_dir, _ = converted
    mc = str(root / "mcore_bf16_v")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--dtype", "bf16"]) == 0
    capsys.readouterr()
    assert main(["verify", "--hf-dir", hf_dir, "--mcore-dir", mc]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["dtype"] == result["checkpoint_dtype"] == "bfloat16" and result["tolerance"] == 1.0
    assert main(["verify", "--hf-dir", hf_dir, "--mcore-dir", mc, "--dtype", "fp32"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["dtype"] == "float32" and result["max_abs_logit_diff"] <= 1e-4


def test_convert_example_with_bf16(converted, tmp_path):
    """examples/convert.sh ... --dtype bf16: conversion, then verify at the checkpoint's dtype."""
    import subprocess
    import sys

    _, hf_dir, _ = converted
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    p = subprocess.run(["bash", os.path.join(root, "examples", "convert.sh"), hf_dir, str(tmp_path / "mc"),
                        "--dtype", "bf16", "--tp", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["ok"] is True


def _assert_fails(argv, out, match, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert any(line.startswith("error:") and match in line for line in err.splitlines()), err
    assert not os.path.exists(out) or out.endswith("existing")
    parent = os.path.dirname(out)
    assert not [n for n in os.listdir(parent) if ".partial-" in n] if os.path.isdir(parent) else True


def test_bad_input(converted, tmp_path, capsys):
    _, hf_dir, mc = converted
    out = str(tmp_path / "out")
    _assert_fails(["hf-to-mcore", "--hf-dir", str(tmp_path / "nope"), "--out", out], out, "does not exist", capsys)

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    _assert_fails(["hf-to-mcore", "--hf-dir", str(gpt2), "--out", out], out, "unsupported architecture", capsys)

    # 3 kv heads: TP=2 neither divides them nor is a multiple of them (1 kv head would be replicated)
    odd = save_hf(hf_model(llama_config("gqa", hidden_size=48, num_attention_heads=6, num_key_value_heads=3)),
                  str(tmp_path / "odd"))
    _assert_fails(["hf-to-mcore", "--hf-dir", odd, "--out", out, "--tp", "2"], out,
                  "TP=2 does not divide the 3 kv heads", capsys)

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    _assert_fails(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(existing)], str(existing),
                  "already exists", capsys)
    assert os.listdir(existing) == ["keep.txt"]
    _assert_fails(["mcore-to-hf", "--mcore-dir", mc, "--out", str(existing)], str(existing),
                  "already exists", capsys)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(llama_config()))
    _assert_fails(["hf-to-mcore", "--hf-dir", str(empty), "--out", out], out, "no model.safetensors", capsys)


def test_help_is_instant_and_every_option_says_what_it_does():
    """`--help` imports neither torch nor megatron-core; the top-level help names both formats; every
    option of every command has a help text."""
    import subprocess
    import sys

    from megatron_patch.convert import _parser

    for args in ([], ["verify"], ["hf-to-mcore"]):
        p = subprocess.run([sys.executable, "-X", "importtime", "-m", "megatron_patch.convert", *args, "--help"],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines()
                    if line.startswith("import time:")}
        assert not {"torch", "megatron", "transformers"} & imported, sorted(imported)[:20]
    assert "torch_dist" in p.stdout and "legacy" in p.stdout
    top = subprocess.run([sys.executable, "-m", "megatron_patch.convert", "--help"], capture_output=True,
                         text=True).stdout
    assert "torch_dist" in top and "legacy" in top
    subparsers = next(a for a in _parser()._actions if a.dest == "command")
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            assert action.help, (name, action.option_strings)


def test_plain_process_prints_no_third_party_notices_and_reports_wall_time(converted, tmp_path):
    import subprocess
    import sys

    _, hf_dir, _ = converted
    p = subprocess.run([sys.executable, "-m", "megatron_patch.convert", "hf-to-mcore", "--hf-dir", hf_dir,
                        "--out", str(tmp_path / "mc")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    for notice in ("GPTModel IS DEPRECATED", "ShardedTensor", "No CUDA runtime", "Warning"):
        assert notice not in p.stderr, p.stderr[-2000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    # both times are reported; their values are the machine's and not asserted (a loaded machine gives any):
    # tests/unit/test_cli_run.py checks how wall_seconds is computed
    assert all(isinstance(summary[k], float) for k in ("wall_seconds", "seconds")), summary



def test_demo_prints_the_commands_a_user_would_type(tmp_path):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "toolkits.demo", "--workdir", str(tmp_path / "demo")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [line for line in p.stdout.splitlines() if line.startswith("$ ")]
    assert [line.split()[:3] for line in lines] == [["$", "megatron-patch", "convert"]] * 3
    assert "bitwise identical: yes" in p.stdout


@pytest.mark.parametrize("module", ["megatron_patch.generate", "megatron_patch.evaluate", "megatron_patch.rlhf.grpo",
                                    "megatron_patch.rlhf.rloo", "megatron_patch.rlhf.ppo",
                                    "megatron_patch.preprocess_data"])
def test_every_tool_option_says_what_it_does(module, monkeypatch):
    """Each option of our tools' own parsers has a help text (and HelpFormatter shows its default)."""
    import argparse
    import importlib

    from megatron_patch.cli import HelpFormatter

    seen = []

    def capture(self, args=None, namespace=None):
        seen.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    parser = seen[0]
    assert parser.formatter_class is HelpFormatter
    assert [a.option_strings for a in parser._actions if not a.help] == []


def test_one_command_names_every_tool_and_runs_the_converter_without_loading_torch_for_help():
    """`megatron-patch` (the console script; `python -m megatron_patch`): `--help` lists every command, each
    command is a module with `main`, `convert --help` imports neither torch nor megatron-core, and an unknown
    command is one `error:` line with exit status 2."""
    import importlib
    import subprocess
    import sys

    from megatron_patch.__main__ import COMMANDS

    script = os.path.join(os.path.dirname(sys.executable), "megatron-patch")
    top = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert top.returncode == 0, top.stderr
    assert all(f"  {name} " in top.stdout for name in COMMANDS), top.stdout
    assert all(callable(importlib.import_module(module).main) for module, _ in COMMANDS.values())
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "megatron_patch", "convert", "hf-to-mcore",
                        "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "usage: megatron-patch convert hf-to-mcore" in p.stdout, p.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert not {"torch", "megatron", "transformers"} & imported
    bad = subprocess.run([script, "convrt"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown command 'convrt'")
    assert len(bad.stderr.strip().splitlines()) == 1


def test_the_old_toolkits_commands_still_work_with_a_note(converted, tmp_path):
    """`python -m toolkits.checkpoint_converter` and `python -m toolkits.preprocess_data` (the names before
    `megatron-patch convert` / `preprocess-data`) run the same tools, after one deprecation note on stderr: the
    alias's checkpoint equals the new command's, tensor for tensor."""
    import subprocess
    import sys

    _, hf_dir, _ = converted
    outs = {}
    for name, cmd in (("old", [sys.executable, "-m", "toolkits.checkpoint_converter"]),
                      ("new", [os.path.join(os.path.dirname(sys.executable), "megatron-patch"), "convert"])):
        outs[name] = str(tmp_path / name)
        p = subprocess.run([*cmd, "mcore-to-hf", "--mcore-dir", str(tmp_path / "missing"), "--out", outs[name]],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith("error:"), p.stderr[-2000:]
        p = subprocess.run([*cmd, "hf-to-mcore", "--hf-dir", hf_dir, "--out", outs[name], "--format", "legacy"],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        notes = [line for line in p.stderr.splitlines() if "deprecated" in line]
        assert notes == (["note: python -m toolkits.checkpoint_converter is deprecated; use megatron-patch convert "
                          "(or python -m megatron_patch.convert)"] if name == "old" else [])
    from megatron_patch.conversion.legacy import load_legacy_file

    rank = os.path.join("release", "mp_rank_00", "model_optim_rng.pt")
    old, new = (load_legacy_file(os.path.join(outs[n], rank))["model"] for n in ("old", "new"))
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old if torch.is_tensor(old[k]))
    p = subprocess.run([sys.executable, "-m", "toolkits.preprocess_data", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "usage: megatron-patch preprocess-data" in p.stdout
    assert "note: python -m toolkits.preprocess_data is deprecated" in p.stderr
