#!/bin/bash
# Alternate one kvgate-arm run from each of two trees, N times: pairs.sh BASE VAR PYTHON SCENARIO N OUT [repeat_arm args]
# (BASE, VAR: copies of the trees to compare, `git ls-files -co --exclude-standard | tar ...`; PYTHON: a venv's python)
# Each run appends one line to OUT: the tree, the pair, the start time, /proc/loadavg and repeat_arm's JSON line.
BASE=$1; VAR=$2; PY=$3; S=$4; N=$5; OUT=$6; shift 6
for i in $(seq 1 "$N"); do
  for tree in base var; do
    dir=$BASE; [ "$tree" = var ] && dir=$VAR
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    start=$(date -u +%H:%M:%S)
    line=$(cd "$dir" && PYTHONPATH="$dir" timeout 900 "$PY" -m bench.repeat_arm "$S" --arm kvgate --runs 1 "$@" 2>/dev/null | grep '^{' | tail -1)
    echo "$tree $S pair$i start=$start load=[$load] $line" >> "$OUT"
  done
done
