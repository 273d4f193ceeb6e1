#!/usr/bin/env bash
# The GPU call: every GPU figure and test in stages, each under its own timeout, in
# order of value; a failing stage never stops the next; progress unbuffered; each
# stage's output in $OUT/<stage>.md (at most 8 files come back from a call).
#
#   bash bench/gpu.sh [STAGE ...]        # on the GPU machine (the device tool's run)
#   bash bench/gpu.sh --dry-run [STAGE ...]   # here, on CPU: the same stages on tiny shapes
#
# Stages, in order of value; the default is the lease's one call (decode spec tests profile peer,
# each under its own timeout: 500 s in all, inside one command's 540), then $OUT/summary.json
# (bench/gpu_summary.py: card, decode_ms_b1, roofline_ms_b1, peer_ms_b1, host_syncs_per_spec_step,
# spec_step_over_plain, spec_implied_speedup):
#   decode   engine decode at batch 1/8/32/64, 8B shape, eager / graphs / graphs + overlap, each
#            with and without fused decode (--fused both: rope_store, merge-free decode attention),
#            roofline and GPU idle in the same process, then every graph bucket's logits
#            against eager decoding's                        (bench/decode.py)
#   spec     EAGLE-3 step times at the 8B shape: chain 3 / tree 16 / tree 32 at batch 1, 4 and 16
#            against plain decoding, host syncs per step counted (bench/spec_gpu.py)
#   tests    pytest -m gpu: Triton kernels vs references (bf16 included), graphs vs
#            eager, overlap vs synchronous, EAGLE-3 under graphs vs plain decoding
#   profile  one step's device time by kernel name at batch 1 and 8 (what the roofline gap is made of)
#   peer     (last, capped) transformers' generate with a static cache (it compiles the forward
#            itself), batch 1 and 8, same shape
# Named only (a second call while the machine is warm):
#   service  replica + proxy on the GPU, the openai SDK at 1 and 16 streams (bench/gpu_service.py)
#   load     a replica of the 8B shape started from safetensors on disk (a Hugging Face folder of
#            random bf16 shards written first): start to ready, its stages, the engine's peak host
#            memory, one completion served                  (bench/gpu_load.py)
#   kernels  Triton kernels' GB/s against the copy bandwidth (bench/kernels.py --quick)
#   host     engine host time per step, graph step preparation (bench/engine.py --host)
#   train    an EAGLE-3 head for the default model trained on the GPU, packed into
#            $OUT/eagle3-head.tar.part-*, and its measured speed-up (bench/gpu_train.sh; needs the GGUF
#            carried in two parts: `mkdir -p .gguf && split -n 2 "$(.venv/bin/python -c 'from
#            replica.model.loader import resolve_model; print(resolve_model("default"))')" .gguf/part-`,
#            .gguf/ ignored by git, part-aa carried by one call, part-ab by the next)
# The lease's calls (each brings back at most 8 files of $OUT; the next within the 30 s the
# machine stays warm):
#   run(command="bash bench/gpu.sh", carry=[".whl"], timeout_s=540)
#   run(command="bash bench/gpu.sh service load kernels host", carry=[".whl"], timeout_s=540)
#   with .gguf/part-aa carried by one of them: run(command="bash bench/gpu.sh train", carry=[".whl", ".gguf/part-ab"])
# Measured on an H200 (2026-11-26): decode 26 s, spec 39 s (batch 1 only then), tests 24 s, host 5 s,
# machine start about 90 s; the peer compiled for over 100 s; the service 257 s while its replica drew
# random weights on the CPU (now on the device).
# Wheels the image lacks: `bash bench/gpu_wheels.sh` here first (fills .whl/, ignored by git).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(decode spec tests profile peer)
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ $DRY = 1 ]; then
  PY=${PY:-.venv/bin/python}
else
  PY=${PY:-python3}
  if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.installed || echo "wheel install FAILED"
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
fi
$PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"

