# shellcheck shell=bash
# What the launchers share, sourced by examples/launch.sh, generate.sh, evaluate.sh, convert.sh and rlhf/online.sh
# (not a launcher itself): errors, usage, recipes, the options of the tools that run on a checkpoint, and how a
# command is started or, with --dry-run, printed. Commands start torchrun through megatron_patch.torchrun:
# torch.distributed.run with the same options, ending as the package's tools end (a worker's `error:` line without
# torchrun's traceback, 143 for SIGTERM, the entry point's usage errors before any worker starts).

EXAMPLES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TORCHRUN=("${PYTHON:-python}" -m megatron_patch.torchrun)
DRY_RUN=0

die() { echo "error: $*" >&2; exit 1; }

# The usage of script $1: its first comment block, down to `set -euo pipefail`.
usage() { sed -n '2,/^set -euo/p' "$1" | sed '$d; s/^# \{0,1\}//'; }

positive() { [[ "$2" =~ ^[1-9][0-9]*$ ]] || die "$1 takes a positive integer, got '$2'"; }

# A recipe: KEY=VALUE lines (VALUE bare or "double-quoted"), # comments; an unknown key is an error.
RECIPE_KEYS=" HF_ID LAYERS HEADS KV_HEADS EXPERTS GPUS TP PP VPP CP EP ETP SEQ MBS GBS LR MIN_LR PRECISION PROFILE"
RECIPE_KEYS+=" GPU_ARGS "
TASK_KEYS=" TP PP VPP CP EP ETP SEQ MBS GBS LR MIN_LR GPU_ARGS "
RECIPE="" RECIPE_MODEL=""
declare -A R=()
read_recipe() {
  local file=$1 line key n=0
  while IFS= read -r line || [[ -n "$line" ]]; do
    n=$((n + 1))
    [[ "$line" =~ ^[[:space:]]*(#.*)?$ ]] && continue
    [[ "$line" =~ ^([A-Z0-9_]+)=(\"([^\"]*)\"|([^[:space:]\"#]*))[[:space:]]*(#.*)?$ ]] \
      || die "$file:$n: not a KEY=VALUE line: $line"
    key=${BASH_REMATCH[1]}
    [[ "$RECIPE_KEYS" == *" $key "* ||
       ( " PRETRAIN SFT RM DPO " == *" ${key%%_*} "* && "$TASK_KEYS" == *" ${key#*_} "* ) ]] \
      || die "$file:$n: unknown key $key (keys: $RECIPE_KEYS; per task: PRETRAIN_/SFT_/RM_/DPO_ +$TASK_KEYS)"
    R[$key]=${BASH_REMATCH[3]}${BASH_REMATCH[4]}
  done < "$file"
}

# --recipe NAME: examples/NAME.env, or the file NAME, into R; the last part of its HF_ID is the model folder.
load_recipe() {
  local file=$1
  [[ -f "$file" ]] || file="$EXAMPLES/$1.env"
  [[ -f "$file" ]] || die "--recipe $1: no such recipe (examples/<family>/README.md lists them: FAMILY/MODEL)"
  RECIPE=$1
  read_recipe "$file"
  local hf_id=${R[HF_ID]:-}
  RECIPE_MODEL=${hf_id##*/}
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
# convert.sh), wherever they stand: --recipe, --tp/--pp/--ep (TP, PP, EP: given, else the recipe's, else 1),
# --dry-run, --help. The words before the first other option are POSITIONAL; the rest (all of it after `--`) ARGS.
tool_options() {
  POSITIONAL=() ARGS=() TP="" PP="" EP=""
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --recipe) load_recipe "$2"; shift 2 ;;
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
  TP=${TP:-${R[TP]:-1}} PP=${PP:-${R[PP]:-1}} EP=${EP:-${R[EP]:-1}}
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
