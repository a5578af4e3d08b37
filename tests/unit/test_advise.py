"""`kvgate advise`: the JSON and text a user reads, the start-up steps by release, and advised flags
that the same prediction says start (the CLI run in-process; tests/integration runs the command)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvgate import advise
from kvgate.advise_flags import recommend, serving_failure
from kvgate.advise_startup import Request, predict
from kvgate.cli import main
from kvgate.units import GiB
from support.fake_pynvml import FakeDevice, FakeNvml
from support.geometry import write_config

MISTRAL_200K = [
    "--gpu",
    "h100-80gb",
    "--vllm-version",
    "0.10.1",
    "--max-num-batched-tokens",
    "200000",
    "--max-num-seqs",
    "200",
]


def run_advise(folder: Path, *argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["advise", "--model", str(folder), *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def advise_json(folder: Path, *argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    rc, out, _ = run_advise(folder, *argv, "--json", capsys=capsys)
    return rc, json.loads(out)


def test_json_names_the_failing_step_allocation_and_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's first story: --max-num-batched-tokens 200000 on Mistral-7B, vLLM 0.10.1, H100."""
    rc, doc = advise_json(write_config(tmp_path, "mistral-7b-instruct-v0.2"), *MISTRAL_200K, capsys=capsys)
    assert rc == 1
    startup = doc["startup"]
    assert startup["fits"] is False
    assert startup["failure"]["step"].startswith("profile_run")
    assert startup["failure"]["flag"] == "--max-num-batched-tokens"
    assert startup["failure"]["bytes"] == 200_000 * 14336 * 2  # "Tried to allocate 5.34 GiB"
    for key in ("kv_cache_bytes", "kv_cache_tokens", "max_concurrency"):
        assert startup[key] is None  # vLLM died before sizing a pool
        assert doc["advised_startup"][key] > 0
    flags = {r["flag"]: r for r in doc["recommended"]}
    assert flags["--max-num-batched-tokens"]["value"] == 8192  # vLLM's H100 default, whose profile fits
    assert all(set(r) == {"flag", "value", "reason"} and r["reason"] for r in doc["recommended"])
    assert doc["advised_startup"]["fits"] is True
    assert doc["advised_startup"]["max_num_batched_tokens"] == 8192


def test_text_prints_the_lines_vllm_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_config(tmp_path, "llama-3.1-8b-instruct")
    rc, out, _ = run_advise(
        folder, "--gpu", "h100-80gb", "--vllm-version", "0.11.0", "--max-model-len", "16000", capsys=capsys
    )
    assert rc == 0
    assert "Model loading took 14.96 GiB" in out
    assert "Available KV cache memory: " in out
    assert "Maximum concurrency for 16,000 tokens per request: " in out
    assert "start-up: fits" in out
    assert "--kv-cache-memory-bytes" in out


def test_bad_input_is_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_config(tmp_path, "llama-3.1-8b-instruct")
    rc, out, err = run_advise(folder, "--gpu", "no-such-gpu", capsys=capsys)
    assert (rc, out) == (2, "")
    assert "unknown GPU 'no-such-gpu'" in err
    rc, out, err = run_advise(tmp_path / "missing", "--gpu", "h100-80gb", capsys=capsys)
    assert (rc, out) == (2, "")
    assert "neither a folder with config.json nor a model in the local Hugging Face hub cache" in err
    rc, _, err = run_advise(
        folder, "--gpu", "h100-80gb", "--vllm-version", "0.9.0", "--kv-cache-memory-bytes", "40GiB", capsys=capsys
    )
    assert rc == 2
    assert "no --kv-cache-memory-bytes" in err


def request(tmp_path: Path, model: str = "llama-3.1-8b-instruct", **flags: Any) -> Request:
    return Request(str(write_config(tmp_path, model)), **flags)


def test_cuda_graphs_leave_the_pool_from_0_20(tmp_path: Path) -> None:
    """VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to 1 from 0.20.0: the graphs come out of the
    budget; before, they are captured after the pool, on top of it."""
    before = predict(request(tmp_path, gpu="h100-80gb", vllm_version="0.19.0", max_model_len=16000))
    after = predict(request(tmp_path, gpu="h100-80gb", vllm_version="0.20.0", max_model_len=16000))
    assert before.graphs == after.graphs > 0
    assert before.kv_cache_bytes - after.kv_cache_bytes == pytest.approx(after.graphs, abs=1)


