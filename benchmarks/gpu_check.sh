#!/usr/bin/env bash
# The GPU check in one go: the validation suite on NCCL and on gloo with CUDA tensors, the fake
# world on one GPU (properties, simulate), the differential tests against torch's DDP, and the
# overhead table. See benchmarks/gpu_check.py (--help, --list). Installs nothing: it runs the
# python on PATH, or $PYTHON, with whatever torch that has. Without a GPU it says why, exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python || command -v python3 || echo python)}"
exec "$PYTHON" benchmarks/gpu_check.py "$@"
