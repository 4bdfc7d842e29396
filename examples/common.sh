# shellcheck shell=bash
# What the launchers share, sourced by examples/launch.sh, generate.sh, evaluate.sh, convert.sh and rlhf/online.sh
# (not a launcher itself): errors, usage, recipes (their values from python -m megatron_patch.recipes), the options
# of the tools that run on a checkpoint, and how a command is started or, with --dry-run, printed. Commands start
# torchrun through megatron_patch.torchrun: torch.distributed.run with the same options, ending as the package's
# tools end (a worker's `error:` line without torchrun's traceback, 143 for SIGTERM, the entry point's usage errors
# before any worker starts).

EXAMPLES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TORCHRUN=("${PYTHON:-python}" -m megatron_patch.torchrun)
DRY_RUN=0

die() { echo "error: $*" >&2; exit 1; }

# The usage of script $1: its first comment block, down to `set -euo pipefail`.
usage() { sed -n '2,/^set -euo/p' "$1" | sed '$d; s/^# \{0,1\}//'; }

positive() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 takes a positive integer, got '$2'"; }

# --recipe NAME (use_recipe NAME): examples/NAME.env or the file NAME, read by megatron_patch/recipes.py, where the
# recipe rules are (the file's format, each task's keys, the precedence, the learning rates, what --cpu leaves out).
# recipe_values [--task TASK] [--cpu] [--lora] NAME[=GIVEN] ...: set each NAME to the value it takes with the
# recipe (GIVEN: the option's value here, empty if not given): python -m megatron_patch.recipes prints them as
# shell assignments; a recipe's error is its one `error:` line, and this script exits with its status.
RECIPE="" RECIPE_OPTION=()
use_recipe() { RECIPE=$1 RECIPE_OPTION=(--recipe="$1"); }
recipe_values() {
  local values
  values=$("${PYTHON:-python}" -m megatron_patch.recipes --examples="$EXAMPLES" "${RECIPE_OPTION[@]}" "$@") || exit
  eval "$values"
}

# launch [VAR=VALUE ...] CMD ...: start CMD in place of this script, or with --dry-run print it (shell-quoted).
launch() {
  if [[ "$DRY_RUN" == 1 ]]; then printf '%q ' "$@"; echo; exit 0; fi
  while [[ "$1" =~ ^[A-Z_][A-Z0-9_]*= ]]; do export "${1?}"; shift; done
  exec "$@"
}

# run CMD ...: run CMD (this script goes on after it), or with --dry-run print it.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi
}

# tool_options "$@": the options of the tools that run on a checkpoint (examples/generate.sh, evaluate.sh,
# convert.sh), wherever they stand: --recipe, --tp/--pp/--ep (TP, PP, EP: given, else the recipe's, else 1;
# RECIPE_MODEL: the recipe's HF folder; from recipe_values, so these tools need $PYTHON), --dry-run, --help. The
# words before the first other option are POSITIONAL; the rest (all of it after `--`) ARGS.
tool_options() {
  POSITIONAL=() ARGS=() TP="" PP="" EP=""
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --recipe) use_recipe "$2"; shift 2 ;;
      --tp) TP=$2; shift 2 ;;
      --pp) PP=$2; shift 2 ;;
      --ep) EP=$2; shift 2 ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h|--help) usage "$0"; exit 0 ;;
      --) shift; ARGS+=("$@"); break ;;
      -*) ARGS+=("$1"); shift ;;
      *) if [[ ${#ARGS[@]} == 0 ]]; then POSITIONAL+=("$1"); else ARGS+=("$1"); fi; shift ;;
    esac
  done
  recipe_values TP="$TP" PP="$PP" EP="$EP" RECIPE_MODEL
  positive --tp "$TP"; positive --pp "$PP"; positive --ep "$EP"
}

# checkpoint_tool ENTRY "$@": examples/generate.sh and evaluate.sh: python -m megatron_patch.ENTRY on CKPT (a
# Megatron checkpoint folder; with --recipe and no CKPT: the recipe's HF folder, converted in memory) under torchrun
# with TP x PP x EP processes on this node.
checkpoint_tool() {
  local entry=$1 model
  shift
  tool_options "$@"
  if [[ ${#POSITIONAL[@]} -gt 0 ]]; then
    [[ -d "${POSITIONAL[0]}" ]] || die "CKPT ${POSITIONAL[0]}: no such folder (examples/$entry.sh CKPT: a Megatron checkpoint folder)"
    model=(--mcore-dir "${POSITIONAL[0]}" "${POSITIONAL[@]:1}")
  elif [[ -n "$RECIPE" ]]; then
    model=(--hf-dir "$RECIPE_MODEL")
  else
    die "examples/$entry.sh needs CKPT (a Megatron checkpoint folder) or --recipe FAMILY/MODEL (its HF folder)"
  fi
  launch "${TORCHRUN[@]}" --standalone --nproc_per_node "$((TP * PP * EP))" -m "megatron_patch.$entry" \
    "${model[@]}" --tp "$TP" --pp "$PP" --ep "$EP" "${ARGS[@]}"
}
