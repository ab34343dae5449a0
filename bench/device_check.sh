#!/usr/bin/env bash
# The one prepared check for a lent GPU (issue 20): the cuda tests, batch-1 and batch-8 decode and time
# to first token on the random Qwen3-1.7B-shaped model (ours against transformers' default generate and
# its static cache + compile), a short training run, and the serving benchmark once bench/serve.py
# exists; each step under its own time limit, at most 8 minutes in all. Results: device_check.json,
# device_check.md and device_check.log under $OUT (else bench/results/device-check/).
#
#   bench/device_check.sh                 # on a machine with an NVIDIA GPU
#   bench/device_check.sh --dry-run       # the same steps on the CPU with the tiny model (make test runs it)
#   bench/device_check.sh --only generate_b1,train --limit train=120 --compile-mode reduce-overhead
#
# It installs nothing. Python: $PYTHON if set, else the first of .venv/bin/python (make setup's) and
# python3 whose torch imports (and, without --dry-run, sees a CUDA GPU); this checkout's src/ goes first
# on PYTHONPATH, so the package needs no install. Options are bench/device_check.py's (--help).
set -u
cd "$(dirname "$0")/.." || exit 2

dry=0
for arg in "$@"; do
    [ "$arg" = "--dry-run" ] && dry=1
done
if [ "$dry" = 1 ]; then
    probe='import torch'
else
    probe='import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'
fi

if [ -n "${PYTHON:-}" ]; then
    candidates=("$PYTHON")
else
    candidates=(.venv/bin/python python3)
fi
py=""
for c in "${candidates[@]}"; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "$probe" >/dev/null 2>&1; then
        py="$c"
        break
    fi
done
if [ -z "$py" ]; then
    if [ "$dry" = 1 ]; then
        echo "device_check: no Python with torch among: ${candidates[*]}; run make setup, or set PYTHON." >&2
    else
        echo "device_check: no CUDA GPU visible to any of: ${candidates[*]} (torch.cuda.is_available() is False);" \
             "run it on a machine with an NVIDIA GPU, or pass --dry-run for the CPU." >&2
    fi
    exit 2
fi

export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" bench/device_check.py "$@"
