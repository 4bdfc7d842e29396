#!/usr/bin/env bash
# Fine-tune a baichuan model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: Baichuan2-7B-Base; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-Baichuan2-7B-Base} exec "$(dirname "$0")/../launch.sh" "$@"
