#!/usr/bin/env bash
# Shared launcher of the training tasks (examples/pretrain.sh, examples/sft.sh; rlhf/sft.sh, rlhf/rm.sh, rlhf/dpo.sh):
# named options (wherever they stand), an optional recipe per released model size, every other word (all of them
# after `--`) passed to Megatron, torchrun sized from the environment so the same script runs on one GPU and on a
# multi-node cluster.
#
#   examples/pretrain.sh [--recipe FAMILY/MODEL|FILE] [--model DIR] [--data PREFIX] [--tokenizer DIR]
#       [--tp N] [--pp N] [--vpp N] [--cp N] [--ep N] [--etp N] [--precision bf16|fp16|fp8|fp32]
#       [--seq-length N] [--mbs N] [--gbs N] [--lr X] [--min-lr X] [--iters N] [--split TRAIN,VALID,TEST]
#       [--out DIR] [--from-hf] [--lora RANK] [--profile default|benchmark|none] [--cpu] [--dry-run] [--help]
#       [any Megatron-LM argument ...] [-- Megatron-LM arguments only ...]
#
# --recipe: examples/FAMILY/MODEL.env (or a file of the same form): the layout, batch, learning rate, sequence
# length, precision and GPU settings of one released model (examples/<family>/README.md lists them); the last
# part of its HF_ID is the default --model folder. An option given here wins over the recipe, the recipe over
# the defaults; a recipe's KEY applies to every task, PRETRAIN_KEY / SFT_KEY / RM_KEY / DPO_KEY to that one, but
# its LR is pretraining's: the other tasks need their own (SFT_LR, RM_LR, DPO_LR) or --lr. These rules are
# megatron_patch/recipes.py's (`python -m megatron_patch.recipes --recipe FAMILY/MODEL --task SFT` prints a task's
# values), which this script asks for the values of its options.
# --model: an HF folder (config.json, tokenizer; with --from-hf also the weights to start from).
# --data: pretrain: an indexed-dataset prefix (megatron-patch preprocess-data); sft: JSONL conversations;
# rlhf.reward_model / rlhf.dpo: JSONL preference rows {"prompt", "chosen", "rejected"}.
# --tp/--pp/--cp/--ep/--etp: tensor, pipeline, context, expert and expert-tensor parallel sizes; --vpp: virtual
# pipeline stages per pipeline rank (not with --from-hf).
# --lora RANK: train LoRA adapters of this rank on every linear layer (alpha 2 x RANK) on a frozen base read
# with --from-hf (which it needs); default --lr 1e-4; no sequence parallelism; OUT/peft: the PEFT adapter
# folder (docs/lora.md).
# --split (pretrain): document shares of training, validation and test (default 99,1,0; a share too
# small to hold a document is an error; 100,0,0 trains without validation).
# --profile: megatron_patch's --throughput-profile (default: settings that cost no accuracy; benchmark: also
# without the per-step NaN and rerun checks; none: Megatron's own defaults); Megatron's own --profile goes after `--`.
# --cpu: train a tiny model on the CPU (megatron_patch's --cpu: local implementation, gloo; fp32 by default, no
# distributed optimizer, a recipe's PRECISION and GPU_ARGS left out, and its VPP and CP, saying so; one process
# unless NPROC_PER_NODE is set).
# Defaults: --tp 1 --pp 1 --cp 1 --ep 1 --precision bf16 --seq-length 4096 --mbs 1 --gbs 32 --lr 3e-4 (--min-lr:
# the lr / 10, cosine) --iters 1000 --out checkpoints/run (saved at the end and every 1000 iterations; resumed from).
# Environment: NPROC_PER_NODE (default: GPUs visible, else 1), NNODES (1), NODE_RANK (0), MASTER_ADDR
# (localhost), MASTER_PORT (6000; on one node with neither set, torchrun --standalone picks a free port); PYTHON
# (python: the interpreter that works out the values, python -m megatron_patch.recipes, even with --dry-run, and
# runs torchrun, as megatron_patch.torchrun).
# The entry point's own options and every Megatron-LM argument: python -m megatron_patch.<entry> --help.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODEL=${MODEL:-} DATA=${DATA:-} TOKENIZER="" SPLIT="" FROM_HF=0 CPU=0 LORA="" ARGS=()
TP="" PP="" VPP="" CP="" EP="" ETP="" PRECISION="" PROFILE="" SEQ="" MBS="" GBS="" LR="" MIN_LR="" ITERS=1000
OUT=checkpoints/run
while [[ $# -gt 0 ]]; do
  case "$1" in
    --recipe) use_recipe "$2"; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    --data) DATA=$2; shift 2 ;;
    --tokenizer) TOKENIZER=$2; shift 2 ;;
    --tp) TP=$2; shift 2 ;;
    --pp) PP=$2; shift 2 ;;
    --vpp) VPP=$2; shift 2 ;;
    --cp) CP=$2; shift 2 ;;
    --ep) EP=$2; shift 2 ;;  # expert parallel (mixture-of-experts families)
    --etp) ETP=$2; shift 2 ;;
    --precision) PRECISION=$2; shift 2 ;;
    --profile) PROFILE=$2; shift 2 ;;
    --seq-length) SEQ=$2; shift 2 ;;
    --mbs) MBS=$2; shift 2 ;;
    --gbs) GBS=$2; shift 2 ;;
    --lr) LR=$2; shift 2 ;;
    --min-lr) MIN_LR=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --split) SPLIT=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --from-hf) FROM_HF=1; shift ;;
    --lora) LORA=$2; shift 2 ;;
    --cpu) CPU=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage "${BASH_SOURCE[0]}"; [[ -z "${ENTRY:-}" ]] || echo "This script runs megatron_patch.$ENTRY."
      exit 0 ;;
    --) shift; ARGS+=("$@"); break ;;
    *) ARGS+=("$1"); shift ;;  # Megatron's
  esac
