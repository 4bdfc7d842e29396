"""A benchmark's measured results kept in a JSON-lines file as they are measured (`--results FILE`), so that one
command spread over several calls of a time-limited machine (the GPU machine gives 10 minutes a call) makes one
table: run again with the same file, it takes the results measured before and measures the rest.

The file's first line is the identity of what was measured: the machine (host name and GPU), the code (a hash of
the project's Python sources; both from benchmarks/machine.py), the versions and the command's settings. A file of
another identity is refused in one line (`error: ...`), since a table compares rows of one machine, one code and
one setting; a result that failed is not kept, so the next call measures it again. Each kept result is one line,
written and flushed as soon as it is measured (a call cut by its time limit loses only the result it was
measuring)."""

from __future__ import annotations

import json
import os


class ResultsFile:
    """Results by key (e.g. "8b|ours fp8"), kept in `path` (None: nothing kept, every result measured)."""

    def __init__(self, path: str | None, identity: dict):
        self.path, self.identity, self.stored = path, identity, {}
        if not path:
            return
        if os.path.exists(path) and os.path.getsize(path) > 0:
            kept, self.stored = _load(path)
            if kept != identity:
                raise SystemExit(f"error: --results {path} holds results of another {_difference(kept, identity)}: "
                                 "give a new file")
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._append({"identity": identity})

    def _append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def get(self, key: str) -> dict | None:
        """The result kept under `key`, if any."""
        return self.stored.get(key)

    def measured(self, key: str, measure, failed: str = "error") -> dict:
        """The result kept under `key`, or `measure()`'s (a dict; kept unless it holds the key `failed`)."""
        if key in self.stored:
            return self.stored[key]
        result = measure()
        if self.path and failed not in result:
            self.stored[key] = result
            self._append({"key": key, "result": result})
        return result


def read(path: str) -> tuple[dict, dict[str, dict]]:
    """A results file's identity and its kept results by key, to print its table elsewhere (`train_bench.py
    --report`): one line, `error: ...`, where the file is missing, empty or not a results file."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        raise SystemExit(f"error: {path}: no results file there")
    identity, results = _load(path)
    if not isinstance(identity, dict):
        raise SystemExit(f"error: {path}, line 1: not a results file (no identity line)")
    return identity, results


def _load(path: str) -> tuple[dict | None, dict[str, dict]]:
    """The identity of a file's first line (None: none there) and its kept results by key."""
    lines = _read(path)
    return (lines[0].get("identity") if lines else None), {line["key"]: line["result"] for line in lines[1:]}


def _read(path: str) -> list[dict]:
    """The file's records; a last line cut short (the call stopped while it was written) is dropped from the file,
    its row measured again; a broken line before the last is an error."""
    with open(path) as f:
        texts = [line for line in f.read().split("\n") if line.strip()]
    records = []
    for i, text in enumerate(texts):
        try:
            records.append(json.loads(text))
        except json.JSONDecodeError as e:
            if i < len(texts) - 1:
                raise SystemExit(f"error: --results {path}, line {i + 1}: not JSON ({e.msg}): give a new file") from e
            with open(path + ".tmp", "w") as f:  # the file without it, so that the next line starts a line
                f.write("".join(json.dumps(r) + "\n" for r in records))
            os.replace(path + ".tmp", path)
    return records


def _difference(kept: dict | None, identity: dict) -> str:
    """Which part of the identity differs, for the error line: machine, code, versions or settings."""
    if not isinstance(kept, dict):
        return "kind (no identity line)"
    for part in identity:
        if kept.get(part) != identity[part]:
            return f"{part} ({kept.get(part)} against this run's {identity[part]})"
    return f"identity ({sorted(set(kept) - set(identity))} beyond this run's)"
