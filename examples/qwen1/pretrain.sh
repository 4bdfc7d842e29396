#!/usr/bin/env bash
# Pretrain a qwen1 model on megatron.training (options and environment: examples/launch.sh).
# Default --model: Qwen-7B (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-Qwen-7B} exec "$(dirname "$0")/../launch.sh" "$@"
