#!/usr/bin/env bash
# Fetch the wheels the GPU machine lacks (bench/gpu_wheels.txt names them, lock/all.txt pins
# them) into .whl/, here, for Python 3.12 on x86-64 Linux; then carry them:
# run(command="bash bench/gpu.sh", carry=[".whl"]).
#
#   bash bench/gpu_wheels.sh
#
# pure-Python wheels are py3-none-any; the binary ones are cp312 (or abi3) manylinux wheels
# (llguidance >= 1.9 publishes manylinux_2_31 only). .whl/ is kept out of git through
# .git/info/exclude, never .gitignore.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF /.whl/ "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
rm -rf .whl
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
grep -E '^[A-Za-z0-9]' bench/gpu_wheels.txt | while read -r name; do
  pin=$(grep -iE "^${name}==" lock/all.txt | sed -E 's/[ ;\\].*//')
  [ -n "$pin" ] || { echo "gpu_wheels.sh: $name (bench/gpu_wheels.txt) is not in lock/all.txt" >&2; exit 1; }
  echo "$pin"
done > "$pins"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform any -d .whl -r "$pins"
# exactly one wheel per listed package, and nothing else
want=$(grep -cE '^[A-Za-z0-9]' bench/gpu_wheels.txt)
have=$(ls .whl/*.whl | wc -l)
if [ "$want" != "$have" ]; then
  echo "gpu_wheels.sh: $have wheels in .whl/ for $want packages in bench/gpu_wheels.txt" >&2
  exit 1
fi
du -sh .whl
