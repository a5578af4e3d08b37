#!/bin/bash
# stage_cpu, main and branch interleaved, pinned to core 0. Usage: MAIN_TREE= BRANCH_TREE= PYTHON= stage_pairs.sh ROUNDS
for r in $(seq 1 "$1"); do
  for arm in main branch; do
    if [ $arm = main ]; then tree="$MAIN_TREE"; else tree="$BRANCH_TREE"; fi
    echo "== round $r $arm $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd "$tree" && PYTHONPATH="$tree" taskset -c 0 "$PYTHON" -m bench.stage_cpu --passes 3 2>&1 | grep -E "^(render|evaluate|admission|decision|metrics|relay) ")
  done
done
echo "== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
