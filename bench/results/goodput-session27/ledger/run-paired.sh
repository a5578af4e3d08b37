#!/bin/bash
# Alternating before/after runs of one arm (session 27, branch ledger).
# BEFORE: `git archive 68a225c | tar -x -C $BEFORE` (main before this branch); AFTER: the branch's
# working tree; PY: the branch's .venv python. Each tree runs with PYTHONPATH on itself.
one() { # label tree scenario [repeat_arm options]
  local label=$1 tree=$2 scn=$3; shift 3
  echo "# $label $scn $(date -u +%H:%M:%S) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  (cd "$tree" && PYTHONPATH="$tree" nice -n 10 "$PY" -m bench.repeat_arm "$scn" --runs 1 "$@")
}
# paired-runs-1.txt
for i in 1 2; do one before "$BEFORE" S1; one after "$AFTER" S1; done
one before "$BEFORE" H3 --scenarios-from tests/heldout/scenarios.py
one after "$AFTER" H3 --scenarios-from tests/heldout/scenarios.py
one before "$BEFORE" S13
one after "$AFTER" S13
# paired-runs-2.txt (after first, to cancel drift)
for i in 1 2 3; do one after "$AFTER" S1; one before "$BEFORE" S1; done
# paired-runs-3.txt
one after "$AFTER" H3 --scenarios-from tests/heldout/scenarios.py
one before "$BEFORE" H3 --scenarios-from tests/heldout/scenarios.py
# paired-runs-4.txt
one before "$BEFORE" H3 --scenarios-from tests/heldout/scenarios.py
one after "$AFTER" H3 --scenarios-from tests/heldout/scenarios.py
one after "$AFTER" H3 --scenarios-from tests/heldout/scenarios.py
one before "$BEFORE" H3 --scenarios-from tests/heldout/scenarios.py
