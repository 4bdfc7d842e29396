#!/usr/bin/env bash
# Pretrain a starcoder2 model on megatron.training (options and environment: examples/launch.sh).
# Default --model: starcoder2-7b (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-starcoder2-7b} exec "$(dirname "$0")/../launch.sh" "$@"
