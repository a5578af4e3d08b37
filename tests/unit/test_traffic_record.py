"""kvgate's traffic record (kvgate/traffic_record.py): fixed histograms whose percentiles are upper
bounds within 4.4 %, bounded memory whatever the traffic, queue waits attributed to the reason a
request queued, and the JSON `GET /advice` prints read back to the same distributions; `kvgate
advise --from` on a page without a GPU size, and on nothing at all."""

from __future__ import annotations

import http.server
import json
import math
import random
import socket
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.advise_live import advise_from, request_json
from kvgate.advise_startup import Request
from kvgate.cli import main
from kvgate.errors import KvNeverFits, QueueFull
from kvgate.gate.observer import Decision
from kvgate.memory.activation import SamplingShape
from kvgate.memory.demand import Demand
from kvgate.predict import Prediction
from kvgate.traffic_record import MAX_QUEUED_TRACKED, TOKEN_EDGES, Histogram, Measured, TrafficRecord
from support.geometry import write_config


def _prediction(prompt: int, new: int, **sampling: int) -> Prediction:
    demand = Demand(prompt, new, (), 1, 0)
    return Prediction(prompt, new, (), demand, SamplingShape(**sampling))


def _record() -> TrafficRecord:
    return TrafficRecord(clock=lambda: 0.0)


def test_percentiles_are_upper_bounds_within_the_bucket_width() -> None:
    rng = random.Random(3)
    values = sorted(rng.randint(1, 200_000) for _ in range(5_000))
    h = Histogram(TOKEN_EDGES)
    for v in values:
        h.observe(v)
    d = h.distribution()
    for q in (0.5, 0.95, 0.99, 1.0):
        exact = values[math.ceil(q * len(values)) - 1]
        assert exact <= d.quantile(q) <= exact * 1.044 + 1, q
    assert d.count == 5_000


def test_memory_does_not_grow_with_the_requests() -> None:
    record = _record()
    for i in range(20_000):
        record.evaluated("completions", _prediction(1 + i % 9_000, 1 + i % 700))
        record.finished("completions", "completed", i % 500)
    routes = record._routes
    assert list(routes) == ["completions"]
    assert len(routes["completions"].prompt.counts) == len(TOKEN_EDGES) + 1
    # request ids that queue and are never heard of again stay bounded too
    for i in range(MAX_QUEUED_TRACKED + 10):
        record.decided(Decision("queue", "kv_cache_busy", f"r{i}", Demand(10, 10, (), 1, 0)))
    assert len(record._queued) == MAX_QUEUED_TRACKED


def test_waits_refusals_and_sampling_are_counted_by_reason() -> None:
    record = _record()
    record.evaluated("chat", _prediction(100, 50, n=2, logprobs=3))
    record.evaluated("chat", _prediction(200, 50, prompt_logprobs=1))
    record.decided(Decision("queue", "transient_memory_busy", "a", Demand(100, 50, (), 9, 0)))
    record.decided(Decision("queue", "kv_cache_busy", "b", Demand(100, 50, (), 9, 0)))
    record.decided(Decision("admit", "dequeued", "a", queue_wait_s=1.5))
    record.decided(Decision("reject", "queue_timeout", "b"))
    record.decided(Decision("admit", "fits", "c", queue_wait_s=0.0))  # never queued: no wait recorded
    record.decided(Decision("reject", "queue_full", "d", error=QueueFull(8, 1)))
    record.decided(Decision("reject", "kv_cache_never_fits", "e", error=KvNeverFits(900, 800, 16, 14000, 400, "it")))
    m = record.snapshot()
    assert m.routes["chat"] == {"requests": 2, "n_above_one": 1, "logprobs": 1, "prompt_logprobs": 1}
    assert {reason: d.count for reason, d in m.queue_waits.items()} == {"transient_memory_busy": 1}
    assert 1.5 <= m.queue_waits["transient_memory_busy"].quantile(0.5) <= 1.5 * 1.1
    assert m.refusals == {"queue_timeout": 1, "queue_full": 1, "kv_cache_never_fits": 1}
    assert m.never_fits_kv_blocks == 900
    assert record._queued_blocks == 0  # both queued requests left the queue


