#!/usr/bin/env bash
# Shared launcher behind examples/<family>/{pretrain,sft,rlhf_rm,rlhf_dpo}.sh: named options with defaults, everything
# after them passed through to Megatron, torchrun sized from the environment so the same script runs
# on one GPU and on a multi-node cluster.
#
#   examples/<family>/pretrain.sh [--model DIR] [--data PREFIX] [--tokenizer DIR] [--tp N] [--pp N] [--ep N]
#       [--precision bf16|fp16|fp8|fp32] [--seq-length N] [--mbs N] [--gbs N] [--lr X] [--iters N]
#       [--split TRAIN,VALID,TEST] [--out DIR] [--from-hf] [--profile default|benchmark|none] [--cpu] [--dry-run]
#       [--help] [-- any Megatron-LM argument ...]
#
# --model: an HF folder (config.json, tokenizer; with --from-hf also the weights to start from).
# --data: pretrain: an indexed-dataset prefix (toolkits.preprocess_data); sft: JSONL conversations;
# rlhf.reward_model / rlhf.dpo: JSONL preference rows {"prompt", "chosen", "rejected"}.
# --split (pretrain): document shares of training, validation and test (default 99,1,0; a share too
# small to hold a document is an error; 100,0,0 trains without validation).
# --profile: megatron_patch's --throughput-profile (default: settings that cost no accuracy; benchmark: also
# without the per-step NaN and rerun checks; none: Megatron's own defaults).
# --cpu: train a tiny model on the CPU (megatron_patch's --cpu: local implementation, gloo; fp32 by
# default, no distributed optimizer; one process unless NPROC_PER_NODE is set).
# Defaults: --tp 1 --pp 1 --ep 1 --precision bf16 --seq-length 4096 --mbs 1 --gbs 32 --lr 3e-4 (min lr /10,
# cosine) --iters 1000 --out checkpoints/run (saved at the end and every 1000 iterations; resumed from).
# Environment: NPROC_PER_NODE (default: GPUs visible, else 1), NNODES (1), NODE_RANK (0),
# MASTER_ADDR (localhost), MASTER_PORT (6000); PYTHON (python: the interpreter that runs torch.distributed.run).
# The entry point's own options and every Megatron-LM argument: python -m megatron_patch.<entry> --help.
set -euo pipefail

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  if [[ -n "${ENTRY:-}" ]]; then echo "This script runs megatron_patch.$ENTRY; default --model: ${MODEL:-none}."; fi
}

MODEL=${MODEL:-}
DATA=${DATA:-}
TOKENIZER="" PRECISION="" SPLIT="" PROFILE=default
TP=1 PP=1 EP=1 SEQ=4096 MBS=1 GBS=32 LR=3e-4 ITERS=1000 OUT=checkpoints/run FROM_HF=0 CPU=0 DRY_RUN=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --tokenizer) TOKENIZER=$2; shift 2 ;;
    --tp) TP=$2; shift 2 ;;
    --pp) PP=$2; shift 2 ;;
    --ep) EP=$2; shift 2 ;;  # expert parallel (mixture-of-experts families)
    --precision) PRECISION=$2; shift 2 ;;
    --profile) PROFILE=$2; shift 2 ;;
    --seq-length) SEQ=$2; shift 2 ;;
    --mbs) MBS=$2; shift 2 ;;
    --gbs) GBS=$2; shift 2 ;;
    --lr) LR=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --split) SPLIT=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --from-hf) FROM_HF=1; shift ;;
    --cpu) CPU=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) break ;;  # the rest goes to Megatron
  esac
done

ENTRY=${ENTRY:?set by the family script: pretrain, sft, rlhf.reward_model or rlhf.dpo}
[[ -n "$MODEL" ]] || { echo "error: --model HF_DIR is required (config.json of the model to train)" >&2; exit 1; }
EVAL_ARGS=()
if [[ "$ENTRY" == sft ]]; then
  [[ -n "$DATA" ]] || { echo "error: --data FILE.jsonl is required (chat or instruction JSONL)" >&2; exit 1; }
  DATA_ARGS=(--sft-data "$DATA")
elif [[ "$ENTRY" == rlhf.* ]]; then
  [[ -n "$DATA" ]] || { echo "error: --data FILE.jsonl is required (preference JSONL)" >&2; exit 1; }
  DATA_ARGS=(--pref-data "$DATA")
else
  [[ -n "$DATA" ]] || { echo "error: --data PREFIX is required (python -m toolkits.preprocess_data makes it)" >&2; exit 1; }
  DATA_ARGS=(--data-path "$DATA")
  [[ -z "$SPLIT" ]] || DATA_ARGS+=(--split "$SPLIT")
  IFS=, read -r _ VALID_SHARE _ <<< "${SPLIT:-99,1,0}"
  if awk "BEGIN { exit !(${VALID_SHARE:-0} + 0 > 0) }"; then EVAL_ARGS=(--eval-interval 1000 --eval-iters 10); fi
fi
TOKENIZER=${TOKENIZER:-$MODEL}

if [[ "$CPU" == 1 ]]; then
  NPROC_PER_NODE=${NPROC_PER_NODE:-1} PRECISION=${PRECISION:-fp32} DEVICE_ARGS=(--cpu)
else
  PRECISION=${PRECISION:-bf16} DEVICE_ARGS=(--use-distributed-optimizer)
fi
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  [[ "$NPROC_PER_NODE" -gt 0 ]] || NPROC_PER_NODE=1
fi

if [[ "$FROM_HF" == 1 ]]; then MODEL_ARGS=(--load-hf "$MODEL"); else MODEL_ARGS=(--hf-config "$MODEL"); fi
CMD=("${PYTHON:-python}" -m torch.distributed.run --nproc_per_node "$NPROC_PER_NODE" --nnodes "${NNODES:-1}"
     --node_rank "${NODE_RANK:-0}" --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}"
     -m "megatron_patch.$ENTRY" "${MODEL_ARGS[@]}"
     --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" "${DATA_ARGS[@]}"
     --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --expert-model-parallel-size "$EP"
     --precision "$PRECISION" --throughput-profile "$PROFILE"
     --seq-length "$SEQ" --micro-batch-size "$MBS" --global-batch-size "$GBS"
     --lr "$LR" --min-lr "$(awk "BEGIN { printf \"%g\", $LR / 10 }")" --lr-decay-style cosine --lr-warmup-fraction 0.01
     --train-iters "$ITERS" --save "$OUT" --load "$OUT" --save-interval 1000 --log-interval 10
     "${EVAL_ARGS[@]}" "${DEVICE_ARGS[@]}" "$@")

if [[ "$DRY_RUN" == 1 ]]; then
  printf '%q ' CUDA_DEVICE_MAX_CONNECTIONS=1 "${CMD[@]}"; echo
  exit 0
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
exec "${CMD[@]}"
