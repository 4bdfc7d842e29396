#!/usr/bin/env bash
# Pretrain a bloom model on megatron.training (options and environment: examples/launch.sh).
# Default --model: bloom-7b1 (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-bloom-7b1} exec "$(dirname "$0")/../launch.sh" "$@"
