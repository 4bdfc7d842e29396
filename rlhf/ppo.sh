#!/usr/bin/env bash
# Stage 3 (online), PPO with a critic: rlhf/ppo.sh --model SFT_HF --reward-model RM_HF --prompts prompts.jsonl
# [--tp N] [--pp M] [--dry-run] [any option of python -m megatron_patch.rlhf.ppo --help, e.g. --steps 200 --out ppo_hf],
# in any order.
ENTRY=rlhf.ppo exec "$(dirname "$0")/online.sh" "$@"
