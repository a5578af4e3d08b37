"""H8b's engine (Llama-3.1-8B on an H100, vLLM 0.32.0 V2, 8,192 tokens a step, the advised pool)
probed one request at a time: what kvgate admits or refuses as never fitting (single prompts and
lists of unique prompts), and what the simulator alone serves or runs out of memory on, from a
fresh engine (one prompt, or three one after the other).

    PYTHONPATH=. python bench/results/lists-session35/probe_8192.py
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import replace
from pathlib import Path

import httpx

from bench.__main__ import scenarios_from
from bench.workloads import words
from demo.replay import kvgate
from kvgate.sim.presets import gpu_total_bytes, write_model_folder
from kvgate.sim.runner import SimRunner

SINGLE = (4000, 5000, 6000, 7000, 8000, 12000)
LISTS = ((8, 500), (16, 250), (8, 800))


def answer(url: str, model: str, prompt: object) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    return "served" if r.status_code == 200 else f"{r.status_code}: {r.json()['error']['message'][:160]}"


def main() -> None:
    h8b = next(s for s in scenarios_from(Path("tests/heldout/prompt_lists_8192.py")) if s.key == "H8b")
    cfg = replace(h8b.sim, speedup=20)
    rng = random.Random(5)
    with tempfile.TemporaryDirectory() as tmp, SimRunner(cfg) as sim:
        folder = write_model_folder(cfg.model, Path(tmp) / cfg.model)
        with kvgate(sim.url, folder, h8b.kvgate_flags, gpu_total_bytes(cfg.gpu), Path(tmp) / "kvgate.log") as (
            url,
            _,
            _,
        ):
            for n in SINGLE:
                print(f"kvgate, one prompt of {n}: {answer(url, cfg.model, words(rng, n))}", flush=True)
            for k, n in LISTS:
                print(
                    f"kvgate, {k} prompts of {n}: {answer(url, cfg.model, [words(rng, n) for _ in range(k)])}",
                    flush=True,
                )
    for sizes in ([7000], [8000], [12000], [7000, 8000, 12000]):  # each on a fresh engine
        with SimRunner(cfg) as sim:
            for n in sizes:
                served = answer(sim.url, cfg.model, words(rng, n))
                ooms = httpx.get(sim.url + "/sim/state").json()["ooms"]
                print(
                    f"simulator alone, prompts of {sizes} tokens, the {n}: {served}, out of memory {ooms}", flush=True
                )


if __name__ == "__main__":
    main()
