#!/usr/bin/env bash
# The `gpu` tests on the lent GPU, with per-test durations; log to $1 (default $OUT),
# extra pytest arguments after it (files, -k ...).
#
# KILN_GPU_TESTS_BUDGET_S=N ends the run after N seconds with SIGINT, so pytest still
# prints which tests failed and why, and the summary: a device call's time limit
# otherwise kills pytest before its report (a failure once went unnamed that way). The
# log names every test with its outcome (-v); stdout shows the failures and the summary.
set -uo pipefail
out=${1:-${OUT:-/tmp/kiln-gpu}}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 KILN_PROGRESS=0 KILN_TUNE=${KILN_TUNE:-none}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$out/env.txt"
budget=${KILN_GPU_TESTS_BUDGET_S:-0}
run=(python3 -m pytest -m gpu -v -rfE -p no:cacheprovider -p no:logging --durations 25
     --timeout 300 --maxfail 15 --tb=short)
if [ "$budget" -gt 0 ]; then
  run=(timeout -s INT -k 30 "$budget" "${run[@]}")
fi
# no path: pytest's testpaths (tests/)
# each line stamped with the seconds since the start when it ended: a test's line ends
# with its outcome, so a run cut by the budget still shows where the time went
"${run[@]}" "${@:2}" 2>&1 | while IFS= read -r line; do printf '%4ds %s\n' "$SECONDS" "$line"; done \
  | tee "$out/gpu-tests.log" | grep -Ev " (PASSED|SKIPPED|XFAIL)" | tail -80
