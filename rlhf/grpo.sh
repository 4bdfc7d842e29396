#!/usr/bin/env bash
# Stage 3 (online), GRPO with a rule reward: rlhf/grpo.sh --model SFT_HF --prompts prompts.jsonl
# --reward module:function [--tp N] [--pp M] [--dry-run] [any option of python -m megatron_patch.rlhf.grpo --help], in
# any order.
ENTRY=rlhf.grpo exec "$(dirname "$0")/online.sh" "$@"
