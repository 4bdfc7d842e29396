#!/usr/bin/env bash
# Fine-tune a gpt_bigcode model on chat / instruction JSONL (packed, assistant-only loss; options: examples/launch.sh).
# Default --model: starcoderbase-7b; add --from-hf to start from its weights (the usual case).
ENTRY=sft MODEL=${MODEL:-starcoderbase-7b} exec "$(dirname "$0")/../launch.sh" "$@"
