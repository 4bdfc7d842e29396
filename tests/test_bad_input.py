"""Bad input: a clear `error:` line naming the problem, a non-zero exit, and nothing left behind
(neither the output folder nor a temporary one beside it)."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from tests.models import hf_model, llama_config, save_hf
from toolkits.checkpoint_converter.__main__ import main


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, cpu_megatron):
    return save_hf(hf_model(llama_config()), str(tmp_path_factory.mktemp("bad") / "hf"))


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _fails(argv, out: str, match: str, capsys, code: int = 1):
    assert main(argv) == code
    err = capsys.readouterr().err
    assert any(line.startswith("error:") and match in line for line in err.splitlines()), err
    assert not os.path.exists(out)
    parent = os.path.dirname(out)
    assert not [n for n in os.listdir(parent) if ".partial-" in n or ".old-" in n]


def test_truncated_shard(hf_dir, tmp_path, capsys):
    bad = _copy(hf_dir, tmp_path / "hf")
    file = os.path.join(bad, "model.safetensors")
    os.truncate(file, os.path.getsize(file) // 2)
    out = str(tmp_path / "out")
    _fails(["hf-to-mcore", "--hf-dir", bad, "--out", out], out, "truncated or corrupt", capsys)


def test_index_names_missing_file(hf_dir, tmp_path, capsys):
    sharded = tmp_path / "sharded"
    mc = str(tmp_path / "mc")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc]) == 0
    assert main(["mcore-to-hf", "--mcore-dir", mc, "--out", str(sharded), "--max-shard-size", "200KB"]) == 0
    os.remove(sharded / "model-00002-of-00006.safetensors")
    out = str(tmp_path / "out")
    _fails(["hf-to-mcore", "--hf-dir", str(sharded), "--out", out], out,
           "names model-00002-of-00006.safetensors, which is missing", capsys)


def test_tensor_shape_does_not_fit_config(hf_dir, tmp_path, capsys):
    bad = _copy(hf_dir, tmp_path / "hf")
    cfg = json.load(open(os.path.join(bad, "config.json")))
    cfg["intermediate_size"] = 128  # the weights have 160
    json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
    out = str(tmp_path / "out")
    _fails(["hf-to-mcore", "--hf-dir", bad, "--out", out], out, "does not fit the llama config", capsys)


def test_config_does_not_match_checkpoint(hf_dir, tmp_path, capsys):
    bad = _copy(hf_dir, tmp_path / "hf")
    cfg = json.load(open(os.path.join(bad, "config.json")))
    cfg["num_hidden_layers"] = 6
    json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
    out = str(tmp_path / "out")
    _fails(["hf-to-mcore", "--hf-dir", bad, "--out", out], out, "missing HF tensors: model.layers.4.", capsys)
    # exporting a Megatron checkpoint with someone else's config
    mc = str(tmp_path / "mc")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--format", "legacy"]) == 0
    _fails(["mcore-to-hf", "--mcore-dir", mc, "--out", out, "--hf-config", bad], out,
           "missing Megatron parameters", capsys)


def test_architecture_mismatch(hf_dir, tmp_path, capsys):
    bad = _copy(hf_dir, tmp_path / "hf")
    cfg = json.load(open(os.path.join(bad, "config.json")))
    cfg["architectures"] = ["BertForMaskedLM"]
    json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
    out = str(tmp_path / "out")
    _fails(["hf-to-mcore", "--hf-dir", bad, "--out", out], out, "unsupported architecture ['BertForMaskedLM']", capsys)


@pytest.mark.parametrize("flags,match", [
    (["--tp", "3"], "TP=3 does not divide the 8 attention heads"),
    (["--pp", "3"], "PP=3 does not divide the 4 layers"),
])
def test_layout_does_not_divide(hf_dir, tmp_path, capsys, flags, match):
    out = str(tmp_path / "out")
    _fails(["hf-to-mcore", "--hf-dir", hf_dir, "--out", out, *flags], out, match, capsys)


def test_incomplete_legacy_checkpoint(hf_dir, tmp_path, capsys):
    mc = str(tmp_path / "mc")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--tp", "2", "--pp", "2", "--format", "legacy"]) == 0
    shutil.rmtree(os.path.join(mc, "release", "mp_rank_01_001"))
    out = str(tmp_path / "out")
    _fails(["mcore-to-hf", "--mcore-dir", mc, "--out", out], out,
           "incomplete legacy checkpoint", capsys)
    _fails(["mcore-to-mcore", "--mcore-dir", mc, "--out", out, "--tp", "1"], out, "mp_rank_01_001", capsys)


def test_missing_megatron_checkpoint(tmp_path, capsys):
    out = str(tmp_path / "out")
    _fails(["mcore-to-hf", "--mcore-dir", str(tmp_path / "nope"), "--out", out], out, "does not exist", capsys)


def test_existing_out_is_kept(hf_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err and os.listdir(out) == ["mine.txt"]
    # with --overwrite it is replaced, atomically
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(out), "--overwrite"]) == 0
    assert "mine.txt" not in os.listdir(out) and "megatron_patch.json" in os.listdir(out)


def test_interrupt_leaves_nothing(hf_dir, tmp_path, capsys, monkeypatch):
    from megatron_patch.conversion import hf_io

    calls = {"n": 0}
    original = hf_io.HFCheckpoint.get

    def get(self, name):  # Ctrl-C arrives (in the main thread) while the 10th tensor is read
        calls["n"] += 1
        if calls["n"] == 10:
            signal.raise_signal(signal.SIGINT)
        return original(self, name)

    monkeypatch.setattr(hf_io.HFCheckpoint, "get", get)
    for fmt in ("legacy", "torch_dist"):
        calls["n"] = 0
        out = str(tmp_path / f"out_{fmt}")
        _fails(["hf-to-mcore", "--hf-dir", hf_dir, "--out", out, "--format", fmt, "--pp", "2"], out,
               "interrupted", capsys, code=130)


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_disk_full(hf_dir, tmp_path, fmt):
    """A file-size quota (RLIMIT_FSIZE) stands in for a disk that fills up mid-write."""
    out = str(tmp_path / "out")

    def quota():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    proc = subprocess.run(
        [sys.executable, "-m", "toolkits.checkpoint_converter", "hf-to-mcore", "--hf-dir", hf_dir, "--out", out,
         "--format", fmt], capture_output=True, text=True, preexec_fn=quota, timeout=300,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "out of disk space" in proc.stderr, proc.stderr[-2000:]
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]


def test_not_enough_free_space_is_refused_up_front(hf_dir, tmp_path, capsys, monkeypatch):
    from collections import namedtuple

    from megatron_patch.conversion import convert

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(convert.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    out = str(tmp_path / "out")
    _fails(["hf-to-mcore", "--hf-dir", hf_dir, "--out", out], out, "not enough disk space", capsys)
