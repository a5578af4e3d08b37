"""Of the KV block-steps H8's lists would hold if each were kept whole to its last prompt's end,
the share that belongs to prompts already finished: what a per-prompt relief could free.

A model, not a run: every prompt of a list starts decoding at once and makes one token a step
(a list's prompts prefill together, H8 at 2,048 tokens a step takes a few steps more), its
length is the simulator's own (kvgate/sim/tokens.py TextModel, at most max_tokens), and it holds
ceil((prompt + output) / 16) blocks all along (its full length, not its growth).

    PYTHONPATH=. python bench/results/lists-session35/finished_share.py
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from bench.__main__ import scenarios_from
from kvgate.sim.api import parse
from kvgate.sim.model import load_model
from kvgate.sim.request import Request
from kvgate.sim.server import engine_requests
from kvgate.sim.tokens import StandInTokenizer, TextModel


def output_length(model: TextModel, req: Request) -> int:
    while True:
        token, stop = model(req)
        req.output_token_ids.append(token)
        if stop or len(req.output_token_ids) >= req.sampling.max_tokens:
            return len(req.output_token_ids)


def main() -> None:
    scenarios = scenarios_from(Path("tests/heldout/scenarios.py"))
    index = [s.key for s in scenarios].index("H8")
    h8 = scenarios[index]
    tok = StandInTokenizer(load_model(h8.sim.model, h8.sim.dtype).vocab)
    text = TextModel(tok, h8.sim.seed)
    held = used = 0
    shares = []
    for call in h8.traffic(random.Random(1000 + index), 1.0):  # bench.repeat_arm's seed
        if call.label != "eval list":
            continue
        parsed = parse(call.body, chat=False, tok=tok, served=h8.sim.model, max_model_len=16384, clamps_max_tokens=True)
        reqs = [r for per_prompt in engine_requests(parsed, "list") for r in per_prompt]
        lengths = [output_length(text, r) for r in reqs]
        last = max(lengths)
        blocks = [math.ceil((r.num_prompt_tokens + n) / 16) for r, n in zip(reqs, lengths, strict=True)]
        mine = sum(b * n for b, n in zip(blocks, lengths, strict=True))
        after = sum(b * (last - n) for b, n in zip(blocks, lengths, strict=True))
        used, held = used + mine, held + after
        shares.append(after / (mine + after))
    shares.sort()
    print(
        f"{len(shares)} lists: finished prompts' share of the block-steps held {held / (held + used):.2f} overall, "
        f"per list {shares[0]:.2f} - {shares[-1]:.2f} (median {shares[len(shares) // 2]:.2f})"
    )


if __name__ == "__main__":
    main()
