"""All-or-nothing output folders: build in a temporary folder beside the target, rename when done."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def atomic_output_dir(out: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a fresh temporary folder beside `out`; on success it replaces `out`, on any error it is
    removed and `out` is left as it was."""
    out = os.path.abspath(out)
    if os.path.lexists(out) and not overwrite:
        raise FileExistsError(f"output {out} already exists (pass --overwrite to replace it)")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"parent folder of the output, {parent}, does not exist")
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    try:
        yield tmp
        if os.path.lexists(out):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=parent)
            os.rename(out, os.path.join(old, "x"))
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
