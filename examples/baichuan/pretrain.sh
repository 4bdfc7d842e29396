#!/usr/bin/env bash
# Pretrain a baichuan model on megatron.training (options and environment: examples/launch.sh).
# Default --model: Baichuan2-7B-Base (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-Baichuan2-7B-Base} exec "$(dirname "$0")/../launch.sh" "$@"
