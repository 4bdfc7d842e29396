#!/usr/bin/env bash
# Evaluate a deepseek_v2 checkpoint: examples/deepseek_v2/evaluate.sh CKPT [--text held_out.jsonl] [--choices mc.jsonl] ...
# (options: python -m megatron_patch.evaluate --help). TP/PP > 1: NPROC_PER_NODE=TPxPP, plus --tp/--pp.
set -euo pipefail
CKPT=${1:?checkpoint folder}; shift
exec torchrun --nproc_per_node "${NPROC_PER_NODE:-1}" -m megatron_patch.evaluate --mcore-dir "$CKPT" "$@"
