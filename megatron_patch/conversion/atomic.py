"""All-or-nothing output folders: build in a temporary folder beside the target, rename when done.

The temporary folder is `.OUT.partial-HOST-PID-XXXX`. A run killed outright (SIGKILL, a node lost)
cannot clean up after itself, so the next run to the same output looks for such folders: one left by
a process of this machine that no longer exists is removed (and said so); any other is reported with
the command that removes it. Output folders get the permissions the user's umask gives a new folder
(not `mkdtemp`'s private 0700): checkpoints on shared storage are read by teammates and serving jobs."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterable, Iterator

PARTIAL = ".partial-"
OLD = ".old-"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _inside(path: str, folder: str) -> bool:
    """`path` is `folder` or lies under it (after resolving links)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_output(out: str, overwrite: bool = False, sources: Iterable[str | None] = ()) -> str:
    """Refuse, before any work, an output that cannot or must not be written: it exists (without
    `overwrite`), it is an input or holds one (replacing it would delete the input), or its parent is
    missing, a file, or not writable. Returns the absolute path."""
    out = os.path.abspath(out)
    for src in sources:
        if src and os.path.exists(src) and _inside(src, out):
            what = "is" if os.path.realpath(src) == os.path.realpath(out) else "holds"
            raise ValueError(f"the output {out} {what} the input {src}: writing it would destroy the input; "
                             "choose another --out")
    if os.path.lexists(out) and not overwrite:
        raise FileExistsError(f"output {out} already exists (pass --overwrite to replace it)")
    parent = os.path.dirname(out)
    existing = parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise NotADirectoryError(f"cannot create {out}: {existing} is a file, not a folder")
    if existing != parent:
        raise FileNotFoundError(f"cannot create {out}: its parent folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot create {out}: the folder {parent} is not writable")
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def clean_stale(out: str) -> list[str]:
    """Remove the partial folders of `out` left by dead processes of this machine; report the others
    on stderr. Returns the removed paths."""
    parent, base = os.path.split(os.path.abspath(out))
    host, removed = socket.gethostname(), []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in sorted(names):
        path = os.path.join(parent, name)
        if name.startswith(f".{base}{PARTIAL}"):
            owner = name[len(f".{base}{PARTIAL}"):].rsplit("-", 2)  # HOST, PID, random suffix
            pid = int(owner[1]) if len(owner) == 3 and owner[1].isdigit() else None
            if pid is not None and owner[0] == host and pid != os.getpid() and not _pid_alive(pid):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
                print(f"warning: removed {path}, a partial output left by an interrupted run (pid {pid})",
                      file=sys.stderr)
            elif pid is None or owner[0] != host or pid != os.getpid():
                who = f"pid {pid} on {owner[0]}" if pid is not None else "an older run"
                print(f"warning: {path} is the partial output of another run ({who}); if that run is not "
                      f"going on, remove it: rm -rf '{path}'", file=sys.stderr)
        elif name.startswith(f".{base}{OLD}"):
            print(f"warning: {path}/x is an earlier {out} moved aside by a run interrupted while replacing it; "
                  f"restore or remove it", file=sys.stderr)
    return removed


def _follow_umask(folder: str) -> None:
    """Give everything under `folder` the mode a new file / folder gets under the user's umask (some
    writers, safetensors among them, create private 0600 files)."""
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~mask)


def _writable_error(e: OSError, tmp: str, out: str) -> OSError:
    """The same error naming the output instead of the temporary folder it happened in."""
    name = str(e.filename) if e.filename else ""
    if not name.startswith(tmp):
        return e
    return type(e)(e.errno, f"{e.strerror} (writing {out})", out + name[len(tmp):])


@contextlib.contextmanager
def atomic_output_dir(out: str, overwrite: bool = False, sources: Iterable[str | None] = ()) -> Iterator[str]:
    """Yield a fresh temporary folder beside `out`; on success it replaces `out`, on any error
    (Ctrl-C and SIGTERM included) it is removed and `out` is left as it was. `sources`: inputs that
    `out` must not be or contain."""
    out = check_output(out, overwrite, sources)
    parent = os.path.dirname(out)
    clean_stale(out)
    prefix = f".{os.path.basename(out)}{PARTIAL}{socket.gethostname()}-{os.getpid()}-"
    try:
        tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    except OSError as e:
        raise type(e)(e.errno, f"cannot create {out}: {e.strerror}", parent) from None
    try:
        yield tmp
        _follow_umask(tmp)
        if os.path.lexists(out):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}{OLD}", dir=parent)
            os.rename(out, os.path.join(old, "x"))
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _writable_error(e, tmp, out) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
