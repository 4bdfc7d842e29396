#!/usr/bin/env bash
# Pretrain a glm model on megatron.training (options and environment: examples/launch.sh).
# Default --model: glm-4-9b-hf (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-glm-4-9b-hf} exec "$(dirname "$0")/../launch.sh" "$@"
