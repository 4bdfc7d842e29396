"""megatron_patch.compat, the one place that differs by megatron-core version: the supported range agrees with
setup.py and with the environments .ci/run tests (the Makefile), and what the converter writes for a torch_dist
checkpoint has the files the installed megatron-core's own `dist_checkpointing.save` writes."""

import os
import re

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from megatron_patch import compat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _setup_requirement() -> Requirement:
    text = open(os.path.join(ROOT, "setup.py")).read()
    return Requirement(re.search(r'"(megatron-core[^"]*)"', text).group(1))


def test_supported_range_is_setup_pys_and_its_ends_are_the_tested_releases():
    """setup.py declares `compat.SUPPORTED`; the oldest tested release is the range's lower bound, the
    newest is in it, and the Makefile installs exactly these two (`make test`, `make test-oldest`)."""
    assert _setup_requirement().specifier == compat.SUPPORTED
    oldest, newest = (Version(v) for v in compat.TESTED)
    assert oldest < newest and all(v in compat.SUPPORTED for v in (oldest, newest))
    assert not any(Version(v) in compat.SUPPORTED for v in ("0.18.1", "0.17.1", "0.20.0"))
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    pinned = tuple(re.search(rf"^{n} := (\S+)$", makefile, re.M).group(1) for n in ("MCORE_OLDEST", "MCORE_NEWEST"))
    assert pinned == compat.TESTED


@pytest.mark.parametrize("version, inline", [("0.18.2", False), ("0.19.0", True), ("0.19.2", True)])
def test_torch_dist_common_state_place_by_version(monkeypatch, version, inline):
    monkeypatch.setattr(compat, "megatron_core_version", lambda: Version(version))
    assert compat.torch_dist_common_state_inline() is inline
    assert compat.at_least("0.19") is inline


def test_torch_dist_files_match_megatron_cores_own_save(cpu_megatron, tmp_path):
    """The converter's torch_dist folder holds the files megatron-core's own `dist_checkpointing.save` of the
    same model writes (the data files aside: their count follows the writer threads) — under 0.18 a
    `common.pt`, under 0.19 none — and megatron-core's own `load_common_state_dict` reads its args back."""
    from megatron.core import dist_checkpointing

    from megatron_patch.convert import main
    from megatron_patch.models import build_model, load_hf_config
    from tests.models import hf_model, llama_config, save_hf

    hf = save_hf(hf_model(llama_config()), str(tmp_path / "hf"))
    ours = tmp_path / "ours"
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(ours)]) == 0
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    model = build_model(load_hf_config(hf))
    dist_checkpointing.save(model.sharded_state_dict(), str(theirs))

    def files(folder) -> set[str]:
        return {n for n in os.listdir(folder) if not n.endswith(".distcp")}

    assert files(ours / "release") == files(theirs)
    assert ("common.pt" in files(theirs)) is not compat.torch_dist_common_state_inline()
    args = dist_checkpointing.load_common_state_dict(str(ours / "release"))["args"]
    assert args.ckpt_format == "torch_dist" and args.num_layers == load_hf_config(hf)["num_hidden_layers"]


@pytest.mark.parametrize("inline", [False, True], ids=["common.pt (0.18)", "inline (0.19)"])
def test_either_common_state_place_converts_under_the_installed_release(cpu_megatron, tmp_path, monkeypatch, inline):
    """A torch_dist checkpoint with its common state in either place — 0.18's `common.pt`, 0.19's object
    inside the DCP files — is read by the converter under the installed megatron-core, so a checkpoint
    written under the other release converts here: `mcore-to-mcore` rewrites it in this release's layout
    and back to HF it is bitwise the source."""
    from megatron_patch.conversion.hf_io import read_all
    from megatron_patch.convert import main
    from tests.models import hf_model, llama_config, save_hf

    hf = save_hf(hf_model(llama_config("tied")), str(tmp_path / "hf"))
    with monkeypatch.context() as m:
        m.setattr(compat, "torch_dist_common_state_inline", lambda: inline)
        assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "other"), "--tp", "2"]) == 0
    assert ("common.pt" in os.listdir(tmp_path / "other" / "release")) is not inline
    assert compat.load_torch_dist_common(str(tmp_path / "other" / "release"))["args"].tensor_model_parallel_size == 2
    assert main(["mcore-to-mcore", "--mcore-dir", str(tmp_path / "other"), "--out", str(tmp_path / "here"),
                 "--format", "torch_dist", "--tp", "1", "--pp", "1"]) == 0
    here = os.listdir(tmp_path / "here" / "release")
    assert ("common.pt" in here) is not compat.torch_dist_common_state_inline()
    assert main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "here"), "--out", str(tmp_path / "back")]) == 0
    source, back = read_all(hf), read_all(str(tmp_path / "back"))
    assert set(source) == set(back) and all(torch.equal(source[k], back[k]) for k in source)


def test_version_checks_live_in_compat():
    """No module of the library or its tools, nor the CPU test harness, reads megatron-core's version itself:
    what differs by version is a function of `megatron_patch.compat` (patches state ranges and ask it)."""
    import glob

    pattern = re.compile(r"package_info|version\(\s*['\"]megatron[-_]core|megatron\.core\.__version__")
    files = [*glob.glob(os.path.join(ROOT, "megatron_patch", "**", "*.py"), recursive=True),
             *glob.glob(os.path.join(ROOT, "toolkits", "**", "*.py"), recursive=True),
             os.path.join(ROOT, "tests", "_cpu.py")]
    offenders = [os.path.relpath(f, ROOT) for f in files
                 if not f.endswith(os.path.join("megatron_patch", "compat.py")) and pattern.search(open(f).read())]
    assert len(files) > 40 and not offenders, offenders
