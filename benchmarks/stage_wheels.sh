#!/usr/bin/env bash
# Stage extra wheels for the GPU machine (no network there) beside megatron-core and Transformer Engine
# (../shared/device/README.md stages those): run HERE, from the project root, after ../shared/device/stage.sh.
#
#   bash benchmarks/stage_wheels.sh fa4          # FlashAttention-4 (CuTe DSL) for the dynamic inference engine
#   bash benchmarks/stage_wheels.sh titan        # torchtitan 0.2.2, its dependencies and torchao (train_bench.py's peers, FP8 too)
#   bash benchmarks/stage_wheels.sh lmeval       # lm-evaluation-harness 0.4.13 and what the GPU image lacks of its
#                                                # dependencies (the GPU suite's lm-eval tests)
#   bash benchmarks/stage_wheels.sh peft         # PEFT 0.21.2 and accelerate (the GPU suite's LoRA export check, `widths`)
#   bash benchmarks/stage_wheels.sh liger        # Liger kernels 0.8.5 (train_bench.py's hf-liger peer; Triton, pure Python)
#   bash benchmarks/stage_wheels.sh NAME==VER... # any wheels
#
# Wheels go to .device/extra (.gitignore lists /.device/). A call may carry 64 MiB, so files over 50 MiB are split into
# parts, one folder .device/xN per call; the script prints the `run` calls to make, back to back, on the warm
# machine that already has /tmp/site. The last call runs .device/extra/install.sh, which joins the parts,
# checks their SHA-256 and installs everything into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# FlashAttention-4 runs on SM90 with a paged KV cache (megatron-core prefers it in flash_decode_and_prefill);
# pure Python over NVIDIA's CuTe DSL, whose CUDA 13 libraries are the one large wheel.
FA4=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
     nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5)
TITAN=(torchtitan==0.2.2 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 typing-extensions==4.16.0
       tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1 torchdata==0.11.0
       torchao==0.18.0)  # torchao: torchtitan's FP8 row (Float8Linear; 0.18 wants torch >= 2.11)
# the GPU image has pyarrow, pandas, scikit-learn, sacrebleu, huggingface-hub; three of these exist only as sdists
# and are built into (pure Python) wheels here
LMEVAL=(lm-eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19 pytablewriter==1.2.1
        dataproperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5
        chardet==6.0.0.post1 sqlitedict==2.1.0 rouge-score==0.1.2 word2number==1.1 more-itertools==11.2.1
        nltk==3.10.4 defusedxml==0.7.1)
PEFT=(peft==0.21.2 accelerate==1.16.0 psutil==7.2.2)
LIGER=(liger-kernel==0.8.5)  # needs torch and triton only, both in the GPU image
WANT=()
for a in "$@"; do
  case "$a" in
    fa4) WANT+=("${FA4[@]}") ;; titan) WANT+=("${TITAN[@]}") ;; lmeval) WANT+=("${LMEVAL[@]}") ;; peft) WANT+=("${PEFT[@]}") ;; liger) WANT+=("${LIGER[@]}") ;; *) WANT+=("$a") ;;
  esac
done
[[ ${#WANT[@]} -gt 0 ]] || { echo "error: name fa4, titan, lmeval, peft, liger or wheels (NAME==VER)" >&2; exit 1; }
D=.device/extra
rm -rf "$D" .device/x[0-9]*
mkdir -p "$D"
for w in "${WANT[@]}"; do
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps $PLAT -d "$D" "$w" 2>/dev/null || python3 -m pip download -q --no-deps -d "$D" "$w"
done
shopt -s nullglob
for sdist in "$D"/*.tar.gz "$D"/*.zip; do  # no wheel on the registry: build one (no network on the GPU machine)
  python3 -m pip wheel -q --no-deps --no-build-isolation -w "$D" "$sdist" 2>/dev/null \
    || python3 -m pip wheel -q --no-deps -w "$D" "$sdist"
  rm "$sdist"
done
shopt -u nullglob
n=0
for f in "$D"/*.whl; do
  [[ $(stat -c %s "$f") -gt $((50 * 1024 * 1024)) ]] || continue
  sha256sum "$f" | cut -d' ' -f1 > "$f.sha256"
  split -b 50m -d -a 2 "$f" "$f.part."
  rm "$f"
  for p in "$f".part.*; do n=$((n + 1)); mkdir -p ".device/x$n"; mv "$p" ".device/x$n/"; done
done
cat > "$D/install.sh" <<'EOF'
#!/usr/bin/env bash
# On the GPU machine: join the split wheels from /tmp/stage_extra, check them, install all into $SITE.
set -euo pipefail
D=$(cd "$(dirname "$0")" && pwd) SITE=${SITE:-/tmp/site} J=/tmp/stage_extra/joined
mkdir -p "$J"
for sum in "$D"/*.whl.sha256; do
  [[ -e "$sum" ]] || continue
  name=$(basename "${sum%.sha256}")
  cat $(ls /tmp/stage_extra/x*/"$name".part.* | sort) > "$J/$name"
  [[ "$(sha256sum "$J/$name" | cut -d' ' -f1)" == "$(cat "$sum")" ]] || { echo "error: $name: checksum mismatch, restage" >&2; exit 1; }
done
shopt -s nullglob
# unpacked rather than `pip install --target`, which skips a top-level folder that an earlier wheel made (the
# CuTe DSL's three wheels share nvidia_cutlass_dsl/)
mkdir -p "$SITE"
for whl in "$D"/*.whl "$J"/*.whl; do python3 -m zipfile -e "$whl" "$SITE"; done
echo "installed into $SITE:" $(cd "$D" && ls *.whl) $(cd "$J" && ls *.whl)
# .pth files are not read from PYTHONPATH entries: name the folders they would add (CuTe DSL's packages)
extra=$(ls -d "$SITE"/nvidia_cutlass_dsl/*_packages 2>/dev/null | tr '\n' ':')
echo "then: export PYTHONPATH=$SITE:${extra}\$PWD"
EOF
echo "staged ${#WANT[@]} wheels ($n parts). Device calls, back to back, on the machine that has /tmp/site:"
for i in $(seq 1 "$n"); do
  echo "  run carry=[\".device/x$i\"]  command: mkdir -p /tmp/stage_extra/x$i && cp .device/x$i/* /tmp/stage_extra/x$i/"
done
echo "  run carry=[\".device/extra\"]  command: bash .device/extra/install.sh && <your command>"
