#!/usr/bin/env bash
# Pretrain a glm4 model on megatron.training (options and environment: examples/launch.sh).
# Default --model: GLM-4-9B-0414 (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-GLM-4-9B-0414} exec "$(dirname "$0")/../launch.sh" "$@"
