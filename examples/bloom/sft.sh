#!/usr/bin/env bash
# Fine-tune a bloom model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: bloom-7b1; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-bloom-7b1} exec "$(dirname "$0")/../launch.sh" "$@"
