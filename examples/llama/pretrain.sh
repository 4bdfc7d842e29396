#!/usr/bin/env bash
# Pretrain a llama model on megatron.training (options and environment: examples/launch.sh).
# Default --model: Llama-3.1-8B (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-Llama-3.1-8B} exec "$(dirname "$0")/../launch.sh" "$@"
