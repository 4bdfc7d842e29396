#!/usr/bin/env bash
# The GPU suite in one command, run ON the GPU machine from the project root after staging megatron-core and
# Transformer Engine (../shared/device/README.md: `bash ../shared/device/stage.sh` here, then its `run` calls;
# the last one installs into /tmp/site). Each part fits one `run` call (10 minutes at most):
#
#   bash tests/gpu/run_suite.sh quick    # families, TE, generation, NCCL TP/PP, MoE proof   (~3 min, 2 GPUs for NCCL/MoE)
#   bash tests/gpu/run_suite.sh proofs   # the training proof and the RLHF proof              (~8 min)
#   bash tests/gpu/run_suite.sh all      # both, where the call's time limit allows
#
# Reports: $OUT/gpu_<part>.jsonl (rows of tests/gpu/last_results.jsonl) and $OUT/gpu_<part>.log; the last lines
# printed are pytest's summary. Record the outcome with its date in tests/gpu/RESULTS.md.
set -uo pipefail
part=${1:-quick}
[[ -f /tmp/site/.ok ]] || { echo "error: megatron-core / Transformer Engine are not staged in /tmp/site (see ../shared/device/README.md)" >&2; exit 1; }
export PYTHONPATH=/tmp/site:$PWD TORCHDYNAMO_DISABLE=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
case "$part" in
  quick) sel=(tests/gpu -k "not train_proof and not rlhf_proof") ;;
  proofs) sel=(tests/gpu/test_train_proof.py tests/gpu/test_rlhf_proof.py) ;;
  all) sel=(tests/gpu) ;;
  *) echo "error: unknown part '$part' (quick, proofs or all)" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
GPU_REPORT=$OUT/gpu_$part.jsonl python3 -m pytest -q -p no:warnings -p no:cacheprovider -rf "${sel[@]}" 2>&1 | tee "$OUT/gpu_$part.log" | tail -40
exit "${PIPESTATUS[0]}"
