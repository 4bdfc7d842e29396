#!/usr/bin/env bash
# Fine-tune a glm4 model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: GLM-4-9B-0414; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-GLM-4-9B-0414} exec "$(dirname "$0")/../launch.sh" "$@"
