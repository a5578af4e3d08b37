#!/usr/bin/env bash
# Second runs after runs.jsonl (same code, d91a357's kvgate): H6's smallest cap, and H5 and H4's
# kvgate and oracle again, back to back, for the spread on a shared machine:
#   bash bench/results/heldout-session32/new/repeat.sh > bench/results/heldout-session32/new/repeat.jsonl
set -u
run() { .venv/bin/python -m bench.repeat_arm "$1" --scenarios-from tests/heldout/scenarios.py --arm "$2" 2>/dev/null; }
run H6 cap-2
run H5 oracle
run H5 kvgate
run H5 kvgate
run H4 oracle
run H4 kvgate
