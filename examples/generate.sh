#!/usr/bin/env bash
# Generate with a checkpoint of any family: examples/generate.sh CKPT --prompts prompts.jsonl [--greedy] ...
# (CKPT: a Megatron checkpoint folder; options: python -m megatron_patch.generate --help). Its own options, anywhere:
# --tp N --pp N --ep N (TP x PP x EP processes on this node, default 1), --recipe FAMILY/MODEL (a released size's
# layout; without CKPT, its HF folder as --hf-dir), --dry-run (print the command), --help. PYTHON: the interpreter
# (also of python -m megatron_patch.recipes, which works out TP, PP and EP, with --dry-run too).
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "$0")/common.sh"
checkpoint_tool generate "$@"
