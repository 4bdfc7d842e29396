#!/usr/bin/env bash
# Fine-tune a falcon model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: falcon-7b; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-falcon-7b} exec "$(dirname "$0")/../launch.sh" "$@"
