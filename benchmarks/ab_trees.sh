#!/usr/bin/env bash
# A/B of two kiln trees in one device call, interleaved: each command runs from its
# tree's own directory, so it imports that tree's kiln.
#
# Why: `python3 -m kiln.cli ...` puts the current directory first on sys.path, so an
# "old copy on PYTHONPATH" A/B run from the repository root imports the working tree
# for both sides (the thirtieth session's first two A/Bs compared the new code with
# itself). Each run here prints the kiln it imported.
#
#   bash benchmarks/ab_trees.sh OLD_TREE NEW_TREE ROUNDS OUT_DIR -- COMMAND...
#
# OLD_TREE / NEW_TREE: directories holding a `kiln` package (e.g. `git archive HEAD kiln
# | tar -x -C _gpu/old`, and `.` for the working tree). COMMAND runs ROUNDS times per
# tree, old then new, with {out} replaced by OUT_DIR/<old|new>-<round> and its own
# KILN_CACHE_DIR; its output goes to that path's .log. Example (on the device):
#   bash benchmarks/ab_trees.sh _gpu/old . 2 $OUT -- python3 -m kiln.cli bench \
#       --prefill "" --contexts 128,2048 --batches 1 --sweep "" --runners kiln --out {out}
# A script runs from the working tree by its absolute path ($PWD/benchmarks/x.py): its
# own directory comes first on sys.path, then the tree's (PYTHONPATH=.).
set -uo pipefail
if [ $# -lt 6 ] || [ "$5" != "--" ]; then
  sed -n 2,19p "$0"; exit 2
fi
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); rounds=$3; out=$(mkdir -p "$4" && cd "$4" && pwd)
shift 5
for r in $(seq 1 "$rounds"); do
  for side in old new; do
    tree=$old; [ "$side" = new ] && tree=$new
    dest="$out/$side-$r"
    cmd=("${@//\{out\}/$dest}")
    (cd "$tree" && export PYTHONPATH=. KILN_CACHE_DIR="/tmp/kiln-ab-$side" && \
      python3 -c "import kiln; print('[$side $r] kiln from', kiln.__file__)" && \
      "${cmd[@]}" > "$dest.log" 2>&1)
    echo "[$side $r] exit $? (log $dest.log)"
  done
done
