#!/usr/bin/env bash
# Stage 1, supervised fine-tuning on chat / instruction JSONL (packed, loss on the assistant turns), starting from
# --model's HF weights: rlhf/sft.sh --model BASE_HF --data chats.jsonl [launcher options] [-- --save-hf sft_hf]
# (options: examples/launch.sh --help; entry point: python -m megatron_patch.sft).
ENTRY=sft exec "$(dirname "$0")/../examples/launch.sh" --from-hf "$@"
