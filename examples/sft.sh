#!/usr/bin/env bash
# Fine-tune any registered family on chat / instruction JSONL (packed, assistant-only loss):
# examples/sft.sh --recipe qwen2/Qwen2.5-7B --model Qwen2.5-7B-Instruct --data chats.jsonl --from-hf
# (the recipe's SFT_* values apply). Options and environment: examples/sft.sh --help.
ENTRY=sft exec "$(dirname "$0")/launch.sh" "$@"
