#!/bin/bash
# Whole requests, main and the branch interleaved (main, branch, main, branch ...), each run pinned
# to core 0. Usage: MAIN_TREE=DIR BRANCH_TREE=DIR PYTHON=PY pairs.sh ROUNDS [bench.request_cpu args]
# (a tree: `git ls-files -co --exclude-standard | tar -cf - -T - | tar -xf - -C DIR` of a checkout).
rounds=$1; shift
for r in $(seq 1 "$rounds"); do
  for arm in main branch; do
    if [ $arm = main ]; then tree="$MAIN_TREE"; else tree="$BRANCH_TREE"; fi
    echo "== round $r $arm $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) args: $*"
    (cd "$tree" && PYTHONPATH="$tree" taskset -c 0 "$PYTHON" -m bench.request_cpu --requests 2000 --repeat 3 \
      --warmup 300 --concurrency 32 "$@" 2>&1 | grep "^chat")
  done
done
echo "== end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
