#!/usr/bin/env bash
# Train a llama reward model (scalar head, Bradley-Terry loss) on preference JSONL, starting from --model's
# weights (options: examples/launch.sh; exported with --save-hf as an HF SequenceClassification model).
ENTRY=rlhf.reward_model MODEL=${MODEL:-Llama-3.1-8B} exec "$(dirname "$0")/../launch.sh" --from-hf "$@"
