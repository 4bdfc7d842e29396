#!/usr/bin/env bash
# Pretrain a mixtral model on megatron.training (options and environment: examples/launch.sh).
# Default --model: Mixtral-8x7B-v0.1 (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-Mixtral-8x7B-v0.1} exec "$(dirname "$0")/../launch.sh" "$@"
