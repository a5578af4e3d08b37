"""Shares of a py-spy raw profile (`py-spy record -f raw`) of `python -m bench.request_cpu`, over the
samples under its measured requests (`measure.<locals>.client`): each function's inclusive share
(its frame anywhere in the stack) and self share (the innermost Python frame; py-spy samples no
native frames, so a C call's time is its caller's).

`python bench/results/cpu10-session37/pyspy_shares.py RAW_FILE`
"""

from __future__ import annotations

import collections
import re
import sys


def main(path: str) -> None:
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    with open(path) as raw:
        for line in raw:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            if not any("measure.<locals>.client" in frame for frame in frames):
                continue
            n = int(count)
            total += n
            names = [re.sub(r":\d+\)$", ")", frame) for frame in frames]  # a function, not a line
            for name in set(names):
                inclusive[name] += n
            own[names[-1]] += n
    print(f"samples under measure(): {total}")
    print("\nINCLUSIVE (top 60)")
    for name, c in inclusive.most_common(60):
        print(f"{c / total * 100:6.1f} %  {name}")
    print("\nSELF (top 40)")
    for name, c in own.most_common(40):
        print(f"{c / total * 100:6.1f} %  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
