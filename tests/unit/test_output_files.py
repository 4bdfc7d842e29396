"""megatron_patch.jsonl's readers and conversion.atomic's output files: rows keep their 1-based line numbers
(blank lines counted); an output file is checked before any work and written through a temporary file that replaces
it only when the writing succeeded, with the mode `open()` would give it."""

import os

import pytest

from megatron_patch.jsonl import read_jsonl, read_jsonl_numbered
from megatron_patch.outputs import atomic_output_file, check_output_file


def test_rows_keep_their_line_numbers(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n  \n{"a": 2}\n')
    assert read_jsonl_numbered(str(path)) == [(1, {"a": 1}), (4, {"a": 2})]
    assert read_jsonl(str(path)) == [{"a": 1}, {"a": 2}]
    path.write_text('{"a": 1}\n\n{"b": 2}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl, line 3: needs a 'a' field"):
        read_jsonl_numbered(str(path), need_any=("a",))


def test_check_output_file(tmp_path):
    (tmp_path / "f").write_text("")
    check_output_file(str(tmp_path / "new.json"), "--out")
    check_output_file(str(tmp_path / "f"), "--out")  # an existing file is replaced
    for path, match in [(tmp_path, "is a folder"), (tmp_path / "no" / "x", "does not exist"),
                        (tmp_path / "f" / "x", "is a file, not a folder")]:
        with pytest.raises(ValueError, match=f"--report {path}.*{match}"):
            check_output_file(str(path), "--report")


def test_a_failed_write_leaves_the_old_file_and_nothing_else(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")
    with pytest.raises(KeyboardInterrupt):
        with atomic_output_file(str(path)) as f:
            f.write("new, half")
            raise KeyboardInterrupt
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["out.jsonl"]


def test_mode_is_what_open_would_give(tmp_path):
    new, existing = tmp_path / "new.json", tmp_path / "existing.json"
    existing.write_text("old")
    os.chmod(existing, 0o604)
    old = os.umask(0o037)
    try:
        for path in (new, existing):
            with atomic_output_file(str(path)) as f:
                f.write("x")
    finally:
        os.umask(old)
    assert os.stat(new).st_mode & 0o777 == 0o640  # 0o666 less the umask (a temporary file is 0o600)
    assert os.stat(existing).st_mode & 0o777 == 0o604 and existing.read_text() == "x"
    assert sorted(os.listdir(tmp_path)) == ["existing.json", "new.json"]
