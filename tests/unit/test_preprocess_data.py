"""megatron-patch preprocess-data: JSONL(.gz) -> Megatron indexed dataset, read back token for token; bad input."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import subprocess
import sys

import numpy
import pytest

from megatron_patch.preprocess_data import main, output_paths, preprocess
from megatron_patch.tokenizer import CORPUS, TINY_TOKENIZER, build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TINY_TOKENIZER)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Corpus documents with empty ones and a non-ASCII one mixed in."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in itertools.islice(f, 150)]
    docs[3] = docs[70] = docs[149] = ""
    docs[10] = "ünïcödé 景太郎 \N{SNAKE}\ttabs"
    return docs


def write_jsonl(path, texts: list[str], key: str = "text") -> str:
    lines = "".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts))
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return str(path)


def read_back(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    assert ds.index.dtype == numpy.uint16  # vocab of 1000 fits megatron's small dtype
    assert list(ds.document_indices) == list(range(len(ds) + 1))  # one sequence per document
    return [ds[i].tolist() for i in range(len(ds))]


@pytest.mark.parametrize("workers,append_eod", [(2, True), (1, False)])
def test_documents_read_back_token_for_token(tmp_path, tok, texts, workers, append_eod):
    inputs = [write_jsonl(tmp_path / "a.jsonl", texts[:100]), write_jsonl(tmp_path / "b.jsonl.gz", texts[100:])]
    summary = preprocess(inputs, str(tmp_path / "out"), TINY_TOKENIZER, workers=workers, append_eod=append_eod)

    expected = [tok.tokenize(t) + ([tok.eod] if append_eod else []) for t in texts if t]
    assert read_back(str(tmp_path / "out_text_document")) == expected  # input order across both files
    assert summary["documents"] == len(texts) - 3 == len(expected)
    assert summary["skipped_empty"] == 3
    assert summary["tokens"] == sum(map(len, expected))
    assert (summary["bin"], summary["idx"]) == tuple(map(os.path.abspath, output_paths(str(tmp_path / "out"))))
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "b.jsonl.gz", "out_text_document.bin",
                                            "out_text_document.idx"]


def test_json_key_and_gpt_dataset(tmp_path, tok, texts):
    """Another key names the output; megatron's GPTDataset reads it with our tokenizer, samples = the tokens."""
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    src = write_jsonl(tmp_path / "c.jsonl", texts, key="content")
    summary = preprocess([src], str(tmp_path / "c"), TINY_TOKENIZER, json_key="content", workers=2, append_eod=True)
    prefix = summary["data_path"]
    assert prefix == str(tmp_path / "c_content_document")

    seq = 64
    indexed = IndexedDataset(prefix)
    config = GPTDatasetConfig(random_seed=1, sequence_length=seq, tokenizer=tok, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=True, split="100,0,0",
                              path_to_cache=str(tmp_path / "cache"))
    ds = GPTDataset(indexed, prefix, numpy.arange(len(indexed)), None, Split.train, config)
    assert len(ds) == (summary["tokens"] - 1) // seq  # one epoch; the last token is only a label
    # GPTDataset concatenates the documents in its shuffled document order and cuts samples of seq + 1
    stream = numpy.concatenate([indexed[d] for d in ds.document_index])
    starts = numpy.concatenate([[0], numpy.cumsum([len(indexed[d]) for d in ds.document_index])])
    for i in range(0, len(ds), 37):
        doc, offset = ds.sample_index[ds.shuffle_index[i]]
        window = stream[starts[doc] + offset: starts[doc] + offset + seq + 1]
        sample = ds[i]
        assert sample["tokens"].tolist() == window[:-1].tolist()
        assert sample["labels"].tolist() == window[1:].tolist()
        # eod_mask_loss: megatron does not train the prediction made from an eod (across documents)
        assert sample["loss_mask"].tolist() == [0.0 if t == tok.eod else 1.0 for t in window[:-1]]


