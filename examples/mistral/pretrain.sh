#!/usr/bin/env bash
# Pretrain a mistral model on megatron.training (options and environment: examples/launch.sh).
# Default --model: Mistral-7B-v0.3 (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-Mistral-7B-v0.3} exec "$(dirname "$0")/../launch.sh" "$@"
