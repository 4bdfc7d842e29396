#!/usr/bin/env bash
# HF folder of any family -> megatron-core torch_dist checkpoint for a TP x PP (x EP) layout, then a logits check.
# Usage: examples/convert.sh HF_DIR OUT_DIR [--tp N] [--pp N] [--ep N] [--impl transformer_engine] [--dtype bf16] ...
# (the verify step runs at the checkpoint's dtype; PYTHON: the interpreter, default python)
set -euo pipefail
HF_DIR=${1:?HF folder}; OUT=${2:?output folder}; shift 2
"${PYTHON:-python}" -m toolkits.checkpoint_converter hf-to-mcore --hf-dir "$HF_DIR" --out "$OUT" "$@"
"${PYTHON:-python}" -m toolkits.checkpoint_converter verify --hf-dir "$HF_DIR" --mcore-dir "$OUT"
