#!/usr/bin/env bash
# Pretrain a chatglm model on megatron.training (options and environment: examples/launch.sh).
# Default --model: chatglm3-6b (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-chatglm3-6b} exec "$(dirname "$0")/../launch.sh" "$@"
