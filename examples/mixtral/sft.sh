#!/usr/bin/env bash
# Fine-tune a mixtral model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: Mixtral-8x7B-v0.1; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-Mixtral-8x7B-v0.1} exec "$(dirname "$0")/../launch.sh" "$@"
