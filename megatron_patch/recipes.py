"""The recipes of released model sizes (examples/<family>/<Model>.env) and the training launchers' rules for them,
in one place: examples/launch.sh and examples/common.sh ask `python -m megatron_patch.recipes` for the values they
use (printed as shell assignments), and the tests import the same functions.

A recipe is KEY=VALUE lines (VALUE bare or "double-quoted"; # comments, blank lines); a key it does not know is an
error naming FILE:LINE. RECIPE_KEYS apply to every task; PRETRAIN_, SFT_, RM_ or DPO_ + one of TASK_KEYS to that
task alone. A value of a task (`task_values`): the option given on the command line, else the task's own key,
else the recipe's key, else the launcher's default (DEFAULTS); an empty value counts as not set. The learning
rates: a recipe's LR is pretraining's, so another task needs its own <TASK>_LR or a given --lr; a recipe's MIN_LR
goes with its LR (not with a task's own LR nor a given one); MIN_LR defaults to LR / 10 (printed as awk's and C's
%g); --lora's default LR is 1e-4. --cpu runs fp32 without a recipe's PRECISION and GPU_ARGS, and leaves out its
virtual pipeline and context parallelism (`cpu_note` says so).

Library code: the standard library only (no torch, megatron or command-line modules), so that the launchers'
question costs a bare interpreter's start.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from collections.abc import Mapping

# examples/ of this source tree (the launchers pass their own)
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

RECIPE_KEYS = ("HF_ID", "LAYERS", "HEADS", "KV_HEADS", "EXPERTS", "GPUS", "TP", "PP", "VPP", "CP", "EP", "ETP", "SEQ",
               "MBS", "GBS", "LR", "MIN_LR", "PRECISION", "PROFILE", "GPU_ARGS")
TASKS = ("PRETRAIN", "SFT", "RM", "DPO")
TASK_KEYS = ("TP", "PP", "VPP", "CP", "EP", "ETP", "SEQ", "MBS", "GBS", "LR", "MIN_LR", "GPU_ARGS")
# the launcher's defaults (ETP empty: not passed, Megatron's default is TP); MIN_LR's is LR / 10
DEFAULTS = {"TP": "1", "PP": "1", "VPP": "1", "CP": "1", "EP": "1", "ETP": "", "SEQ": "4096", "MBS": "1",
            "GBS": "32", "LR": "3e-4", "PRECISION": "bf16", "PROFILE": "default", "GPU_ARGS": ""}
LORA_LR = "1e-4"  # adapters learn at a higher rate than full fine-tuning
CPU_PRECISION = "fp32"
CPU_LEAVES_OUT = (("VPP", "virtual pipeline"), ("CP", "context parallelism"))  # a tiny model; local attention

# POSIX [[:space:]], as the bash reader matched it (not Python's Unicode \s)
_SPACE = " \t\n\r\f\v"
_BLANK = re.compile(rf"[{_SPACE}]*(#.*)?", re.S)
_LINE = re.compile(rf'([A-Z0-9_]+)=(?:"([^"]*)"|([^{_SPACE}"#]*))[{_SPACE}]*(#.*)?', re.S)
_NUMBER = re.compile(r"[ \t]*[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?[ \t]*")


class RecipeError(ValueError):
    """A recipe (or the options with it) the launchers cannot use: the message says where and what."""


def known_key(key: str) -> bool:
    """A key a recipe may set: one of RECIPE_KEYS, or a task's (PRETRAIN_/SFT_/RM_/DPO_ + one of TASK_KEYS)."""
    task, _, rest = key.partition("_")
    return key in RECIPE_KEYS or (task in TASKS and rest in TASK_KEYS)


