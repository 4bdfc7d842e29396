#!/usr/bin/env bash
# Train a qwen2_moe reward model (scalar head, Bradley-Terry loss) on preference JSONL, starting from --model's
# weights (options: examples/launch.sh; exported with --save-hf as an HF SequenceClassification model).
ENTRY=rlhf.reward_model MODEL=${MODEL:-Qwen1.5-MoE-A2.7B} exec "$(dirname "$0")/../launch.sh" --from-hf "$@"
