#!/usr/bin/env bash
# DPO for a mixtral model on preference JSONL; the reference is --model's weights (options: examples/launch.sh,
# plus megatron_patch.rlhf.dpo's --beta / --sft-weight after them). PP must be 1.
ENTRY=rlhf.dpo MODEL=${MODEL:-Mixtral-8x7B-v0.1} exec "$(dirname "$0")/../launch.sh" --from-hf "$@"
