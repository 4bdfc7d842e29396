"""python -m megatron_patch.torchrun: torchrun (`torch.distributed.run`, the same options) as the launchers run it
(examples/*.sh, rlhf/*.sh), ending the way the package's own tools end:

- the entry point's options are checked before any worker starts, when its module has a `parser()` (generate,
  evaluate, PPO, GRPO): a usage error is one `error:` line and exit 2, not a usage block from every rank;
- a worker that fails has printed its own `error:` line: the launcher exits with its status (the first failure's),
  without torchrun's traceback and failure report; a worker killed by a signal gets one `error:` line naming it;
- SIGTERM (preemption, `scancel`, `timeout`) or Ctrl-C reaches the workers, which stop as the tools do (nothing
  half-written), and the launcher exits 143 (130) without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from megatron_patch.cli import drop_log_messages

# torchrun's log lines that repeat what the exit status and the workers' own `error:` lines say
_REPORTED = (
    ("torch.distributed.elastic.agent.server.api", "Received %s death signal"),
    ("torch.distributed.elastic.multiprocessing.api", "Sending process %s closing signal"),
    ("torch.distributed.elastic.multiprocessing.api", "failed (exitcode: "),
)


class _Usage(Exception):
    pass


def check_entry_options(module: str, argv: list[str]) -> None:
    """Parse the entry point's options with its own parser, in this process: argparse's error as one line."""
    try:
        make_parser = getattr(importlib.import_module(module), "parser", None)
    except ImportError as e:
        raise _Usage(f"cannot import {module}: {e}") from None
    if not callable(make_parser):
        return
    p: argparse.ArgumentParser = make_parser()

    def error(message: str):
        raise _Usage(f"{message} (python -m {module} --help lists the options)")

    p.error = error  # type: ignore[method-assign]
    p.parse_args(argv)  # --help prints the entry point's help and exits 0 here, once


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.module:
        try:
            check_entry_options(args.training_script, args.training_script_args)
        except _Usage as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    drop_log_messages(_REPORTED)
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:
            name = signal.Signals(-failure.exitcode).name
            print(f"error: rank {rank} (pid {failure.pid}) was killed by {name}", file=sys.stderr)
            return 128 - failure.exitcode
        return failure.exitcode
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
