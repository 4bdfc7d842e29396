"""Bad input: a clear `error:` line naming the problem, a non-zero exit, and nothing left behind
(neither the output folder nor a temporary one beside it)."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from megatron_patch.convert import main
from tests.models import hf_model, llama_config, save_hf


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


@pytest.mark.parametrize("sig,match,code", [(signal.SIGINT, "interrupted", 130),
                                            (signal.SIGTERM, "terminated (SIGTERM)", 143)])
def test_interrupt_leaves_nothing(hf_dir, tmp_path, capsys, monkeypatch, sig, match, code):
    """Ctrl-C, and SIGTERM (preemption, `timeout`, `scancel`) alike: exit 130 / 143, nothing left."""
    from megatron_patch.conversion import hf_io

    calls = {"n": 0}
    original = hf_io.HFCheckpoint.get

    def get(self, name):  # the signal arrives (in the main thread) while the 10th tensor is read
        calls["n"] += 1
        if calls["n"] == 10:
            signal.raise_signal(sig)
        return original(self, name)

    monkeypatch.setattr(hf_io.HFCheckpoint, "get", get)
    for fmt in ("legacy", "torch_dist"):
        calls["n"] = 0
        out = str(tmp_path / f"out_{fmt}")
        _fails(["hf-to-mcore", "--hf-dir", hf_dir, "--out", out, "--format", fmt, "--pp", "2"], out, match, capsys,
               code=code)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the tool's handler is gone again


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_disk_full(hf_dir, tmp_path, fmt):
    """A file-size quota (RLIMIT_FSIZE) stands in for a disk that fills up mid-write."""
    out = str(tmp_path / "out")

    def quota():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    proc = subprocess.run(
        [sys.executable, "-m", "megatron_patch.convert", "hf-to-mcore", "--hf-dir", hf_dir, "--out", out,
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


def _with_nan(src: str, dst) -> str:
    bad = _copy(src, dst)
    file = os.path.join(bad, "model.safetensors")
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    tensors["model.layers.1.self_attn.o_proj.weight"][2, 3] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    return bad


def _strict_json(line: str) -> dict:
    def refuse(name):
        raise AssertionError(f"{name} in a JSON line")

    return json.loads(line, parse_constant=refuse)


def test_nonfinite_weights_are_refused_or_written_with_a_warning(hf_dir, tmp_path, capsys):
    """NaN in one HF tensor: every conversion refuses it by default, naming the HF tensor (the name the user
    knows; the Megatron tensor it went into follows); with --allow-nonfinite it is written, warned about and
    recorded in tensors.json; verify then fails on the non-finite logits with a valid JSON line (no bare NaN)."""
    bad = _with_nan(hf_dir, tmp_path / "hf")
    out = str(tmp_path / "out")
    hf_name = "model.layers.1.self_attn.o_proj.weight"
    for fmt, name in (("torch_dist", "decoder.layers.self_attention.linear_proj.weight@1,0,0"),  # layer 1
                      ("legacy", "mp_rank_00/decoder.layers.1.self_attention.linear_proj.weight")):
        _fails(["hf-to-mcore", "--hf-dir", bad, "--out", out, "--format", fmt], out,
               f"{hf_name} has 1 non-finite values (NaN/Inf) out of 4096 (written as {name}); nothing was written",
               capsys)
    mc = str(tmp_path / "mc")
    assert main(["hf-to-mcore", "--hf-dir", bad, "--out", mc, "--allow-nonfinite"]) == 0
    assert "warning: 1 tensors written with non-finite values" in capsys.readouterr().err
    entries = json.load(open(os.path.join(mc, "tensors.json")))["tensors"]
    flagged = [k for k, v in entries.items() if v.get("nonfinite")]
    assert flagged == ["decoder.layers.self_attention.linear_proj.weight@1,0,0"]
    _fails(["mcore-to-hf", "--mcore-dir", mc, "--out", out], out, f"error: {hf_name} has 1 non-finite values",
           capsys)
    _fails(["mcore-to-mcore", "--mcore-dir", mc, "--out", out, "--format", "legacy"], out,
           f"error: {hf_name} has 1 non-finite values (NaN/Inf) out of 4096 (written as mp_rank_00/decoder.layers.1."
           "self_attention.linear_proj.weight)", capsys)
    assert main(["verify", "--hf-dir", bad, "--mcore-dir", mc]) == 1
    captured = capsys.readouterr()
    result = _strict_json(captured.out.strip().splitlines()[-1])
    assert result["ok"] is False and result["max_abs_logit_diff"] is None and result["top1_agreement"] is None
    assert result["nonfinite_logits"]["megatron"] > 0
    assert "error: non-finite logits (NaN/Inf)" in captured.err


def test_output_folders_follow_the_umask(hf_dir, tmp_path):
    """Every folder and file a conversion writes has the mode the user's umask gives (not mkdtemp's 0700)."""
    for mask, dirs, files in ((0o022, 0o755, 0o644), (0o027, 0o750, 0o640)):
        old = os.umask(mask)
        try:
            mc, back = str(tmp_path / f"mc{mask:o}"), str(tmp_path / f"hf{mask:o}")
            assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--format", "legacy"]) == 0
            assert main(["mcore-to-hf", "--mcore-dir", mc, "--out", back]) == 0
        finally:
            os.umask(old)
        for top in (mc, back):
            for root, _, names in os.walk(top):
                assert os.stat(root).st_mode & 0o777 == dirs, root
                for n in names:
                    assert os.stat(os.path.join(root, n)).st_mode & 0o777 == files, os.path.join(root, n)


def test_stale_partial_output_of_a_killed_run_is_removed_next_time(hf_dir, tmp_path):
    """SIGKILL cannot be caught: the next run to the same --out removes the partial folder a dead
    process of this machine left, and says so; one of a live process or of another host is only
    reported, with the command that removes it."""
    import socket
    import time

    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "megatron_patch.convert", "hf-to-mcore", "--hf-dir", hf_dir, "--out", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not [n for n in os.listdir(tmp_path) if ".partial-" in n] and time.time() < deadline:
        assert proc.poll() is None, "the conversion ended before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stale = [n for n in os.listdir(tmp_path) if ".partial-" in n]
    assert len(stale) == 1 and not os.path.exists(out)
    other = tmp_path / ".out.partial-otherhost-123-abcd"
    other.mkdir()
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"warning: removed {tmp_path / stale[0]}, a partial output left by an interrupted run" in done.stderr
    assert f"{other} is the partial output of another run (pid 123 on otherhost)" in done.stderr
    assert f"rm -rf '{other}'" in done.stderr
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == [other.name]
    assert socket.gethostname() in stale[0]


def test_out_equal_to_or_holding_the_source_is_refused(hf_dir, tmp_path, capsys):
    """`--overwrite` with --out = the source (or a folder holding it, or an existing folder inside it) would
    delete or change the input."""
    src = _copy(hf_dir, tmp_path / "hf")
    before = sorted(os.listdir(src))
    for out in (src, src + "/", str(tmp_path)):
        assert main(["hf-to-mcore", "--hf-dir", src, "--out", out, "--overwrite"]) == 1
        assert "would destroy the input" in capsys.readouterr().err
    mc = str(tmp_path / "mc")
    assert main(["hf-to-mcore", "--hf-dir", src, "--out", mc]) == 0
    for command in ("mcore-to-hf", "mcore-to-mcore"):
        assert main([command, "--mcore-dir", mc, "--out", mc, "--overwrite"]) == 1
        assert "would destroy the input" in capsys.readouterr().err
    side = sorted(os.listdir(os.path.join(mc, "hf")))
    assert main(["mcore-to-hf", "--mcore-dir", mc, "--out", os.path.join(mc, "hf"), "--overwrite"]) == 1
    assert "is part of the input" in capsys.readouterr().err  # the checkpoint's own hf/ side folder
    assert sorted(os.listdir(os.path.join(mc, "hf"))) == side
    assert sorted(os.listdir(src)) == before and os.path.isfile(os.path.join(mc, "megatron_patch.json"))


@pytest.mark.parametrize("field,value,match", [
    ("num_attention_heads", 0, "num_attention_heads must be a positive integer, got 0"),
    ("hidden_size", -64, "hidden_size must be a positive integer, got -64"),
    ("num_hidden_layers", 2.5, "num_hidden_layers must be a positive integer, got 2.5"),
    ("rms_norm_eps", float("nan"), "rms_norm_eps must be a finite number, got nan"),
    ("rope_theta", -1.0, "rope_theta must be > 0"),
])
def test_bad_config_numbers_name_field_and_file(hf_dir, tmp_path, capsys, field, value, match):
    bad = _copy(hf_dir, tmp_path / "hf")
    cfg = json.load(open(os.path.join(bad, "config.json")))
    cfg[field] = value
    json.dump(cfg, open(os.path.join(bad, "config.json"), "w"))
    out = str(tmp_path / "out")
    _fails(["hf-to-mcore", "--hf-dir", bad, "--out", out], out, f"{bad}/config.json: {match}", capsys)


def test_config_that_is_not_json_names_the_file(hf_dir, tmp_path, capsys):
    bad = _copy(hf_dir, tmp_path / "hf")
    with open(os.path.join(bad, "config.json"), "w") as f:
        f.write('{"architectures": ["LlamaForCausalLM"],\n "hidden_size": 64,,}')
    out = str(tmp_path / "out")
    _fails(["hf-to-mcore", "--hf-dir", bad, "--out", out], out, f"{bad}/config.json is not valid JSON (line 2", capsys)


@pytest.mark.parametrize("flag,value", [("--make-vocab-size-divisible-by", "0"), ("--tp", "0"), ("--pp", "-2"),
                                        ("--ep", "x")])
def test_nonsense_numbers_on_the_command_line(hf_dir, tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(tmp_path / "out"), flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and ("must be >= 1" in err or "expected a positive integer" in err)


def test_output_location_errors_name_the_output(hf_dir, tmp_path, capsys, monkeypatch):
    """--out under a regular file, with a missing parent, or in a folder that cannot be written: the
    message names --out and the reason (not a temporary folder, not a disk-space error)."""
    (tmp_path / "afile").write_text("x")
    for out, match in ((tmp_path / "afile" / "a" / "b", f"{tmp_path / 'afile'} is a file, not a folder"),
                       (tmp_path / "nope" / "out", f"its parent folder {tmp_path / 'nope'} does not exist")):
        assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(out)]) == 1
        assert f"error: cannot create {out}: {match}" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["afile"]
    # a read-only folder (the tests run as root, for whom every folder is writable: os.access stands in)
    out = str(tmp_path / "ro" / "out")
    os.mkdir(tmp_path / "ro")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if str(p) == str(tmp_path / "ro") else
                        real_access(p, mode, **k))
    _fails(["hf-to-mcore", "--hf-dir", hf_dir, "--out", out], out,
           f"cannot create {out}: the folder {tmp_path / 'ro'} is not writable", capsys)
    monkeypatch.undo()
    # a write refused half-way (e.g. a quota or an ACL): the error names --out, not the temporary folder
    from megatron_patch.conversion import convert

    def refuse(src, dst, names=()):
        raise PermissionError(13, "Permission denied", os.path.join(dst, "config.json"))

    monkeypatch.setattr(convert, "copy_side_files", refuse)
    out = str(tmp_path / "out2")
    _fails(["hf-to-mcore", "--hf-dir", hf_dir, "--out", out], out, f"Permission denied (writing {out})", capsys)
    assert ".partial-" not in capsys.readouterr().err


def test_verify_refuses_two_different_models(hf_dir, tmp_path, capsys):
    other = save_hf(hf_model(llama_config("mha")), str(tmp_path / "other"))
    mc = str(tmp_path / "mc")
    assert main(["hf-to-mcore", "--hf-dir", other, "--out", mc]) == 0
    assert main(["verify", "--hf-dir", hf_dir, "--mcore-dir", mc]) == 1
    err = capsys.readouterr().err
    assert f"error: {hf_dir} and {mc} are different models (num_key_value_heads: 2 vs 8)" in err, err


@pytest.mark.skipif(__import__("importlib").util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed here")
def test_transformer_engine_checkpoint_without_te(hf_dir, tmp_path, capsys):
    """Converting to TE naming needs no TE; running it does: one line saying what to do."""
    mc = str(tmp_path / "mc")
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--impl", "transformer_engine",
                 "--format", "legacy"]) == 0
    assert main(["verify", "--hf-dir", hf_dir, "--mcore-dir", mc]) == 1
    assert "needs Transformer Engine, which is not installed" in capsys.readouterr().err
    assert main(["verify", "--hf-dir", hf_dir, "--mcore-dir", mc, "--impl", "local"]) == 0
