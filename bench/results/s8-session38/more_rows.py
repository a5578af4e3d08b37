"""Whether the step kvgate admits a stream with (frontier.py) runs after one earlier step of 1-5
streams MORE, beside a chat chunk every 128 tokens (with or without another stream's children
prefilling): streams leaving between steps. Run: `PYTHONPATH=.:tests python
bench/results/s8-session38/more_rows.py`.
"""

from __future__ import annotations

import sys

sys.path.insert(0, "bench/results/s8-session38")

import frontier as f


def main() -> None:
    engine, budget, predictor = f.s8.s8.__wrapped__()
    for prefill in (0, 500, 1000):
        count = f.admitted(budget, predictor, prefill)
        for streams in range(max(0, count - 6), count):
            step = f.step_of(streams, prefill, children=True)
            bad = [
                (more, tokens, children)
                for more in range(streams + 1, streams + 6)
                for tokens in range(0, 2049, 128)
                for children in (False, True)
                if f.runs_after(engine, [f.step_of(more, tokens, children=children)], step) is False
            ]
            print(
                f"prefill {prefill}: kvgate admits {count}; {streams} decoding + 1 prefilling after a step of more "
                f"streams: {len(bad)} failing {bad[:4]}",
                flush=True,
            )


if __name__ == "__main__":
    main()
