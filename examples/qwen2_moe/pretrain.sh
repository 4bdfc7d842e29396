#!/usr/bin/env bash
# Pretrain a qwen2_moe model on megatron.training (options and environment: examples/launch.sh).
# Default --model: Qwen1.5-MoE-A2.7B (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-Qwen1.5-MoE-A2.7B} exec "$(dirname "$0")/../launch.sh" "$@"