def test_graphs_outside_the_budget_die_at_high_utilization(tmp_path: Path) -> None:
    """vLLM PR #19480: graphs captured after a pool sized at 0.99 run out of memory."""
    s = predict(
        request(tmp_path, gpu="h100-80gb", vllm_version="0.11.0", gpu_memory_utilization=0.99, max_model_len=16000)
    )
    assert s.failure is not None
    assert s.failure.step.startswith("capture_model")
    assert s.failure.flag == "--gpu-memory-utilization"
    advised, recs = recommend(s)
    assert advised.fits
    (util,) = [r.value for r in recs if r.flag == "--gpu-memory-utilization"]
    assert util < 0.99


def test_free_memory_check_from_0_9_1(tmp_path: Path) -> None:
    """V1's init_device refuses when total x utilization exceeds the free memory (0.9.1 on)."""
    full = predict(request(tmp_path, gpu="h100-80gb", vllm_version="0.11.0", gpu_memory_utilization=1.0))
    assert full.failure is not None
    assert full.failure.step.startswith("init_device")
    assert full.failure.kind == "refuses"
    older = predict(request(tmp_path, gpu="h100-80gb", vllm_version="0.9.0", gpu_memory_utilization=1.0))
    assert older.failure is None or not older.failure.step.startswith("init_device")


def test_too_large_kv_cache_memory_bytes_starts_then_dies_under_traffic(tmp_path: Path) -> None:
    """The issue's second story (vLLM PR #56698): with --kv-cache-memory-bytes vLLM skips its
    measurement, so a pool that leaves less than a full step's transient memory starts and dies at
    the first large batch. The advised size leaves room for it."""
    big = predict(
        request(tmp_path, gpu="h100-80gb", vllm_version="0.32.0", kv_cache_memory_bytes=62 * GiB, max_model_len=32768)
    )
    assert big.fits
    failure = serving_failure(big)
    assert failure is not None
    assert failure.flag == "--kv-cache-memory-bytes"
    _, recs = recommend(big)
    (pool,) = [r.value for r in recs if r.flag == "--kv-cache-memory-bytes"]
    safe = predict(replace(big.request, kv_cache_memory_bytes=int(pool)))
    assert safe.fits
    assert serving_failure(safe) is None
    assert pool < 62 * GiB


