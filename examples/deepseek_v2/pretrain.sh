#!/usr/bin/env bash
# Pretrain a deepseek_v2 model on megatron.training (options and environment: examples/launch.sh).
# Default --model: DeepSeek-V2 (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-DeepSeek-V2} exec "$(dirname "$0")/../launch.sh" "$@"
