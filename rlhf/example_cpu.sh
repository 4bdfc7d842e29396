#!/usr/bin/env bash
# The RLHF workflow end to end on a tiny random model, on the CPU (minutes; nothing downloaded):
# data -> SFT -> reward model -> PPO -> HF export, then the exported policy generates with transformers.
#   rlhf/example_cpu.sh [OUT (default: rlhf_example, must be new)] [CONFIG.json (default: the tiny LLaMA)]
# Each stage is the launcher a real run uses (rlhf/sft.sh, rm.sh, ppo.sh), at tiny sizes.
set -euo pipefail
HERE=$(dirname "$0") OUT=${1:-rlhf_example}
export PYTHON=${PYTHON:-python}
"$PYTHON" "$HERE/example.py" data "$OUT" ${2:+--config "$2"}
TINY=(--cpu --seq-length 64 --mbs 2 --gbs 4 --lr 1e-3)
"$HERE/sft.sh" --model "$OUT/base" --data "$OUT/chats.jsonl" "${TINY[@]}" --iters 16 --out "$OUT/sft_ckpt" \
  -- --save-hf "$OUT/sft_hf"
"$HERE/rm.sh" --model "$OUT/sft_hf" --data "$OUT/prefs.jsonl" "${TINY[@]}" --iters 24 --out "$OUT/rm_ckpt" \
  -- --save-hf "$OUT/rm_hf"
"$HERE/ppo.sh" --model "$OUT/sft_hf" --reward-model "$OUT/rm_hf" --prompts "$OUT/prompts.jsonl" --steps 4 \
  --prompts-per-step 8 --max-new-tokens 8 --lr 1e-3 --critic-lr 1e-3 --save "$OUT/ppo_ckpt" \
  --out "$OUT/ppo_hf" --critic-out "$OUT/critic_hf"
"$PYTHON" "$HERE/example.py" check "$OUT"
