#!/usr/bin/env bash
# The `gpu` tests on the lent GPU, with per-test durations; log to $1 (default $OUT).
set -uo pipefail
out=${1:-${OUT:-/tmp/kiln-gpu}}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 KILN_PROGRESS=0 KILN_TUNE=${KILN_TUNE:-none}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$out/env.txt"
python3 -m pytest -m gpu tests -q -rfE -p no:cacheprovider -p no:logging --durations 25 \
  --timeout 300 --maxfail 15 --tb=short "${@:2}" 2>&1 | tee "$out/gpu-tests.log" | tail -80
