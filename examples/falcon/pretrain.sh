#!/usr/bin/env bash
# Pretrain a falcon model on megatron.training (options and environment: examples/launch.sh).
# Default --model: falcon-7b (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-falcon-7b} exec "$(dirname "$0")/../launch.sh" "$@"
