"""megatron-patch preprocess-data --input FILE [FILE ...] --output-prefix PREFIX --tokenizer PATH
       [--json-key text] [--workers N] [--append-eod] [--overwrite]       (or python -m megatron_patch.preprocess_data)

Tokenizes JSONL files (.jsonl, or gzipped .jsonl.gz), one document per line, into the Megatron indexed
dataset PREFIX_{json_key}_document.bin/.idx that `--data-path PREFIX_text_document` reads in
megatron.training (megatron.core.datasets.indexed_dataset); a PREFIX already ending in _{json_key}_document
is used as is, and missing folders of PREFIX are made. Documents keep the input order; documents that
tokenize to nothing are skipped and counted (input with no document left is an error). `--append-eod` ends
each document with the tokenizer's eod, which GPTDataset uses to tell documents apart inside a sample.

The files are written under temporary names beside the target and renamed at the end, so bad input (a
missing file, a line that is not JSON, a line without the key, an existing output without --overwrite)
ends with one `error:` line, exit status 1, and no output (nor the folders the run made). Set
MEGATRON_PATCH_TRACEBACK=1 for the traceback.
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy

from megatron_patch.cli import HelpFormatter, positive_int, run

if TYPE_CHECKING:  # imported on use: megatron-core's import is slow and noisy, main() quiets it first
    from megatron_patch.tokenizer import Tokenizer

_CHUNK = 64  # lines per task sent to a worker: large enough to amortise the pickling

_tokenizer: Tokenizer | None = None
_json_key = "text"


def _read_lines(paths: list[str]) -> Iterator[tuple[str, int, str]]:
    """(file, 1-based line number, line) for every non-blank line of the inputs, in order."""
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            try:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        yield path, number, line
            except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
                raise ValueError(f"cannot read {path}: {e}") from e


def _use_in_this_process(tokenizer: Tokenizer, json_key: str) -> None:
    global _tokenizer, _json_key
    _tokenizer, _json_key = tokenizer, json_key


def _init_worker(tokenizer_path: str, json_key: str) -> None:
    """Pool initializer: each worker loads the tokenizer once."""
    from megatron_patch.tokenizer import build_tokenizer

    _use_in_this_process(build_tokenizer(tokenizer_path), json_key)


def _fork_pool(workers: int, tokenizer_path: str, json_key: str):
    """The workers are forked with SIGTERM's default action, not the tool's handler (megatron_patch.cli.run):
    Python drops a signal that reaches a child before its after-fork setup, so `Pool.terminate()` right after
    the start (an input with no tokens) could leave a worker alive and `terminate` waiting on it forever."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL) if main_thread else None
    try:
        return multiprocessing.get_context("fork").Pool(workers, _init_worker, (tokenizer_path, json_key))
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _tokenize_line(item: tuple[str, int, str]) -> numpy.ndarray:
    """The token ids of one JSONL line's `json_key` text; ValueError naming file and line otherwise.
    An int32 array: it crosses the process boundary far cheaper than a list of ints."""
    path, number, line = item
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} line {number} is not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(doc, dict) or _json_key not in doc:
        keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{path} line {number} has no '{_json_key}' key (found {keys})")
    text = doc[_json_key]
    if not isinstance(text, str):
        raise ValueError(f"{path} line {number}: '{_json_key}' is a {type(text).__name__}, not a string")
    return numpy.asarray(_tokenizer.tokenize(text), dtype=numpy.int32)


def _missing_folders(folder: str) -> list[str]:
    """The folders to make for `folder` to exist, outermost first; an error when something on the way is a file."""
    missing = []
    while not os.path.isdir(folder):
        if os.path.lexists(folder):
            raise ValueError(f"output folder {folder} is a file")
        missing.append(folder)
        folder = os.path.dirname(folder)
    return missing[::-1]


def output_paths(output_prefix: str, json_key: str = "text") -> tuple[str, str]:
    """The .bin and .idx files that `preprocess` writes for `output_prefix`: PREFIX_{json_key}_document, or
    the prefix itself when it already ends so (the --data-path name given as the output)."""
    suffix = f"_{json_key}_document"
    prefix = output_prefix if output_prefix.endswith(suffix) else output_prefix + suffix
    return prefix + ".bin", prefix + ".idx"


