#!/usr/bin/env bash
# Shared launcher of the online RL stages (rlhf/ppo.sh, rlhf/grpo.sh), which run their own loop (rollouts on
# megatron-core's inference engine) rather than megatron.training, so they take their own options, not
# examples/launch.sh's: --model DIR (the policy, an HF folder), --tp N (tensor parallel), --pp M (pipeline
# parallel; N x M processes on this node), --dry-run (print the command), --help; everything else goes to
# python -m megatron_patch.$ENTRY. Environment: PYTHON (python).
set -euo pipefail
ENTRY=${ENTRY:?set by rlhf/ppo.sh or rlhf/grpo.sh: rlhf.ppo or rlhf.grpo}
MODEL="" TP=1 PP=1 DRY=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --tp) TP=$2; shift 2 ;;
    --pp) PP=$2; shift 2 ;;
    --dry-run) DRY=echo; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exec "${PYTHON:-python}" -m "megatron_patch.$ENTRY" --help ;;
    *) break ;;
  esac
done
[[ -n "$MODEL" ]] || { echo "error: --model HF_DIR is required (the policy to start from)" >&2; exit 1; }
[[ "$TP" =~ ^[1-9][0-9]*$ && "$PP" =~ ^[1-9][0-9]*$ ]] || { echo "error: --tp and --pp take positive integers" >&2; exit 1; }
exec $DRY "${PYTHON:-python}" -m torch.distributed.run --standalone --nproc_per_node "$((TP * PP))" \
  -m "megatron_patch.$ENTRY" --hf-dir "$MODEL" --tp "$TP" --pp "$PP" "$@"
