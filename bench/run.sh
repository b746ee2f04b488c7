#!/usr/bin/env bash
# The benchmarks in one command; every argument goes to `python -m bench` (see bench/README.md):
#   bench/run.sh                 smoke size (~50 MB checkpoints), every part
#   bench/run.sh --size full     the real run (~2 GB checkpoints)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
exec "$python" -m bench "$@"
