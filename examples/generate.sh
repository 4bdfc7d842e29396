#!/usr/bin/env bash
# Generate with a checkpoint of any family: examples/generate.sh CKPT --prompts prompts.jsonl [--greedy] ...
# (CKPT: a Megatron checkpoint folder; options: python -m megatron_patch.generate --help). TP/PP > 1:
# NPROC_PER_NODE=TPxPP, plus --tp/--pp. PYTHON: the interpreter (default python).
set -euo pipefail
CKPT=${1:?checkpoint folder}; shift
exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nproc_per_node "${NPROC_PER_NODE:-1}" \
  -m megatron_patch.generate --mcore-dir "$CKPT" "$@"
