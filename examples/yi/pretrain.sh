#!/usr/bin/env bash
# Pretrain a yi model on megatron.training (options and environment: examples/launch.sh).
# Default --model: Yi-6B (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-Yi-6B} exec "$(dirname "$0")/../launch.sh" "$@"
