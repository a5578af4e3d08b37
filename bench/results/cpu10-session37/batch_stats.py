"""Least and median CPU a chat per arm of a pairs.sh output: over every batch, and over each run's
batches after its first (the first after the warm-up still fills kvgate's caches: 0.68-0.79 ms
where the later ones are 0.51-0.63 in request_cpu.txt).

`python bench/results/cpu10-session37/batch_stats.py request_cpu.txt [more files]`
"""

from __future__ import annotations

import ast
import re
import statistics
import sys


def main(paths: list[str]) -> None:
    for path in paths:
        every: dict[str, list[float]] = {"main": [], "branch": []}
        later: dict[str, list[float]] = {"main": [], "branch": []}
        arm, batch = "", 0
        with open(path) as lines:
            for line in lines:
                heading = re.match(r"== round \d+ (\w+)", line)
                if heading:
                    arm, batch = heading.group(1), 0
                elif line.startswith("chat ") and arm:
                    value = ast.literal_eval(line[5:])["cpu_ms_per_request"]
                    every[arm].append(value)
                    batch += 1
                    if batch > 1:
                        later[arm].append(value)
        print(path)
        for name, values in every.items():
            rest = later[name]
            print(
                f"  {name:6} all {len(values)} batches: least {min(values):.3f} median {statistics.median(values):.3f} ms"
                f" | after each run's first ({len(rest)}): least {min(rest):.3f} median {statistics.median(rest):.3f} ms"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
