#!/usr/bin/env bash
# Shared launcher behind examples/<family>/{pretrain,sft,rlhf_rm,rlhf_dpo}.sh: named options with defaults, everything
# after them passed through to Megatron, torchrun sized from the environment so the same script runs
# on one GPU and on a multi-node cluster.
#
#   examples/<family>/pretrain.sh [--model DIR] [--data PREFIX] [--tokenizer DIR] [--tp N] [--pp N] [--ep N]
#       [--precision bf16|fp16|fp8|fp32] [--seq-length N] [--mbs N] [--gbs N] [--lr X] [--iters N]
#       [--out DIR] [--from-hf] [--dry-run] [-- any Megatron-LM argument ...]
#
# --model: an HF folder (config.json, tokenizer; with --from-hf also the weights to start from).
# --data: pretrain: an indexed-dataset prefix (toolkits.preprocess_data); sft: JSONL conversations;
# rlhf.reward_model / rlhf.dpo: JSONL preference rows {"prompt", "chosen", "rejected"}.
# Environment: NPROC_PER_NODE (default: GPUs visible, else 1), NNODES (1), NODE_RANK (0),
# MASTER_ADDR (localhost), MASTER_PORT (6000); PYTHON (python).
set -euo pipefail

ENTRY=${ENTRY:?set by the family script: pretrain, sft, rlhf.reward_model or rlhf.dpo}
MODEL=${MODEL:-}
DATA=${DATA:-}
TOKENIZER=""
TP=1 PP=1 EP=1 PRECISION=bf16 SEQ=4096 MBS=1 GBS=32 LR=3e-4 ITERS=1000 OUT=checkpoints/run FROM_HF=0 DRY_RUN=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --tokenizer) TOKENIZER=$2; shift 2 ;;
    --tp) TP=$2; shift 2 ;;
    --pp) PP=$2; shift 2 ;;
    --ep) EP=$2; shift 2 ;;  # expert parallel (mixture-of-experts families)
    --precision) PRECISION=$2; shift 2 ;;
    --seq-length) SEQ=$2; shift 2 ;;
    --mbs) MBS=$2; shift 2 ;;
    --gbs) GBS=$2; shift 2 ;;
    --lr) LR=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --from-hf) FROM_HF=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; break ;;
    *) break ;;  # the rest goes to Megatron
  esac
done

[[ -n "$MODEL" ]] || { echo "error: --model HF_DIR is required (config.json of the model to train)" >&2; exit 1; }
if [[ "$ENTRY" == sft ]]; then
  [[ -n "$DATA" ]] || { echo "error: --data FILE.jsonl is required (chat or instruction JSONL)" >&2; exit 1; }
  DATA_ARGS=(--sft-data "$DATA")
elif [[ "$ENTRY" == rlhf.* ]]; then
  [[ -n "$DATA" ]] || { echo "error: --data FILE.jsonl is required (preference JSONL)" >&2; exit 1; }
  DATA_ARGS=(--pref-data "$DATA")
else
  [[ -n "$DATA" ]] || { echo "error: --data PREFIX is required (python -m toolkits.preprocess_data makes it)" >&2; exit 1; }
  DATA_ARGS=(--data-path "$DATA" --split 99,1,0)
fi
TOKENIZER=${TOKENIZER:-$MODEL}

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  [[ "$NPROC_PER_NODE" -gt 0 ]] || NPROC_PER_NODE=1
fi

if [[ "$FROM_HF" == 1 ]]; then MODEL_ARGS=(--load-hf "$MODEL"); else MODEL_ARGS=(--hf-config "$MODEL"); fi
CMD=(torchrun --nproc_per_node "$NPROC_PER_NODE" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}"
     --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}"
     -m "megatron_patch.$ENTRY" "${MODEL_ARGS[@]}"
     --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" "${DATA_ARGS[@]}"
     --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --expert-model-parallel-size "$EP"
     --precision "$PRECISION"
     --seq-length "$SEQ" --micro-batch-size "$MBS" --global-batch-size "$GBS"
     --lr "$LR" --min-lr "$(awk "BEGIN { printf \"%g\", $LR / 10 }")" --lr-decay-style cosine --lr-warmup-fraction 0.01
     --train-iters "$ITERS" --save "$OUT" --load "$OUT" --save-interval 1000 --log-interval 10
     --eval-interval 1000 --eval-iters 10 --use-distributed-optimizer "$@")

if [[ "$DRY_RUN" == 1 ]]; then
  printf '%q ' CUDA_DEVICE_MAX_CONNECTIONS=1 "${CMD[@]}"; echo
  exit 0
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec "${CMD[@]}"
