#!/usr/bin/env bash
# Fine-tune a yi model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: Yi-6B; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-Yi-6B} exec "$(dirname "$0")/../launch.sh" "$@"
