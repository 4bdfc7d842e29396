#!/usr/bin/env bash
# Fine-tune a llama model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: Llama-3.1-8B; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-Llama-3.1-8B} exec "$(dirname "$0")/../launch.sh" "$@"
