#!/usr/bin/env bash
# DPO for a glm4 model on preference JSONL; the reference is --model's weights (options: examples/launch.sh,
# plus megatron_patch.rlhf.dpo's --beta / --sft-weight after them). PP must be 1.
ENTRY=rlhf.dpo MODEL=${MODEL:-GLM-4-9B-0414} exec "$(dirname "$0")/../launch.sh" --from-hf "$@"
