"""A zero-cost stand-in for vLLM, for the overhead benchmark: raw asyncio, HTTP/1.1 keep-alive.

`python -m bench.zero_backend --port P [--num-gpu-blocks N]`. It answers what kvgate reads at
start-up and on its scrape (`/v1/models`, `/metrics` with `vllm:cache_config_info`, `/health`,
`/tokenize`) and, for `POST /v1/completions` and `/v1/chat/completions`, a canned completion, or
with `"stream": true` in the body a 16-token SSE stream (chunked encoding, every event written
at once). No framework, no JSON parsing of the body beyond a substring test.
"""

from __future__ import annotations

import argparse
import asyncio
import json

TOKENS = 16
MODEL = "llama-3.1-8b"


def _metrics(blocks: int) -> bytes:
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
        f'engine="0",gpu_memory_utilization="0.9",num_gpu_blocks="{blocks}"}} 1.0\n'
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.0\n'
    ).encode()


def _response(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 "
        + status.encode()
        + b"\r\ncontent-type: "
        + ctype
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def _chunked_stream() -> bytes:
    out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"]
    for i in range(TOKENS):
        ev = json.dumps(
            {
                "id": "cmpl-zero",
                "object": "text_completion",
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "text": f" tok{i}",
                        "logprobs": None,
                        "finish_reason": None if i < TOKENS - 1 else "length",
                    }
                ],
            }
        )
        data = f"data: {ev}\n\n".encode()
        out.append(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    done = b"data: [DONE]\n\n"
    out.append(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
    return b"".join(out)


def build(blocks: int, max_model_len: int) -> dict[tuple[bytes, bytes], bytes]:
    completion = json.dumps(
        {
            "id": "cmpl-zero",
            "object": "text_completion",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "text": " ok" * TOKENS, "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": TOKENS, "total_tokens": 26},
        }
    ).encode()
    models = json.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": max_model_len}]}
    ).encode()
    return {
        (b"GET", b"/v1/models"): _response("200 OK", models),
        (b"GET", b"/metrics"): _response("200 OK", _metrics(blocks), b"text/plain"),
        (b"GET", b"/health"): _response("200 OK", b""),
        (b"POST", b"completion"): _response("200 OK", completion),
        (b"POST", b"stream"): _chunked_stream(),
        (b"POST", b"/tokenize"): _response(
            "200 OK", json.dumps({"count": 3, "max_model_len": max_model_len, "tokens": [1, 2, 3]}).encode()
        ),
    }


async def serve(port: int, blocks: int, max_model_len: int) -> None:
    table = build(blocks, max_model_len)
    not_found = _response("404 Not Found", b'{"error": {"message": "not found", "code": 404}}')

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, _, rest = head.partition(b"\r\n")
                method, path, _ = line.split(b" ", 2)
                length = 0
                low = rest.lower()
                i = low.find(b"content-length:")
                if i >= 0:
                    length = int(low[i + 15 : low.index(b"\r\n", i)])
                body = await reader.readexactly(length) if length else b""
                if method == b"POST" and path.startswith(b"/v1/"):
                    key = (b"POST", b"stream" if b'"stream":true' in body.replace(b" ", b"") else b"completion")
                else:
                    key = (method, path.split(b"?")[0])
                writer.write(table.get(key, not_found))
                if b"connection: close" in low:
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--num-gpu-blocks", type=int, default=100000)
    p.add_argument("--max-model-len", type=int, default=32768)
    a = p.parse_args()
    try:
        import uvloop  # uvicorn[standard] brings it

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(serve(a.port, a.num_gpu_blocks, a.max_model_len))


if __name__ == "__main__":
    main()
