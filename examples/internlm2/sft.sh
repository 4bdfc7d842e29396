#!/usr/bin/env bash
# Fine-tune a internlm2 model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: internlm2_5-7b; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-internlm2_5-7b} exec "$(dirname "$0")/../launch.sh" "$@"