done

ENTRY=${ENTRY:?set by the task script: pretrain, sft, rlhf.reward_model or rlhf.dpo}
case "$ENTRY" in
  pretrain) TASK=PRETRAIN ;; sft) TASK=SFT ;; rlhf.reward_model) TASK=RM ;; rlhf.dpo) TASK=DPO ;;
  *) TASK=${ENTRY^^} TASK=${TASK//./_} ;;
esac
# this task's values: the option given, else the recipe's (its TASK_KEY, else its KEY), else the default; the LR
# rules, --lora's LR and what --cpu leaves out (saying so): megatron_patch/recipes.py
ASK=(--task="$TASK")
[[ "$CPU" == 0 ]] || ASK+=(--cpu)
[[ -z "$LORA" ]] || ASK+=(--lora)
recipe_values "${ASK[@]}" TP="$TP" PP="$PP" VPP="$VPP" CP="$CP" EP="$EP" ETP="$ETP" SEQ="$SEQ" MBS="$MBS" GBS="$GBS" \
  LR="$LR" MIN_LR="$MIN_LR" PRECISION="$PRECISION" PROFILE="$PROFILE" MODEL="$MODEL" GPU_ARGS GPUS
[[ " default benchmark none " == *" $PROFILE "* ]] \
  || die "--profile takes default, benchmark or none, got '$PROFILE' (Megatron's own --profile goes after --)"

[[ -n "$MODEL" ]] || die "--model HF_DIR is required (config.json of the model to train), or a --recipe with HF_ID"
EVAL_ARGS=()
if [[ "$ENTRY" == sft ]]; then
  [[ -n "$DATA" ]] || die "--data FILE.jsonl is required (chat or instruction JSONL)"
  DATA_ARGS=(--sft-data "$DATA")
elif [[ "$ENTRY" == rlhf.* ]]; then
  [[ -n "$DATA" ]] || die "--data FILE.jsonl is required (preference JSONL)"
  DATA_ARGS=(--pref-data "$DATA")
else
  [[ -n "$DATA" ]] || die "--data PREFIX is required (megatron-patch preprocess-data makes it)"
  DATA_ARGS=(--data-path "$DATA")
  [[ -z "$SPLIT" ]] || DATA_ARGS+=(--split "$SPLIT")
  IFS=, read -r _ VALID_SHARE _ <<< "${SPLIT:-99,1,0}"
  if awk "BEGIN { exit !(${VALID_SHARE:-0} + 0 > 0) }"; then EVAL_ARGS=(--eval-interval 1000 --eval-iters 10); fi
fi
TOKENIZER=${TOKENIZER:-$MODEL}

if [[ "$CPU" == 1 ]]; then
  NPROC_PER_NODE=${NPROC_PER_NODE:-1} DEVICE_ARGS=(--cpu)
else
  DEVICE_ARGS=(--use-distributed-optimizer)
  read -ra GPU_ARGS <<< "$GPU_ARGS"
  DEVICE_ARGS+=("${GPU_ARGS[@]}")
fi
LORA_ARGS=()
if [[ -n "$LORA" ]]; then
  [[ "$FROM_HF" == 1 ]] || die "--lora trains adapters on a frozen base: pass --from-hf (the base's HF folder is --model)"
  [[ "$LORA" =~ ^[1-9][0-9]*$ ]] || die "--lora RANK must be a positive integer, got '$LORA'"
  for i in "${!DEVICE_ARGS[@]}"; do [[ "${DEVICE_ARGS[$i]}" != --sequence-parallel ]] || unset "DEVICE_ARGS[$i]"; done
  LORA_ARGS=(--lora-rank "$LORA" --lora-alpha $((2 * LORA)) --lora-target all-linear --save-peft "$OUT/peft")
fi
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
  [[ "$NPROC_PER_NODE" -gt 0 ]] || NPROC_PER_NODE=1
fi
WORLD=$((NPROC_PER_NODE * ${NNODES:-1}))
(( WORLD % (TP * PP * CP) == 0 )) || die "TP x PP x CP = $((TP * PP * CP)) does not divide the $WORLD processes" \
  "(NNODES=${NNODES:-1} x NPROC_PER_NODE=$NPROC_PER_NODE)${GPUS:+; recipe $RECIPE is laid out for $GPUS GPUs}"

LAYOUT_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --context-parallel-size "$CP"
             --expert-model-parallel-size "$EP")
