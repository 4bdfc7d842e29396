"""What every command-line tool of the package does around its work (the converter, preprocessing,
generate, evaluate, the trainers): one JSON summary line on success (exit 0); for bad input an
`error: ...` line on stderr with exit 1; Ctrl-C (exit 130) and SIGTERM (preemption, `timeout`,
`scancel`; exit 143) end the work the same way, so the tools' atomic writes leave nothing behind.
MEGATRON_PATCH_TRACEBACK=1 adds the traceback behind an error.

Kept free of heavy imports: a tool's `--help` should not wait for torch or megatron-core."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any, TextIO

# the errors a tool reports as one line (anything else is a bug and keeps its traceback)
USER_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, KeyError, RuntimeError)


class Terminated(KeyboardInterrupt):
    """SIGTERM, delivered as an interruption so that every `finally` / cleanup runs as for Ctrl-C."""


_SIGNALS: list[int] = []  # the interrupting signals received while a tool works


def _on_signal(signum, frame):
    """Record the signal, then interrupt: a cleanup that fails on the way (a half-written file's writer
    raising its own error) cannot turn an interruption into another error."""
    _SIGNALS.append(signum)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


# Third-party notices that say nothing to a user of these tools: (logger, message start) for logging,
# (category, message regex) for warnings.
_QUIET_LOGS = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    ("torch.utils.cpp_extension", "No CUDA runtime"),
)
_MEGATRON_NOTICES = (r"Transformer Engine and Apex are not installed", r"Apex is not installed",
                     r"full scope is deprecated")
_QUIET_WARNINGS = (
    (UserWarning, r""),  # narrowed to its messages below
    (FutureWarning, r".*ShardedTensor"),
    (FutureWarning, r".*`torch\.distributed\._shard"),
    (DeprecationWarning, r".*ShardedTensor"),
)


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def drop_log_messages(messages: tuple[tuple[str, str], ...]) -> None:
    """Drop the log records of each (logger, message start) pair (idempotent)."""
    for name, prefix in messages:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) and f.prefix == prefix for f in log.filters):
            log.addFilter(_DropMessages(prefix))


def quiet_third_party() -> None:
    """Silence the known third-party notices (idempotent; call before importing megatron-core)."""
    drop_log_messages(_QUIET_LOGS)
    # megatron-core's notices about optional kernels (Transformer Engine, Apex) absent on a CPU and a default
    # of its own config; its other warnings stay visible
    for message in _MEGATRON_NOTICES:
        warnings.filterwarnings("ignore", category=UserWarning, message=message, module=r"megatron\.")
    # DCP's notices about loading without a process group and its changed argument order
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.checkpoint")
    for category, message in _QUIET_WARNINGS[1:]:
        warnings.filterwarnings("ignore", category=category, message=message)


def finite_json(value: Any) -> tuple[Any, list[str]]:
    """`value` with every non-finite float replaced by None, and the paths where that happened
    (JSON has no NaN/Infinity; writing them would make the line unreadable for strict parsers)."""
    bad: list[str] = []

    def walk(v: Any, path: str) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            bad.append(path or "value")
            return None
        if isinstance(v, dict):
            return {k: walk(x, f"{path}.{k}" if path else str(k)) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x, f"{path}[{i}]") for i, x in enumerate(v)]
        return v

    return walk(value, ""), bad


def process_seconds() -> float:
    """Wall time since this process started (imports included), as a user timing the command sees it."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # psutil missing or /proc unreadable: time since this module's import
        return time.time() - _IMPORTED


_IMPORTED = time.time()


def run(work: Callable[[], Any], summary: TextIO | str | None = "stdout",
        errors: tuple[type[BaseException], ...] = USER_ERRORS) -> tuple[int, Any]:
    """Run a tool's work: (exit code, result). A dict result gets `wall_seconds` and is printed as one
    JSON line on `summary` (a stream, or "stdout" / "stderr": the one current at the end; None: not
    printed; rank 0 only under torchrun)."""
    quiet_third_party()
    previous = {}
    _SIGNALS.clear()
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        result = work()
    except BaseException as e:
        # an interruption, however the work's cleanup reported it
        if _SIGNALS or isinstance(e, KeyboardInterrupt):
            if _SIGNALS[:1] == [signal.SIGTERM] or isinstance(e, Terminated):
                print("\nerror: terminated (SIGTERM); no output was left behind", file=sys.stderr)
                return 143, None
            print("\nerror: interrupted; no output was left behind", file=sys.stderr)
            return 130, None
        if not isinstance(e, errors):
            raise
        if os.environ.get("MEGATRON_PATCH_TRACEBACK"):
            traceback.print_exc()
        print(f"\nerror: {error_text(e)}", file=sys.stderr)  # newline: a progress bar may own the line
        return 1, None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if isinstance(result, dict):
        result = {**result, "wall_seconds": round(process_seconds(), 2)}
    if summary is not None and result is not None and is_first_rank():
        clean, bad = finite_json(result)
        if bad:
            print(f"warning: non-finite values reported as null: {', '.join(bad)}", file=sys.stderr)
        stream = getattr(sys, summary) if isinstance(summary, str) else summary
        print(json.dumps(clean), file=stream, flush=True)
    return 0, result


def error_text(e: BaseException) -> str:
    """One line for an exception: its message, else its type."""
    text = str(e.args[0]) if isinstance(e, KeyError) and len(e.args) == 1 else str(e)  # KeyError quotes its text
    text = " ".join(text.split())  # one line
    return text or type(e).__name__


def is_first_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help that keeps the description as written (a tool's docstring), shows each option's default
    (when it has one the help does not already state) and marks required options."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required and action.option_strings:
            return f"{text} (required)" if text else "(required)"
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value