def read_recipe(path: str) -> dict[str, str]:
    """A recipe file as {KEY: VALUE} (a key set twice: the last value); RecipeError names FILE:LINE."""
    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            text = f.read()
    except OSError as e:
        raise RecipeError(f"{path}: {e.strerror or e}") from None
    lines = text.split("\n")  # lines end at \n only (a \r before it is space)
    if lines[-1] == "":
        lines.pop()
    out: dict[str, str] = {}
    for n, line in enumerate(lines, 1):
        if _BLANK.fullmatch(line):
            continue
        m = _LINE.fullmatch(line)
        if not m:
            raise RecipeError(f"{path}:{n}: not a KEY=VALUE line: {line}")
        if not known_key(m[1]):
            raise RecipeError(f"{path}:{n}: unknown key {m[1]} (keys: {' '.join(RECIPE_KEYS)}; per task: "
                              f"{'/'.join(t + '_' for t in TASKS)} + {' '.join(TASK_KEYS)})")
        out[m[1]] = m[2] if m[2] is not None else m[3]
    return out


def find_recipe(name: str, examples_dir: str = EXAMPLES) -> str:
    """--recipe NAME: the file NAME if there is one, else examples_dir/NAME.env (FAMILY/MODEL)."""
    for path in (name, os.path.join(examples_dir, f"{name}.env")):
        if os.path.isfile(path):
            return path
    raise RecipeError(f"--recipe {name}: no such recipe (examples/<family>/README.md lists them: FAMILY/MODEL)")


def recipe_model(recipe: Mapping[str, str] | None) -> str:
    """The recipe's model folder: the last part of its HF_ID (empty without one)."""
    return (recipe or {}).get("HF_ID", "").rsplit("/", 1)[-1]


def _lookup(recipe: Mapping[str, str], task: str | None, key: str, default: str) -> str:
    """The task's own value, else the recipe's, else the default (an empty value is no value)."""
    return (recipe.get(f"{task}_{key}") if task else None) or recipe.get(key) or default


def _cpu_left_out(recipe: Mapping[str, str] | None, task: str | None, given: Mapping[str, str]) -> list[tuple]:
    """(key, what, the recipe's value) of what --cpu leaves out: a recipe's VPP / CP other than 1, not given."""
    if recipe is None:
        return []
    return [(key, what, value) for key, what in CPU_LEAVES_OUT
            if not given.get(key) and (value := _lookup(recipe, task, key, "1")) != "1"]


def cpu_note(recipe: Mapping[str, str] | None, task: str | None, given: Mapping[str, str] | None = None,
             name: str = "") -> str | None:
    """The line --cpu prints (on stderr) when it leaves out a recipe's virtual pipeline or context parallelism."""
    left = _cpu_left_out(recipe, task, given or {})
    if not left:
        return None
    return (f"note: --cpu leaves out what a CPU run cannot use: recipe {name}'s "
            + ", ".join(f"{what} ({key} {value})" for key, what, value in left))


def _tenth(lr: str, source: str) -> str:
    """LR / 10 as awk's printf %g writes it (the launcher's MIN_LR default); `source` names where LR came from."""
    if not _NUMBER.fullmatch(lr):
        raise RecipeError(f"{source} takes a number, got '{lr}'")
    return f"{float(lr) / 10:g}"


def task_values(recipe: Mapping[str, str] | None, task: str | None, given: Mapping[str, str] | None = None, *,
                cpu: bool = False, lora: bool = False, name: str = "") -> dict[str, str]:
    """What the launcher uses for `task` (PRETRAIN, SFT, RM, DPO; None: the recipe's own keys only) with `recipe`
    (None: no --recipe; `name`: as --recipe named it, for the messages) and the options `given` ({KEY: VALUE}, an
    empty VALUE is not given), with the launcher's --cpu and --lora: every DEFAULTS key and MIN_LR (the rules: this
    module's docstring). RecipeError: a task other than pretraining with a recipe and no learning rate of its own."""
    given = {k: v for k, v in (given or {}).items() if v}
    r = recipe or {}
    lr_source = "--lr" if given.get("LR") else None
    if lora and not given.get("LR"):
        given["LR"] = LORA_LR
    own_lr = bool(task and r.get(f"{task}_LR"))
    if recipe is not None and task not in (None, "PRETRAIN") and not given.get("LR") and not own_lr:
        raise RecipeError(f"recipe {name} sets no {task}_LR (its LR is for pretraining): pass --lr")
    if cpu:  # the recipe's VPP and CP left out (cpu_note says which)
        given.update({key: "1" for key, _, _ in _cpu_left_out(recipe, task, given)})
    out = {key: given.get(key) or _lookup(r, task, key, default) for key, default in DEFAULTS.items()}
    if cpu:
        out["PRECISION"] = given.get("PRECISION") or CPU_PRECISION
        out["GPU_ARGS"] = ""
    # MIN_LR: given, else the task's own, else the recipe's when the recipe's LR is the one in use, else LR / 10
    min_lr = given.get("MIN_LR") or (r.get(f"{task}_MIN_LR") if task else None)
    if not min_lr and not given.get("LR") and not own_lr:
        min_lr = r.get("MIN_LR")
    if not min_lr:
        lr_source = lr_source or f"recipe {name}'s {f'{task}_LR' if own_lr else 'LR'}"
        min_lr = _tenth(out["LR"], lr_source)
    out["MIN_LR"] = min_lr
    return out


