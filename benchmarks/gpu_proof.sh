#!/usr/bin/env bash
# The GPU proof in one run (see benchmarks/gpu_proof.py): on a fresh GPU machine without network,
#     benchmarks/gpu_proof.sh [FOLDER]        # the report: FOLDER/gpu_proof.md (default: $OUT, else gpu_proof_out/)
# Wheels for what such a machine lacks (benchmarks/gpu_wheels.txt) are installed from .whl/ beside the tree
# when that folder exists. On a machine without CUDA it says so and exits with status 2.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)' 2>/dev/null; then
    echo "gpu_proof.sh: needs a CUDA GPU, and torch sees none here (or is missing); nothing was run" >&2
    exit 2
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    site=${TMPDIR:-/tmp}/logitscope-site
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || { echo "gpu_proof.sh: installing the wheels in .whl/ failed" >&2; exit 1; }
    export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" benchmarks/gpu_proof.py ${1:+--out "$1"}
