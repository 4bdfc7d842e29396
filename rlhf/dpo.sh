#!/usr/bin/env bash
# Stage 3 (offline), DPO on preference JSONL; the frozen reference is --model's weights:
# rlhf/dpo.sh --model SFT_HF --data prefs.jsonl [launcher options] [-- --beta 0.1 --save-hf dpo_hf]
# (options: examples/launch.sh --help; entry point: python -m megatron_patch.rlhf.dpo). PP must be 1.
ENTRY=rlhf.dpo exec "$(dirname "$0")/../examples/launch.sh" --from-hf "$@"