# ---- python -m megatron_patch.recipes ----------------------------------------------------------------------------

NAMES = (*DEFAULTS, "MIN_LR", "MODEL", "RECIPE_MODEL", "GPUS")


class _Usage(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _Usage(message)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m megatron_patch.recipes", allow_abbrev=False,
                description="The values a training launcher (examples/launch.sh) or a checkpoint tool "
                            "(examples/common.sh) uses, printed as shell assignments (NAME='VALUE', one a line) "
                            "for bash to eval; a recipe's error is one `error:` line and exit 1 (a usage error: "
                            "exit 2).")
    p.add_argument("--recipe", metavar="NAME", help="FAMILY/MODEL (examples/FAMILY/MODEL.env) or a recipe file")
    p.add_argument("--examples", metavar="DIR", default=EXAMPLES, help="where FAMILY/MODEL.env are (%(default)s)")
    p.add_argument("--task", metavar="TASK", help="PRETRAIN, SFT, RM or DPO: its own keys and LR rule apply "
                   "(default: none, the recipe's own keys)")
    p.add_argument("--cpu", action="store_true", help="the launcher's --cpu (fp32; no VPP, CP or GPU_ARGS)")
    p.add_argument("--lora", action="store_true", help=f"the launcher's --lora (default LR {LORA_LR})")
    p.add_argument("names", nargs="*", metavar="NAME[=GIVEN]",
                   help=f"what to print: {', '.join(NAMES)} (MODEL: the --model folder, RECIPE_MODEL: the recipe's, "
                        "GPUS: its GPU count); =GIVEN: the option's value on the command line (empty: not given). "
                        "Default: all of them")
    return p


def _answer(argv: list[str] | None) -> tuple[list[str], str | None]:
    """The assignment lines to print, and the note (or None) for stderr."""
    args = parser().parse_args(argv)
    given: dict[str, str] = {}
    names: list[str] = []
    for word in args.names or NAMES:
        key, has_value, value = word.partition("=")
        if key not in NAMES:
            raise _Usage(f"unknown NAME {key!r} (one of: {' '.join(NAMES)})")
        names.append(key)
        if has_value:
            given[key] = value
    if args.task is not None and not re.fullmatch(r"[A-Z0-9_]+", args.task):
        raise _Usage(f"--task takes an upper-case name (PRETRAIN, SFT, RM, DPO), got {args.task!r}")
    recipe = None if args.recipe is None else read_recipe(find_recipe(args.recipe, args.examples))
    name = args.recipe or ""
    values = task_values(recipe, args.task, given, cpu=args.cpu, lora=args.lora, name=name)
    values["RECIPE_MODEL"] = recipe_model(recipe)
    values["MODEL"] = given.get("MODEL") or values["RECIPE_MODEL"]
    values["GPUS"] = given.get("GPUS") or (recipe or {}).get("GPUS", "")
    note = cpu_note(recipe, args.task, given, name) if args.cpu else None
    return [f"{key}={shlex.quote(values[key])}" for key in names], note


def main(argv: list[str] | None = None) -> int:
    try:
        lines, note = _answer(argv)
    except _Usage as e:
        print(f"error: {e} (python -m megatron_patch.recipes --help lists the options)", file=sys.stderr)
        return 2
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if note:
        print(note, file=sys.stderr)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