[[ -z "$ETP" ]] || LAYOUT_ARGS+=(--expert-tensor-parallel-size "$ETP")
[[ "$VPP" == 1 ]] || LAYOUT_ARGS+=(--num-virtual-stages-per-pipeline-rank "$VPP")
if [[ "$FROM_HF" == 1 ]]; then MODEL_ARGS=(--load-hf "$MODEL"); else MODEL_ARGS=(--hf-config "$MODEL"); fi
# one node and no MASTER_ADDR / MASTER_PORT: torchrun's --standalone, on a free port (two jobs on one machine do
# not both take 6000); several nodes, or either variable set: the rendezvous they name
if [[ "${NNODES:-1}" == 1 && -z "${MASTER_ADDR:-}" && -z "${MASTER_PORT:-}" ]]; then
  RDZV=(--standalone)
else
  RDZV=(--nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --master_addr "${MASTER_ADDR:-localhost}"
        --master_port "${MASTER_PORT:-6000}")
fi
CMD=("${TORCHRUN[@]}" --nproc_per_node "$NPROC_PER_NODE" "${RDZV[@]}"
     -m "megatron_patch.$ENTRY" "${MODEL_ARGS[@]}"
     --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" "${DATA_ARGS[@]}" "${LAYOUT_ARGS[@]}"
     --precision "$PRECISION" --throughput-profile "$PROFILE"
     --seq-length "$SEQ" --micro-batch-size "$MBS" --global-batch-size "$GBS"
     --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-fraction 0.01
     --train-iters "$ITERS" --save "$OUT" --load "$OUT" --save-interval 1000 --log-interval 10
     "${EVAL_ARGS[@]}" "${DEVICE_ARGS[@]}" "${LORA_ARGS[@]}" "${ARGS[@]}")
launch CUDA_DEVICE_MAX_CONNECTIONS=1 "${CMD[@]}"