declare -A TIMEOUT=([decode]=130 [spec]=150 [tests]=60 [profile]=60 [peer]=100 [service]=150 [load]=200 [kernels]=100 [host]=20 [train]=400)
# The dry run checks that each stage runs, on a CPU that may be shared with a build or a
# test suite: its stages get three times the device's budget (a decode stage took over
# 130 s on two cores at load 6).
if [ $DRY = 1 ]; then for s in "${!TIMEOUT[@]}"; do TIMEOUT[$s]=$((3 * ${TIMEOUT[$s]})); done; fi
stage_cmd() {  # the command of a stage; the dry run's on tiny shapes
  case "$1:$DRY" in
    decode:0) echo "$PY bench/decode.py --no-peer --steps 32 --fused both" ;;
    decode:1) echo "$PY bench/decode.py --no-peer --batches 1 4 --steps 2 --context 32 --fused both" ;;
    profile:0) echo "$PY bench/decode.py --profile 1 8" ;;
    profile:1) echo "$PY bench/decode.py --profile 1 --context 32" ;;
    peer:0) echo "$PY bench/decode.py --peer-only --peer-batches 1 8" ;;
    peer:1) echo "$PY bench/decode.py --peer-only --peer-batches 1 --steps 4 --context 16" ;;
    tests:0) echo "$PY -m pytest -q -m gpu -p no:cacheprovider -p no:benchmark -n 8 tests/kernels tests/replica" ;;
    # Here: the GPU tests are collected (and skipped) without building any C++ extension.
    tests:1) echo "env TORCH_EXTENSIONS_DIR=$OUT/ext $PY -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/replica" ;;
    service:0) echo "$PY bench/gpu_service.py" ;;
    service:1) echo "$PY bench/gpu_service.py --model smollm2-135m --device cpu --max-tokens 8 --streams 1,4" ;;
    spec:0) echo "$PY bench/spec_gpu.py" ;;
    spec:1) echo "$PY bench/spec_gpu.py --model smollm2-135m --layers 4 --device cpu --dtype float32 --steps 1 --warmup 1 --context 32 --batches 1,4" ;;
    load:0) echo "$PY bench/gpu_load.py" ;;
    load:1) echo "$PY bench/gpu_load.py --preset smollm2-135m --device cpu --dtype float32 --file-gb 0.2" ;;
    kernels:0) echo "$PY bench/kernels.py --quick" ;;
    kernels:1) echo "$PY bench/kernels.py --help" ;;
    host:0) echo "$PY bench/engine.py --graph-prepare --device cuda" ;;
    host:1) echo "$PY bench/engine.py --graph-prepare --device cpu" ;;
    train:*) echo "env DRY=$DRY PY=$PY OUT=$OUT bash bench/gpu_train.sh" ;;
    *) return 1 ;;
  esac
}

declare -a SUMMARY
T0=$SECONDS
for s in "${STAGES[@]}"; do
  cmd=$(stage_cmd "$s") || { echo "unknown stage $s"; SUMMARY+=("$s: unknown"); continue; }
  echo "=== $s (timeout ${TIMEOUT[$s]}s): $cmd"
  t=$SECONDS
  timeout -k 10 "${TIMEOUT[$s]}" $cmd 2>&1 | tee "$OUT/$s.md" | grep -v '^\s*$' | tail -n 40
  rc=${PIPESTATUS[0]}
  [ $DRY = 1 ] && [ "$s" = tests ] && [ -n "$(ls -A "$OUT/ext" 2>/dev/null)" ] && { echo "a C++ extension was built"; rc=99; }
  SUMMARY+=("$s: rc=$rc in $((SECONDS - t))s")
  echo "=== $s: rc=$rc in $((SECONDS - t))s (total $((SECONDS - T0))s)"
done
rm -rf "$OUT/ext"
echo; echo "## summary"; printf '%s\n' "${SUMMARY[@]}"
# The figures in one file, whichever stages ran (a figure of a stage not run is null).
$PY bench/gpu_summary.py "$OUT" "${SUMMARY[@]}" > /dev/null && echo "figures: $OUT/summary.json" \
  || echo "summary FAILED"
