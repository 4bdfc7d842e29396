#!/usr/bin/env bash
# Fine-tune a mistral model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: Mistral-7B-v0.3; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-Mistral-7B-v0.3} exec "$(dirname "$0")/../launch.sh" "$@"