def test_cli(tmp_path, tok, texts):
    src = write_jsonl(tmp_path / "in.jsonl.gz", texts[:40])
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run([sys.executable, "-m", "megatron_patch.preprocess_data", "--input", src, "--output-prefix",
                           str(tmp_path / "cli"), "--tokenizer", TINY_TOKENIZER, "--workers", "2",
                           "--append-eod"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = [tok.tokenize(t) + [tok.eod] for t in texts[:40] if t]
    assert summary["documents"] == len(expected) and summary["skipped_empty"] == 1
    assert summary["tokens"] == sum(map(len, expected))
    assert isinstance(summary["tokens_per_s"], float)  # a measured rate: its value is the machine's
    assert "documents" in proc.stderr and "error" not in proc.stderr  # the progress bar, on stderr
    assert read_back(summary["data_path"]) == expected


def run_main(capsys, args: list[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


@pytest.fixture
def good(tmp_path, texts) -> str:
    return write_jsonl(tmp_path / "good.jsonl", texts[:20])


def common(tmp_path) -> list[str]:
    return ["--output-prefix", str(tmp_path / "out"), "--tokenizer", TINY_TOKENIZER, "--workers", "2"]


def test_missing_input(tmp_path, capsys, good):
    code, err = run_main(capsys, ["--input", good, str(tmp_path / "missing.jsonl")] + common(tmp_path))
    assert code == 1
    assert f"error: input file {tmp_path / 'missing.jsonl'} does not exist" in err
    assert os.listdir(tmp_path) == ["good.jsonl"]


def test_line_not_json_after_output_started(tmp_path, capsys, texts):
    """The bad line comes after 150 good ones, so workers have run and the .bin was being written."""
    src = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": t}) for t in texts] + ['{"text": "unterminated'] + ['{"text": "x"}'] * 5
    src.write_text("\n".join(lines) + "\n")
    code, err = run_main(capsys, ["--input", str(src)] + common(tmp_path))
    assert code == 1
    assert f"error: {src} line {len(texts) + 1} is not valid JSON" in err
    assert os.listdir(tmp_path) == ["bad.jsonl"]


def test_line_without_key(tmp_path, capsys):
    src = tmp_path / "nokey.jsonl"
    src.write_text('{"text": "fine"}\n{"content": "wrong key"}\n')
    code, err = run_main(capsys, ["--input", str(src)] + common(tmp_path))
    assert code == 1
    assert f"error: {src} line 2 has no 'text' key (found ['content'])" in err
    assert os.listdir(tmp_path) == ["nokey.jsonl"]
    src.write_text('{"text": 42}\n')
    code, err = run_main(capsys, ["--input", str(src)] + common(tmp_path))
    assert code == 1 and f"error: {src} line 1: 'text' is a int, not a string" in err
    assert os.listdir(tmp_path) == ["nokey.jsonl"]


def test_existing_output_needs_overwrite(tmp_path, capsys, good, tok, texts):
    assert run_main(capsys, ["--input", good] + common(tmp_path))[0] == 0
    bin_path, idx_path = output_paths(str(tmp_path / "out"))
    before = {p: open(p, "rb").read() for p in (bin_path, idx_path)}
    other = write_jsonl(tmp_path / "other.jsonl", texts[30:35])

    code, err = run_main(capsys, ["--input", other] + common(tmp_path))
    assert code == 1 and f"error: output {bin_path} already exists (pass --overwrite to replace it)" in err
    # a failing run with --overwrite keeps the old output too
    code, err = run_main(capsys, ["--input", str(tmp_path / "nope.jsonl"), "--overwrite"] + common(tmp_path))
    assert code == 1 and "does not exist" in err
    assert {p: open(p, "rb").read() for p in before} == before

    assert run_main(capsys, ["--input", other, "--overwrite"] + common(tmp_path))[0] == 0
    assert read_back(str(tmp_path / "out_text_document")) == [tok.tokenize(t) for t in texts[30:35]]
    assert sorted(os.listdir(tmp_path)) == ["good.jsonl", "other.jsonl", "out_text_document.bin",
                                            "out_text_document.idx"]


def test_output_folder_is_created(tmp_path, capsys, good, tok, texts):
    """--output-prefix data/corpus with no data/ folder yet: the folders are made (the README's first command runs
    as written in a fresh folder); a run that fails leaves none of the folders it made behind."""
    prefix = tmp_path / "new" / "data" / "corpus"
    code, err = run_main(capsys, ["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(prefix),
                                  "--tokenizer", TINY_TOKENIZER])
    assert code == 1 and not (tmp_path / "new").exists(), err
    bad = write_jsonl(tmp_path / "bad.jsonl", ["fine"])
    with open(bad, "a") as f:
        f.write("not json\n")
    code, err = run_main(capsys, ["--input", bad, "--output-prefix", str(prefix), "--tokenizer", TINY_TOKENIZER])
    assert code == 1 and "line 2 is not valid JSON" in err and not (tmp_path / "new").exists(), err
    code, err = run_main(capsys, ["--input", good, "--output-prefix", str(prefix), "--tokenizer", TINY_TOKENIZER])
    assert code == 0, err
    assert read_back(str(prefix) + "_text_document") == [tok.tokenize(t) for t in texts[:20] if t]
    assert sorted(os.listdir(prefix.parent)) == ["corpus_text_document.bin", "corpus_text_document.idx"]


def test_input_without_tokens_is_refused(tmp_path, capsys):
    """Only empty documents (or an empty file): an error and no dataset, not an empty dataset and exit 0."""
    for name, lines in (("empty_docs.jsonl", ['{"text": ""}', '{"text": ""}']), ("empty_file.jsonl", [])):
        src = tmp_path / name
        src.write_text("".join(line + "\n" for line in lines))
        code, err = run_main(capsys, ["--input", str(src)] + common(tmp_path))
        assert code == 1
        assert f"error: no document in {src} has any tokens ({len(lines)} empty 'text' values skipped)" in err
        assert not [f for f in os.listdir(tmp_path) if not f.endswith(".jsonl")]


def test_prefix_ending_in_the_suffix_is_not_doubled(tmp_path, capsys, good, tok, texts):
    """--output-prefix X_text_document (the name --data-path takes) writes X_text_document.bin/.idx, and the
    tool says what it wrote."""
    prefix = str(tmp_path / "out_text_document")
    assert output_paths(prefix) == (prefix + ".bin", prefix + ".idx")
    content = str(tmp_path / "out_content_document")
    assert output_paths(content, "content")[0] == content + ".bin"
    assert output_paths(prefix, "content")[0] == prefix + "_content_document.bin"
    code = main(["--input", good, "--output-prefix", prefix, "--tokenizer", TINY_TOKENIZER])
    out, err = capsys.readouterr()
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["data_path"] == prefix
    assert f"wrote {prefix}.bin and {prefix}.idx: train with --data-path {prefix}" in err
    assert sorted(os.listdir(tmp_path)) == ["good.jsonl", "out_text_document.bin", "out_text_document.idx"]
    assert read_back(prefix) == [tok.tokenize(t) for t in texts[:20] if t]


def test_worker_pool_terminates_right_after_its_start():
    """The tokenizing workers are forked with SIGTERM's default action: under the tool's own SIGTERM handler
    (megatron_patch.cli.run) Python drops a signal that reaches a child before its after-fork setup, and
    `Pool.terminate()` right after the start (an input with no tokens) waited forever on such a worker. In a
    child process with a timeout, so that a regression fails instead of hanging the suite."""
    code = ("import signal\nfrom megatron_patch.preprocess_data import _fork_pool\n"
            "signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(KeyboardInterrupt()))\n"
            f"for _ in range(100):\n    _fork_pool(2, {TINY_TOKENIZER!r}, 'text').terminate()\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300)
