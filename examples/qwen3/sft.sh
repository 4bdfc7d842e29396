#!/usr/bin/env bash
# Fine-tune a qwen3 model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: Qwen3-8B; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-Qwen3-8B} exec "$(dirname "$0")/../launch.sh" "$@"
