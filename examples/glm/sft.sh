#!/usr/bin/env bash
# Fine-tune a glm model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: glm-4-9b-hf; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-glm-4-9b-hf} exec "$(dirname "$0")/../launch.sh" "$@"
