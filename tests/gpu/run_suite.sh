#!/usr/bin/env bash
# The GPU suite in one command, run ON the GPU machine from the project root after staging megatron-core and
# Transformer Engine (../shared/device/README.md: `bash ../shared/device/stage.sh` here, then its `run` calls;
# the last one installs into /tmp/site). Each part fits one `run` call (10 minutes at most):
#
#   bash tests/gpu/run_suite.sh smoke    # every GPU path once: a TE family vs HF, the converter's verify, generation
#                                        # on both engines, 5 iterations bf16 and fp8, a LoRA run, PPO and GRPO steps,
#                                        # evaluate and an lm-eval run, HybridModel under TE (~4 min on one H200 on
#                                        # 2026-12-05 morning; ~10 min by its evening, MLA and MoE graph tests added;
#                                        # past one call's 600 s on 2026-12-06: run it in parts: smoke-gen, smoke-levers, smoke-other).
#                                        # Any change to code on a GPU path runs it before it lands.
#   bash tests/gpu/run_suite.sh smoke-gen    # the smoke in parts: its generation tests (test_generate_te.py,
#                                            # ~100 s on one H100 on 2026-12-06),
#   bash tests/gpu/run_suite.sh smoke-levers # the training-lever test (~320 s: one 5-step run per lever),
#   bash tests/gpu/run_suite.sh smoke-other  # and the others (~5 min; with the lever test they passed 600 s)
#   bash tests/gpu/run_suite.sh smoke-train  # smoke-levers and smoke-other in one call: since 2026-12-06 (twenty-
#                                            # ninth session) a test's tiny training runs go TRAIN_WORKERS (3) at a
#                                            # time (their time is their start-up): the lever test 101 s (was 316);
#                                            # 18 of the part's 21 tests in a 330 s call, the other 3 ~60 s
#                                            # (thirtieth session); TRAIN_WORKERS=1: one by one. Past one call
#                                            # since 2026-12-07 (the fp8-head resume test, 94 s; the lever test
#                                            # 150 s on an H100): run smoke-levers, then smoke-other
#   bash tests/gpu/run_suite.sh quick    # every GPU test but the two proofs (~5 min; NCCL / MoE tests need 2 GPUs)
#   bash tests/gpu/run_suite.sh rest     # quick without the smoke tests: after `smoke`, the rest of quick
#   bash tests/gpu/run_suite.sh proofs   # the training proof and the RLHF proof: more than one call's 10 minutes
#                                        # since torch.compile is on (2026-12-04: the training proof alone took most
#                                        # of a call), so one call each: `proofs -k train_proof`, `proofs -k rlhf`
#   bash tests/gpu/run_suite.sh widths   # LoRA vs full SFT and PEFT at 8B widths, lm-eval at 1B widths (~6 min)
#   bash tests/gpu/run_suite.sh all      # both, where the call's time limit allows
#   bash tests/gpu/run_suite.sh proofs -k rlhf   # arguments after the part go to pytest (one proof per call)
#
# The lm-eval tests need lm-evaluation-harness staged too (`bash benchmarks/stage_wheels.sh fa4 lmeval` here); the
# dynamic inference engine needs FlashAttention-4 (fa4).
#
# Reports: $OUT/gpu_<part>.jsonl (rows of tests/gpu/last_results.jsonl), $OUT/gpu_<part>.jsonl.tests (each test's
# outcome and seconds as it finishes, the failure's reason) and $OUT/gpu_<part>.log; the last lines
# printed are pytest's summary. Record the outcome with its date in tests/gpu/RESULTS.md.
set -uo pipefail
part=${1:-quick}
[[ -f /tmp/site/.ok ]] || { echo "error: megatron-core / Transformer Engine are not staged in /tmp/site (see ../shared/device/README.md)" >&2; exit 1; }
# (FA4's CuTe DSL keeps its packages in a folder a .pth file would add: named here)
export PYTHONPATH=/tmp/site:$(ls -d /tmp/site/nvidia_cutlass_dsl/*_packages 2>/dev/null | tr '\n' ':')$PWD
# torch.compile on, as in a user's run: megatron-core fuses SwiGLU, bias-dropout-add, ... through it (jit_fuser);
# TORCHDYNAMO_DISABLE=1 (the CPU suite's default, tests/conftest.py) would test unfused torch ops instead.
# `TORCHDYNAMO_DISABLE=1 bash tests/gpu/run_suite.sh smoke` runs the suite as before 2026-12-03.
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-0} NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
case "$part" in
  smoke) sel=(tests/gpu -m smoke) ;;
  smoke-gen) sel=(tests/gpu/test_generate_te.py -m smoke) ;;
  smoke-levers) sel=(tests/gpu -m smoke -k training_levers) ;;
  smoke-other) sel=(tests/gpu -m smoke --ignore=tests/gpu/test_generate_te.py -k "not training_levers") ;;
  smoke-train) sel=(tests/gpu -m smoke --ignore=tests/gpu/test_generate_te.py) ;;
  quick) sel=(tests/gpu -m "not widths" -k "not train_proof and not rlhf_proof") ;;
  rest) sel=(tests/gpu -m "not smoke and not widths" -k "not train_proof and not rlhf_proof") ;;
  widths) sel=(tests/gpu -m widths) ;;
  proofs) sel=(tests/gpu/test_train_proof.py tests/gpu/test_rlhf_proof.py) ;;
  all) sel=(tests/gpu) ;;
  *) echo "error: unknown part '$part' (smoke, smoke-gen, smoke-levers, smoke-other, smoke-train, quick, rest, proofs, widths or all)" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
GPU_REPORT=$OUT/gpu_$part.jsonl python3 -m pytest -q -p no:warnings -p no:cacheprovider -rf --durations=8 "${sel[@]}" "${@:2}" 2>&1 | tee "$OUT/gpu_$part.log" | tail -40
exit "${PIPESTATUS[0]}"