def test_refused_max_model_len_is_advised_the_budget_up_or_the_length_down(tmp_path: Path) -> None:
    """The issue's third story, offline: a context the pool cannot hold (Qwen3-32B on one H100 at
    24,576 tokens on vLLM 0.11.0: 4.56 GiB of pool for 6 GiB). With room outside the budget advise
    raises --gpu-memory-utilization; with another process holding that room, it proposes the
    longest length that fits (vLLM's own estimate, rounded down to 1,024)."""
    s = predict(request(tmp_path, "qwen3-32b", gpu="h100-80gb", vllm_version="0.11.0", max_model_len=24576))
    assert s.failure is not None
    assert s.failure.flag == "--max-model-len"
    advised, recs = recommend(s)
    assert advised.fits
    assert "--max-model-len" not in {r.flag for r in recs}
    assert advised.utilization > s.utilization
    advised, recs = recommend(s, other_processes_bytes=5 * GiB)
    assert advised.fits
    assert s.estimated_max_model_len is not None
    assert [r.value for r in recs if r.flag == "--max-model-len"] == [s.estimated_max_model_len // 1024 * 1024]
    assert advised.utilization == s.utilization


def test_co_tenants_are_read_through_nvml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before vLLM starts, what NVML shows used on its GPU is other processes': the advice leaves
    it free as `--other-processes-bytes` does (which wins when given); no NVML reads as none."""
    gpu = FakeDevice("GPU-0", 80 * GiB, processes={4242: 5 * GiB})
    assert advise.co_tenant_bytes(FakeNvml([gpu, FakeDevice("GPU-1", 80 * GiB)])) == 5 * GiB
    assert advise.co_tenant_bytes(FakeNvml([gpu], driver=False)) == 0
    folder = write_config(tmp_path, "qwen3-32b")
    flags = ("--gpu", "h100-80gb", "--vllm-version", "0.11.0", "--max-model-len", "24576")
    monkeypatch.setattr(advise, "co_tenant_bytes", lambda: 5 * GiB)
    _, via_nvml = advise_json(folder, *flags, capsys=capsys)
    _, given = advise_json(folder, *flags, "--other-processes-bytes", str(5 * GiB), capsys=capsys)
    _, alone = advise_json(folder, *flags, "--other-processes-bytes", "0", capsys=capsys)
    assert via_nvml["recommended"] == given["recommended"] != alone["recommended"]


@pytest.mark.parametrize(
    ("model", "flags"),
    [
        ("llama-3.1-8b-instruct", dict(gpu="a100-40gb", vllm_version="0.10.1.1", dtype="float16")),
        ("llama-3.1-8b-instruct", dict(gpu="l4-24gb", vllm_version="0.32.0", max_model_len=20000)),
        ("qwen3-32b", dict(gpu="h100-80gb", vllm_version="0.33.0", max_model_len=16000)),
        ("mistral-7b-instruct-v0.2", dict(gpu="h100-80gb", vllm_version="0.10.1", max_num_batched_tokens=200000)),
        ("deepseek-r1-distill-qwen-14b", dict(gpu="rtx-4090-24gb", vllm_version="0.11.0", tensor_parallel_size=2)),
    ],
)
def test_every_advised_flag_set_starts_and_serves(tmp_path: Path, model: str, flags: dict[str, Any]) -> None:
    """The advised flags applied to the user's command: vLLM starts, and with the advised
    --kv-cache-memory-bytes too, a full step still fits beside the pool."""
    s = predict(request(tmp_path, model, **flags))
    _, recs = recommend(s)
    values = {r.flag: r.value for r in recs}
    names = {
        "--max-num-batched-tokens": "max_num_batched_tokens",
        "--max-num-seqs": "max_num_seqs",
        "--gpu-memory-utilization": "gpu_memory_utilization",
        "--max-model-len": "max_model_len",
    }
    advised = replace(s.request, **{names[f]: v for f, v in values.items() if f in names})
    started = predict(advised)
    assert started.failure is None
    if "--kv-cache-memory-bytes" in values:
        pooled = predict(replace(advised, kv_cache_memory_bytes=int(values["--kv-cache-memory-bytes"])))
        assert pooled.failure is None
        assert serving_failure(pooled) is None


def test_capacity_is_the_pool_step_of_advise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`kvgate capacity --kv-cache-memory-bytes` prints the pool advise predicts for that size."""
    folder = write_config(tmp_path, "llama-3.1-8b-instruct")
    rc, doc = advise_json(
        folder, "--gpu", "h100-80gb", "--vllm-version", "0.11.0", "--max-model-len", "16000", capsys=capsys
    )
    assert rc == 0
    pool = doc["startup"]["kv_cache_bytes"]
    main(
        ["capacity", "--model", str(folder), "--kv-cache-memory-bytes", str(pool), "--max-model-len", "16000", "--json"]
    )
    capacity = json.loads(capsys.readouterr().out)
    assert capacity["kv_cache_tokens"] == doc["startup"]["kv_cache_tokens"]
    assert capacity["num_blocks"] == doc["startup"]["kv_cache_blocks"]


def test_request_from_reads_pasted_vllm_flags(tmp_path: Path) -> None:
    folder = write_config(tmp_path, "llama-3.1-8b-instruct")
    from kvgate.cli import parse_command_line

    args = parse_command_line(
        [
            "advise",
            "--gpu",
            "h100-80gb",
            "--",
            "vllm",
            "serve",
            str(folder),
            "-tp",
            "2",
            "--max-model-len",
            "32k",
            "--enforce-eager",
        ]
    )
    req = advise.request_from(args)
    assert (req.model, req.tensor_parallel_size, req.max_model_len, req.enforce_eager) == (str(folder), 2, 32000, True)


def test_weights_that_do_not_fit_one_gpu_get_tensor_parallelism(tmp_path: Path) -> None:
    """Mixtral-8x7B's 87 GiB of bf16 weights on one H100 die loading; TP 2 holds half on each GPU."""
    s = predict(request(tmp_path, "mixtral-8x7b-v0.1", gpu="h100-80gb", vllm_version="0.32.0"))
    assert s.failure is not None
    assert s.failure.step.startswith("load_model")
    assert s.failure.flag == "--tensor-parallel-size"
    advised, recs = recommend(s)
    assert advised.fits
    assert [r.value for r in recs if r.flag == "--tensor-parallel-size"] == [2]
    assert advised.weights == pytest.approx(s.weights / 2, rel=0.01)


@pytest.mark.parametrize(
    ("spec", "name"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),  # as nvidia-smi prints it
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090-24gb"),
        ("l4", "l4-24gb"),
    ],
)
def test_gpu_names_as_nvidia_smi_prints_them(spec: str, name: str) -> None:
    from kvgate.gpus import GPUS, gpu_name, gpu_total_bytes

    assert gpu_name(spec) == name
    assert gpu_total_bytes(spec) == GPUS[name]


@pytest.mark.parametrize("spec", ["a100", "L40S"])
def test_an_ambiguous_or_unknown_gpu_is_named_in_the_error(spec: str) -> None:
    """An A100 without its size could be either; an L40S is not an L4."""
    from kvgate.gpus import gpu_total_bytes

    with pytest.raises(KeyError, match=f"unknown GPU '{spec}'"):
        gpu_total_bytes(spec)
