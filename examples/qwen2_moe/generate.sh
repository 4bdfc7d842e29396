#!/usr/bin/env bash
# Generate with a qwen2_moe checkpoint: examples/qwen2_moe/generate.sh CKPT --prompts prompts.jsonl [--greedy] ...
# (CKPT: a Megatron checkpoint folder; options: python -m megatron_patch.generate --help). TP/PP > 1:
# NPROC_PER_NODE=TPxPP, plus --tp/--pp.
set -euo pipefail
CKPT=${1:?checkpoint folder}; shift
exec torchrun --nproc_per_node "${NPROC_PER_NODE:-1}" -m megatron_patch.generate --mcore-dir "$CKPT" "$@"
