#!/usr/bin/env bash
# Train a deepseek_v3 reward model (scalar head, Bradley-Terry loss) on preference JSONL, starting from --model's
# weights (options: examples/launch.sh; exported with --save-hf as an HF SequenceClassification model).
ENTRY=rlhf.reward_model MODEL=${MODEL:-DeepSeek-V3} exec "$(dirname "$0")/../launch.sh" --from-hf "$@"