def preprocess(inputs: list[str], output_prefix: str, tokenizer_path: str, json_key: str = "text",
               workers: int = 1, append_eod: bool = False, overwrite: bool = False) -> dict:
    """Tokenize the JSONL `inputs` into PREFIX_{json_key}_document.bin/.idx; returns the run's summary."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    from megatron_patch.tokenizer import build_tokenizer

    if isinstance(inputs, str):
        inputs = [inputs]
    if not inputs:
        raise ValueError("no input files given")
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    for path in inputs:
        if not os.path.isfile(path):
            raise ValueError(f"input file {path} does not exist")
    bin_path, idx_path = (os.path.abspath(p) for p in output_paths(output_prefix, json_key))
    parent = os.path.dirname(bin_path)
    missing = _missing_folders(parent)
    for path in (bin_path, idx_path):
        if os.path.lexists(path) and not overwrite:
            raise ValueError(f"output {path} already exists (pass --overwrite to replace it)")

    tokenizer = build_tokenizer(tokenizer_path)  # fails here, before any worker starts, on a bad path
    _use_in_this_process(tokenizer, json_key)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    tmp = {name: os.path.join(parent, f".{os.path.basename(path)}.partial-{os.getpid()}")
           for name, path in (("bin", bin_path), ("idx", idx_path))}
    builder = pool = None
    documents = skipped = tokens = 0
    start = time.perf_counter()
    try:
        for folder in missing:
            os.mkdir(folder)
        builder = IndexedDatasetBuilder(tmp["bin"], dtype=dtype)
        lines = _read_lines(inputs)
        if workers > 1:  # fork: the workers inherit the imported modules instead of importing megatron again
            pool = _fork_pool(workers, tokenizer_path, json_key)
            results = pool.imap(_tokenize_line, lines, chunksize=_CHUNK)  # imap keeps the input order
        else:
            results = map(_tokenize_line, lines)
        with tqdm(desc="documents", unit=" docs", file=sys.stderr, dynamic_ncols=True) as bar:
            for ids in results:
                bar.update()
                if not ids.size:
                    skipped += 1
                    continue
                if append_eod:
                    ids = numpy.append(ids, tokenizer.eod)
                builder.add_document(ids, [len(ids)])  # the builder casts to the index dtype
                documents += 1
                tokens += len(ids)
        if not documents:
            raise ValueError(f"no document in {', '.join(inputs)} has any tokens ({skipped} empty "
                             f"'{json_key}' values skipped); nothing written")
        builder.finalize(tmp["idx"])
        os.replace(tmp["bin"], bin_path)
        os.replace(tmp["idx"], idx_path)
    except BaseException:
        if builder is not None:
            builder.data_file.close()
        for path in tmp.values():
            if os.path.lexists(path):
                os.remove(path)
        for folder in reversed(missing):  # the folders this run made, if nothing else was put in them
            if os.path.isdir(folder) and not os.listdir(folder):
                os.rmdir(folder)
        raise
    finally:
        if pool is not None:
            pool.terminate()
    seconds = time.perf_counter() - start
    return {"documents": documents, "skipped_empty": skipped, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "data_path": bin_path[: -len(".bin")], "bin": bin_path, "idx": idx_path}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-patch preprocess-data", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="JSONL files (.jsonl or .jsonl.gz), read in order")
    p.add_argument("--output-prefix", required=True,
                   help="writes PREFIX_{json_key}_document.bin/.idx (a PREFIX already ending in _{json_key}_document "
                        "is used as is; missing folders are made)")
    p.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer", required=True,
                   help="HF tokenizer folder or sentencepiece .model file")
    p.add_argument("--json-key", default="text", help="the field of each JSONL row holding the document")
    p.add_argument("--workers", type=positive_int, default=1, metavar="N", help="tokenizing processes")
    p.add_argument("--append-eod", action="store_true", help="end each document with the tokenizer's eod")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    def work() -> dict:
        summary = preprocess(args.input, args.output_prefix, args.tokenizer, args.json_key, args.workers,
                             args.append_eod, args.overwrite)
        print(f"wrote {summary['bin']} and {summary['idx']}: train with --data-path {summary['data_path']}",
              file=sys.stderr)
        return summary

    return run(work)[0]


if __name__ == "__main__":
    sys.exit(main())
