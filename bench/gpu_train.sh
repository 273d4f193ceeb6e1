#!/usr/bin/env bash
# bench/gpu.sh's `train` stage: an EAGLE-3 head for the default model trained on the GPU within
# a budget, packed into $OUT/eagle3-head.tar.part-* (the device keeps nothing; `cat` them), then its measured
# speed-up there (bench/speculative.py). The GGUF (98 MB) exceeds one call's 64 MiB: carry
# .gguf/part-aa in one call and .gguf/part-ab in the next, on the warm machine (split -n 2, see
# bench/gpu.sh). Dry run (DRY=1): the default model from the venv, a few prompts, seconds.
set -euo pipefail
OUT=${OUT:-/tmp/gpu-out}; PY=${PY:-python3}
if [ "${DRY:-0}" = 1 ]; then
  model=default device=cpu limits=(--limit-prompts 2 --max-new-tokens 8 --time-budget 0.1)
else
  ls .gguf/part-* >/dev/null 2>&1 || { echo "no .gguf/part-* carried: nothing to train on"; exit 3; }
  cat .gguf/part-* > /tmp/default.gguf
  model=/tmp/default.gguf device=cuda limits=(--limit-prompts 256 --time-budget 3)
fi
rm -rf /tmp/eagle3-head
$PY -m speculative.train --model "$model" --device $device --out /tmp/eagle3-head "${limits[@]}"
# the head alone (no training data or optimizer state), in parts under the 16 MiB a returned file may have
tar -C /tmp/eagle3-head -cf - config.json model.safetensors | split -b 15M - "$OUT/eagle3-head.tar.part-"
if [ "${DRY:-0}" = 1 ]; then exit 0; fi
$PY bench/speculative.py --model "$model" --device cuda --head /tmp/eagle3-head --batches 1,4 --min-seqs 4 \
  --tau-specs "chain 3,tree 16,tree 32" --speed-specs "chain 3,tree 16,tree 32" --skip-gemm
