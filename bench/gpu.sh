#!/usr/bin/env bash
# One call on a GPU machine (the device tool): install what the image lacks from
# carried wheels, run the GPU tests, then every GPU benchmark; logs under $OUT.
#
# Here, once per session:   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     msgspec gguf xxhash tokenizers jinja2 markupsafe safetensors tqdm
# Then: run(command="bash bench/gpu.sh", carry=[".whl"])
#
# Speculative decoding (EAGLE-3 head trained on the GPU, then bench/speculative.py)
# needs the default model's GGUF, too big for one call's tree: split it here
#   echo /.gguf/ >> .git/info/exclude; mkdir -p .gguf
#   split -n 2 "$(.venv/bin/python -c 'from replica.hf_checkpoint import resolve_model as r; print(r("default"))')" .gguf/part-
# (98 MB: two parts of 49 MB) and carry .gguf/part-aa in a first call (`true`), then
# .gguf/part-ab with this script (a carried path stays on the warm machine while
# later calls do not name it again).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
python3 bench/kernels.py 2>&1 | tee "$OUT/kernels.md" | tail -40
python3 bench/decode.py "$@" 2>&1 | tee "$OUT/decode.md" | tail -30
if ls .gguf/part-* >/dev/null 2>&1; then
  cat .gguf/part-* > /tmp/default.gguf
  python3 -m speculative.train --model /tmp/default.gguf --device cuda 2>&1 | tee "$OUT/spec_train.log" | tail -5
  python3 bench/speculative.py --model /tmp/default.gguf --device cuda --write-policy 2>&1 \
    | tee "$OUT/speculative.md" | tail -30
fi
