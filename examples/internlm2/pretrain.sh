#!/usr/bin/env bash
# Pretrain a internlm2 model on megatron.training (options and environment: examples/launch.sh).
# Default --model: internlm2_5-7b (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-internlm2_5-7b} exec "$(dirname "$0")/../launch.sh" "$@"
