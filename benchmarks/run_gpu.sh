#!/usr/bin/env bash
# Every GPU step of a session in one call: environment, `gpu` tests, then benchmarks.
# Usage (on the GPU machine, from the repo root): bash benchmarks/run_gpu.sh [OUTDIR] [BENCH...]
# Results land in OUTDIR (default $OUT): env.txt, gpu-tests.log, one file per benchmark.
set -uo pipefail
out=${1:-${OUT:-/tmp/kiln-gpu}}
shift || true
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 KILN_PROGRESS=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
python3 -m pytest -q -m gpu tests -p no:cacheprovider -p no:logging 2>&1 | tee "$out/gpu-tests.log" | tail -40
for b in "$@"; do
  name=$(basename "$b" .py)
  echo "== $name"
  python3 "$b" --out "$out/$name.txt" 2>&1 | tail -40
done
