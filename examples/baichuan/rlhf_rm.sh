#!/usr/bin/env bash
# Train a baichuan reward model (scalar head, Bradley-Terry loss) on preference JSONL, starting from --model's
# weights (options: examples/launch.sh; exported with --save-hf as an HF SequenceClassification model).
ENTRY=rlhf.reward_model MODEL=${MODEL:-Baichuan2-7B-Base} exec "$(dirname "$0")/../launch.sh" --from-hf "$@"
