#!/usr/bin/env bash
# GRPO for a deepseek_v3 model: examples/deepseek_v3/rlhf_grpo.sh HF_DIR --prompts p.jsonl --reward module:function [--tp N] ...
# (options: python -m megatron_patch.rlhf.grpo --help; TP > 1: NPROC_PER_NODE=TP).
set -euo pipefail
MODEL=${1:?HF model folder}; shift
exec torchrun --nproc_per_node "${NPROC_PER_NODE:-1}" -m megatron_patch.rlhf.grpo --hf-dir "$MODEL" "$@"