def test_json_reads_back_to_the_same_bounds() -> None:
    record = _record()
    for prompt in (10, 700, 701, 5_000, 60_000):
        record.evaluated("completions", _prediction(prompt, 256))
    record.evaluated("chat", _prediction(1_000, 1_000))
    m = record.snapshot()
    back = Measured.from_json(m.to_json())
    for name in ("prompt", "max_tokens", "request"):
        before, after = m.merged(name), back.merged(name)
        for q in (0.5, 0.99, 1.0):
            assert before.quantile(q) == after.quantile(q)
        for length in (512, 2_048, 8_192, 65_536):
            assert before.share_above(length) == after.share_above(length)
    assert back.traffic().request_tokens == m.traffic().request_tokens


class _Page(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def test_advise_from_a_page_without_a_gpu_size_needs_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A kvgate without GPU readings answers /advice with the deployment (gpu null), what it
    measured and its problem; `kvgate advise --from` then asks for --gpu, and advises with it."""
    folder = write_config(tmp_path, "llama-3.1-8b-instruct")
    record = _record()
    for prompt in (800, 1000, 1200):
        record.evaluated("completions", _prediction(prompt, 512))
    deployment = {**request_json(Request(str(folder), gpu="", max_model_len=8192)), "gpu": None}
    page = {"deployment": deployment, "measured": record.snapshot().to_json(), "advice": None, "problem": "no GPU size"}
    _Page.body = json.dumps(page).encode()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["advise", "--from", url]) == 2
        assert "kvgate advise: no GPU size" in capsys.readouterr().err
        assert main(["advise", "--from", url + "/advice", "--gpu", "h100-80gb", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
    finally:
        server.shutdown()
        server.server_close()
    assert doc["deployment"]["gpu"] == "h100-80gb"
    assert doc["measured"]["routes"]["completions"]["requests"] == 3
    assert doc["advice"]["startup"]["fits"]
    # 1,200 + 512 tokens at most, its bucket's edge rounded up to 256
    assert {r["flag"]: r["value"] for r in doc["advice"]["recommended"]}["--max-model-len"] == 1792


def test_advise_from_an_unreachable_kvgate_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    assert main(["advise", "--from", f"http://127.0.0.1:{port}"]) == 2
    assert capsys.readouterr().err.startswith("kvgate advise: ")


def test_a_running_deployment_advise_predicts_dead_is_judged_by_the_pool_vllm_reported(tmp_path: Path) -> None:
    """The simulator starts --max-num-batched-tokens 200000 where advise (and vLLM 0.10.1's log)
    says the profile dies: the deployment's line uses the pool vLLM reported, the advised one
    (8,192 tokens) that pool scaled by the predicted change."""
    folder = write_config(tmp_path, "llama-3.1-8b-instruct")
    request = Request(
        str(folder), gpu="h100-80gb", vllm_version="0.10.1", max_num_batched_tokens=200000, max_num_seqs=200
    )
    record = _record()
    for prompt in (800, 1000, 16000):
        record.evaluated("completions", _prediction(prompt, 256))
    record.decided(Decision("queue", "kv_cache_busy", "a", Demand(16000, 256, (), 1017, 0)))
    record.decided(Decision("admit", "dequeued", "a", queue_wait_s=2.0))
    measured = replace(record.snapshot(), kv_pool_blocks=1000, peak_kv_demand_blocks=1200)
    advice = advise_from(request, measured)
    assert not advice.startup.fits
    deployed, advised = advice.effects[0], advice.effects[1]
    assert (deployed.label, deployed.starts, deployed.pool_blocks) == ("as deployed", True, 1000)
    assert deployed.kv_waits == 1
    assert not deployed.kv_waits_avoided
    assert advised.starts
    assert {r.flag: r.value for r in advice.recommended}["--max-num-batched-tokens"] == 8192
