#!/usr/bin/env bash
# Fine-tune a deepseek_v2 model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: DeepSeek-V2; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-DeepSeek-V2} exec "$(dirname "$0")/../launch.sh" "$@"
