#!/usr/bin/env bash
# Train a mixtral reward model (scalar head, Bradley-Terry loss) on preference JSONL, starting from --model's
# weights (options: examples/launch.sh; exported with --save-hf as an HF SequenceClassification model).
ENTRY=rlhf.reward_model MODEL=${MODEL:-Mixtral-8x7B-v0.1} exec "$(dirname "$0")/../launch.sh" --from-hf "$@"
