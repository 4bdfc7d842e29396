#!/usr/bin/env bash
# Fine-tune a qwen2 model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: Qwen2.5-7B; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-Qwen2.5-7B} exec "$(dirname "$0")/../launch.sh" "$@"
