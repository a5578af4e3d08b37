#!/usr/bin/env bash
# Held-out H4-H6 (tests/heldout/scenarios.py), one run of each arm, from the repository root:
#   bash bench/results/heldout-session32/new/run.sh > bench/results/heldout-session32/new/runs.jsonl
# Each line is bench.repeat_arm's JSON (OOMs, completed, goodput, TTFT p50/p99, refusals by reason
# and by kind of request, the simulator's OOM messages).
set -u
for spec in "H4 none oracle kvgate cap-8 cap-32" "H5 none oracle kvgate cap-16 cap-64" "H6 none oracle kvgate cap-8 cap-32"; do
  set -- $spec
  key=$1
  shift
  for arm in "$@"; do
    .venv/bin/python -m bench.repeat_arm "$key" --scenarios-from tests/heldout/scenarios.py --arm "$arm" 2>/dev/null
  done
done
