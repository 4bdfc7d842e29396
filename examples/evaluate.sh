#!/usr/bin/env bash
# Evaluate a checkpoint of any family: examples/evaluate.sh CKPT [--text held_out.jsonl] [--choices mc.jsonl] ...
# (options: python -m megatron_patch.evaluate --help). TP/PP > 1: NPROC_PER_NODE=TPxPP, plus --tp/--pp.
# PYTHON: the interpreter (default python).
set -euo pipefail
CKPT=${1:?checkpoint folder}; shift
exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nproc_per_node "${NPROC_PER_NODE:-1}" \
  -m megatron_patch.evaluate --mcore-dir "$CKPT" "$@"
