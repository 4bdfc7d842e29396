#!/usr/bin/env bash
# Pretrain any registered family on megatron.training: examples/pretrain.sh --recipe llama/Llama-3.1-8B --data PREFIX
# (a released size's recipe: examples/<family>/README.md), or --model HF_DIR with your own layout; --from-hf starts
# from the folder's weights. Options and environment: examples/pretrain.sh --help.
ENTRY=pretrain exec "$(dirname "$0")/launch.sh" "$@"
