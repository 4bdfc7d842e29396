#!/usr/bin/env bash
# Pretrain a qwen3_moe model on megatron.training (options and environment: examples/launch.sh).
# Default --model: Qwen3-30B-A3B (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-Qwen3-30B-A3B} exec "$(dirname "$0")/../launch.sh" "$@"
