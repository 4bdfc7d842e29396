#!/usr/bin/env bash
# Pretrain a gpt_bigcode model on megatron.training (options and environment: examples/launch.sh).
# Default --model: starcoderbase-7b (an HF folder with config.json and tokenizer; --from-hf starts from its weights).
ENTRY=pretrain MODEL=${MODEL:-starcoderbase-7b} exec "$(dirname "$0")/../launch.sh" "$@"
