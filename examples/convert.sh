#!/usr/bin/env bash
# HF folder of any family -> megatron-core torch_dist checkpoint for a TP x PP (x EP) layout, then a logits check.
# Usage: examples/convert.sh HF_DIR OUT [--tp N] [--pp N] [--ep N] [--impl transformer_engine] [--dtype bf16] ...
# (options of megatron-patch convert hf-to-mcore --help; the verify step runs at the checkpoint's
# dtype). --recipe FAMILY/MODEL: a released size's layout (--tp/--pp/--ep win), and its HF folder when only OUT is
# given; --dry-run prints the two commands; --help. PYTHON: the interpreter (default python; also of
# python -m megatron_patch.recipes, which works out TP, PP and EP, with --dry-run too).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
tool_options "$@"
[[ ${#POSITIONAL[@]} != 1 || -z "$RECIPE" ]] || POSITIONAL=("$RECIPE_MODEL" "${POSITIONAL[@]}")
[[ ${#POSITIONAL[@]} == 2 ]] || die "examples/convert.sh takes HF_DIR OUT: the HF folder to convert and the" \
  "checkpoint folder to write (with --recipe, OUT alone: the recipe's HF folder is HF_DIR)"
CONVERTER=("${PYTHON:-python}" -m megatron_patch.convert)
run "${CONVERTER[@]}" hf-to-mcore --hf-dir "${POSITIONAL[0]}" --out "${POSITIONAL[1]}" --tp "$TP" --pp "$PP" \
  --ep "$EP" "${ARGS[@]}"
run "${CONVERTER[@]}" verify --hf-dir "${POSITIONAL[0]}" --mcore-dir "${POSITIONAL[1]}"
