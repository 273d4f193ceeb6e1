#!/bin/sh
# The images and the manifests as an operator runs them on one machine, with podman, as root:
# the images built (cached layers reused; minutes when the code changed), the cpu-demo overlay
# played (a proxy, two CPU replicas found by DNS), the official openai SDK streaming through the
# proxy, each replica replaced under continuous streaming load (every stream token-exact), and
# nothing left behind: tests/deploy/test_podman.py, which `make test` leaves out (-m podman).
# Needs (Debian): apt-get install podman runc netavark aardvark-dns iptables mmdebstrap; kubectl.
set -eu
cd "$(dirname "$0")/.."
make install
exec .venv/bin/python -m pytest -q -s -m podman tests/deploy/test_podman.py "$@"
