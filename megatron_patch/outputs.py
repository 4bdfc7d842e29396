"""All-or-nothing outputs: a folder (a checkpoint) or a file (results, a report) is built under a
temporary name beside the target and renamed over it when done; outputs are checked before any work.

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
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from typing import BinaryIO, TextIO

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


def _location_problem(out: str) -> str | None:
    """Why `out` cannot be created in its folder (missing, a file, not writable), or None."""
    parent = os.path.dirname(out)
    existing = parent
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a folder"
    if existing != parent:
        return f"its parent folder {parent} does not exist"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the folder {parent} is not writable"
    return None


def check_output(out: str, overwrite: bool = False, sources: Iterable[str | None] | Mapping[str, str | None] = (),
                 *, flag: str | None = None, overwrite_flag: str | None = "--overwrite",
                 outputs: Mapping[str, str | None] | None = None, created_first: Iterable[str | None] = ()) -> str:
    """Refuse, before any work, an output folder that cannot or must not be written: it is an input, holds
    one (replacing it would delete the input) or is an existing part of one (e.g. a checkpoint's hf/ folder);
    it is or holds another output of the same command (`outputs`, by flag, existing yet or not); it exists
    (without `overwrite`); or its parent is missing, a file, or not writable (unless the parent is or holds
    one of `created_first`, folders the command creates with their parents before writing `out`, e.g. a
    training run's --save). Every tool that writes calls this one check. `sources`: the input paths, or
    {flag: path}; `flag`: the output's option, named in the errors; `overwrite_flag`: the option that allows
    replacing an existing output (None: the tool has none). Returns the absolute path."""
    out = os.path.abspath(out)
    who, choose = (f"{flag} {out}", f"choose another {flag}") if flag else (f"the output {out}", "choose another --out")
    named = sources.items() if isinstance(sources, Mapping) else ((None, s) for s in sources)
    for src_flag, src in named:
        what = f"the input {src}" + (f" ({src_flag})" if src_flag else "")
        if src and os.path.exists(src) and _inside(src, out):
            rel = "is" if os.path.realpath(src) == os.path.realpath(out) else "holds"
            raise ValueError(f"{who} {rel} {what}: writing it would destroy the input; {choose}")
        if src and os.path.isdir(src) and os.path.lexists(out) and _inside(out, src):
            raise ValueError(f"{who} is part of {what}: replacing it would change the input; {choose}")
    for other_flag, other in (outputs or {}).items():
        if other and _inside(other, out):
            rel = "is" if os.path.realpath(other) == os.path.realpath(out) else "holds"
            raise ValueError(f"{who} {rel} the {other_flag} folder {os.path.abspath(other)}, which this run also "
                             f"writes; {choose}")
    if os.path.lexists(out) and not overwrite:
        hint = f" (pass {overwrite_flag} to replace it)" if overwrite_flag else f"; {choose} or remove it"
        raise FileExistsError(f"{flag + ' ' if flag else 'output '}{out} already exists{hint}")
    made_first = any(folder and _inside(folder, os.path.dirname(out)) for folder in created_first)
    problem = None if made_first else _location_problem(out)
    if problem:
        raise ValueError(f"cannot create {flag + ' ' if flag else ''}{out}: {problem}")
    return out


def check_output_file(path: str, flag: str) -> None:
    """Refuse now, before any work, an output file that could not be written at the end: `path` is a
    folder or an unwritable file, or its folder is missing, a file, or not writable. `flag` names the
    option in the error."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder; pass a file path")
    problem = _location_problem(os.path.abspath(path))
    if problem:
        raise ValueError(f"{flag} {path}: {problem}")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path} is not writable")


@contextlib.contextmanager
def atomic_output_file(path: str, binary: bool = False) -> Iterator[TextIO | BinaryIO]:
    """A text file (`binary`: a binary one) to write `path` through: a temporary file beside it, renamed over
    `path` when the block ends normally, removed on any error (Ctrl-C and SIGTERM included), leaving `path` as
    it was. The file gets the mode `open(path, "w")` would give it: an existing file's, else 0o666 less the
    umask (a temporary file is created private, 0o600)."""
    path = os.path.abspath(path)
    mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.isfile(path) else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}{PARTIAL}", dir=os.path.dirname(path))
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")) as f:
            yield f
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


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
def atomic_output_dir(out: str, overwrite: bool = False,
                      sources: Iterable[str | None] | Mapping[str, str | None] = ()) -> Iterator[str]:
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
