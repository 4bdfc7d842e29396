#!/usr/bin/env bash
# Shared launcher of the online RL stages (rlhf/ppo.sh, rlhf/grpo.sh), which run their own loop (rollouts on
# megatron-core's inference engine) rather than megatron.training, so they take their own options, not
# examples/launch.sh's: --model DIR (the policy, an HF folder), --tp N (tensor parallel), --pp M (pipeline
# parallel; N x M processes on this node), --dry-run (print the command), --help, wherever they stand; every other
# word (all of them after `--`) goes to python -m megatron_patch.$ENTRY, in order. Environment: PYTHON (python).
set -euo pipefail
# shellcheck source=../examples/common.sh
source "$(dirname "$0")/../examples/common.sh"
ENTRY=${ENTRY:?set by rlhf/ppo.sh or rlhf/grpo.sh: rlhf.ppo or rlhf.grpo}
MODEL="" TP=1 PP=1 ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --tp) TP=$2; shift 2 ;;
    --pp) PP=$2; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage "$0"; exec "${PYTHON:-python}" -m "megatron_patch.$ENTRY" --help ;;
    --) shift; ARGS+=("$@"); break ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
[[ -n "$MODEL" ]] || die "--model HF_DIR is required (the policy to start from)"
positive --tp "$TP"; positive --pp "$PP"
launch "${TORCHRUN[@]}" --standalone --nproc_per_node "$((TP * PP))" -m "megatron_patch.$ENTRY" --hf-dir "$MODEL" \
  --tp "$TP" --pp "$PP" "${ARGS[@]}"
