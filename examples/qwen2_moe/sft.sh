#!/usr/bin/env bash
# Fine-tune a qwen2_moe model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: Qwen1.5-MoE-A2.7B; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-Qwen1.5-MoE-A2.7B} exec "$(dirname "$0")/../launch.sh" "$@"
