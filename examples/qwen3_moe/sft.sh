#!/usr/bin/env bash
# Fine-tune a qwen3_moe model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: Qwen3-30B-A3B; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-Qwen3-30B-A3B} exec "$(dirname "$0")/../launch.sh" "$@"
