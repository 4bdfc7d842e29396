"""Reading JSONL inputs (prompts, conversations, evaluation rows): one object per non-blank line,
`.jsonl` or `.jsonl.gz`, errors naming the file and 1-based line."""

from __future__ import annotations

import gzip
import json


def read_jsonl_numbered(path: str, need_any: tuple[str, ...] = ()) -> list[tuple[int, dict]]:
    """(1-based line number, row) for each row of `path`; with `need_any`, every row must be an object
    with at least one of those keys."""
    opener = gzip.open if path.endswith(".gz") else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {n}: not JSON ({e.msg})") from e
            if need_any and (not isinstance(row, dict) or not set(need_any) & set(row)):
                raise ValueError(f"{path}, line {n}: needs a {' or a '.join(repr(k) for k in need_any)} field")
            rows.append((n, row))
    return rows


def read_jsonl(path: str, need_any: tuple[str, ...] = ()) -> list[dict]:
    """The rows of `path` (see `read_jsonl_numbered`)."""
    return [row for _, row in read_jsonl_numbered(path, need_any)]
