#!/usr/bin/env bash
# Fine-tune a chatglm model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: chatglm3-6b; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-chatglm3-6b} exec "$(dirname "$0")/../launch.sh" "$@"
