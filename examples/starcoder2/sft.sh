#!/usr/bin/env bash
# Fine-tune a starcoder2 model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: starcoder2-7b; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-starcoder2-7b} exec "$(dirname "$0")/../launch.sh" "$@"
