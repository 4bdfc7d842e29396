#!/usr/bin/env bash
# Stage 2, reward model (scalar head, Bradley-Terry loss) on preference JSONL, starting from --model's HF weights
# (usually the SFT model): rlhf/rm.sh --model SFT_HF --data prefs.jsonl [launcher options] [-- --save-hf rm_hf]
# (options: examples/launch.sh --help; entry point: python -m megatron_patch.rlhf.reward_model).
ENTRY=rlhf.reward_model exec "$(dirname "$0")/../examples/launch.sh" --from-hf "$@"
