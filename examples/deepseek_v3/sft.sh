#!/usr/bin/env bash
# Fine-tune a deepseek_v3 model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: DeepSeek-V3; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-DeepSeek-V3} exec "$(dirname "$0")/../launch.sh" "$@"
