"""vLLM's command line, pasted: its memory flags under vLLM's names, the rest accepted and ignored."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvgate.cli import parse_command_line
from kvgate.settings import Settings, settings_from_args
from kvgate.sim.cli import add_arguments as add_sim_arguments
from kvgate.units import GiB, MiB, parse_size

# A real `vllm serve` command line for Llama-3.1-8B on one H100, as an operator would paste it.
VLLM_COMMAND = [
    "vllm",
    "serve",
    "meta-llama/Llama-3.1-8B-Instruct",
    "--host",
    "0.0.0.0",
    "--port",
    "8000",
    "--api-key",
    "secret",
    "--dtype",
    "bfloat16",
    "--max-model-len",
    "16k",
    "-tp",
    "1",
    "--gpu-memory-utilization",
    "0.95",
    "--max-num-seqs",
    "512",
    "--max-num-batched-tokens",
    "8K",
    "--enable-prefix-caching",
    "--enforce-eager",
    "--max-logprobs",
    "50",
    "--logprobs-mode",
    "processed_logprobs",
    "--kv-cache-memory-bytes",
    "49.94GiB",
    "--cudagraph-capture-sizes",
    "1",
    "2",
    "4",
    "--max-cudagraph-capture-size",
    "256",
    "--trust-remote-code",
    "--enable-log-requests",
    "--speculative-config",
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}',
    "--uvicorn-log-level",
    "warning",
]


def test_vllm_size_suffixes_read_as_vllm_reads_them_and_as_it_logs_them() -> None:
    assert parse_size("1k") == 1000
    assert parse_size("1K") == 1024
    assert parse_size("25.6k") == 25600
    assert parse_size("49.94GiB") == int(49.94 * 2**30) == parse_size("49.94 GiB")
    assert parse_size("2G") == 2 * 2**30
    assert parse_size("123") == 123
    assert parse_size(" 7 ") == 7
    assert parse_size("100MiB") == 100 * MiB
    assert parse_size("80GB") == 80 * 10**9
    with pytest.raises(ValueError, match="Decimals are not allowed with binary suffixes like K"):
        parse_size("1.5K")
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("lots")


@pytest.mark.parametrize(
    ("flag", "field"),
    [
        ("--free-memory-bytes", "free_memory_bytes"),
        ("--gpu-memory-bytes", "gpu_memory_bytes"),
        ("--cuda-context-bytes", "cuda_context_bytes"),
        ("--profiled-activation-bytes", "profiled_activation_bytes"),
        ("--max-body-bytes", "max_body_bytes"),
        ("--max-header-bytes", "max_header_bytes"),
        ("--kv-cache-memory-bytes", "kv_cache_memory_bytes"),
    ],
)
def test_every_byte_flag_takes_vllms_units(flag: str, field: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def value(*argv: str) -> object:
        return getattr(settings_from_args(parse_command_line(["serve", *argv])), field)

    assert value(flag, "100MiB") == 100 * MiB
    assert value(flag, "1G") == GiB
    assert value(flag, "1g") == 10**9
    assert value(flag, "1.5k") == 1500
    assert value(flag, "1048576") == MiB
    monkeypatch.setenv(f"KVGATE_{field.upper()}", "2GiB")
    assert value() == 2 * GiB
    with pytest.raises(SystemExit, match=f"{flag}: Value error, Decimals are not allowed"):
        value(flag, "1.5G")


def test_every_byte_field_of_settings_reads_sizes() -> None:
    """A new byte-valued setting cannot forget the units: any field named *_bytes reads `1K`."""
    byte_fields = [name for name in Settings.model_fields if name.endswith("_bytes")]
    assert len(byte_fields) >= 7
    settings = Settings(**dict.fromkeys(byte_fields, "1K"))
    assert all(getattr(settings, name) == 1024 for name in byte_fields)


def test_max_model_len_takes_vllms_auto_and_sizes() -> None:
    def max_model_len(value: str) -> object:
        return settings_from_args(parse_command_line(["serve", "--max-model-len", value])).max_model_len

    assert max_model_len("auto") is None
    assert max_model_len("-1") is None
    assert max_model_len("32k") == 32000
    assert max_model_len("32K") == 32768


def test_the_simulators_byte_flags_take_vllms_units() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(["--non-torch-bytes", "100MiB", "--cuda-context-bytes", "1G", "--cotenant", "x:2GiB:1"])
    assert args.non_torch_bytes == 100 * MiB
    assert args.cuda_context_bytes == GiB
    assert args.cotenant[0].bytes == 2 * GiB


def test_a_whole_vllm_command_line_pastes_after_a_double_dash() -> None:
    args = parse_command_line(["serve", "--max-queue", "9", "--", *VLLM_COMMAND])
    settings = settings_from_args(args)
    assert settings.max_queue == 9
    assert settings.max_model_len == 16000
    assert settings.max_num_batched_tokens == 8192
    assert settings.max_num_seqs == 512
    assert settings.gpu_memory_utilization == 0.95
    assert settings.kv_cache_memory_bytes == int(49.94 * 2**30)
    assert settings.enforce_eager is True
    assert settings.max_logprobs == 50
    assert settings.logprobs_mode == "processed_logprobs"
    assert settings.dtype == "bfloat16"
    assert settings.cudagraph_capture_sizes == [1, 2, 4]
    assert settings.max_cudagraph_capture_size == 256
    assert settings.speculative_config is not None
    assert settings.speculative_config.num_speculative_tokens == 4
    assert args.ignored_vllm_options == [
        "--host",
        "--port",
        "--api-key",
        "--trust-remote-code",
        "--enable-log-requests",
        "--uvicorn-log-level",
    ]


def test_vllm_flags_inline_and_a_model_folder_as_vllms_positional(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    args = parse_command_line(["explain", "body.json", "--host", "0.0.0.0", "--", "serve", str(tmp_path), "-tp", "2"])
    assert args.model == str(tmp_path)
    assert args.ignored_vllm_options == ["--host"]
    assert settings_from_args(args).tensor_parallel_size == 2


def test_a_flag_neither_kvgates_nor_vllms_is_still_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_command_line(["serve", "--max-queu", "5"])
    assert "--max-queu" in capsys.readouterr().err


def test_an_unparsable_speculative_config_stops_start_up_naming_the_flag() -> None:
    with pytest.raises(SystemExit) as bad:
        settings_from_args(parse_command_line(["serve", "--speculative-config", "{num_speculative_tokens: 4}"]))
    assert "--speculative-config" in str(bad.value)
    assert "JSON" in str(bad.value)


def test_the_simulator_takes_vllms_flags_from_the_one_declaration() -> None:
    """`kvgate sim` reads vLLM's names, aliases and values as `serve` does (kvgate.vllm_flags), and
    keeps only its own defaults: the release it plays, batch sizes picked by GPU."""
    from kvgate.sim.cli import config_from_args

    args = parse_command_line(
        [
            "sim",
            "--attention-backend",
            "materializing-eager",
            "-sc",
            '{"method": "ngram", "num_speculative_tokens": "4", "prompt_lookup_max": 4}',
            "--model-runner",
            "v1",
            "--max-num-batched-tokens",
            "8K",
        ]
    )
    cfg = config_from_args(args)
    assert (cfg.attention_backend, cfg.model_runner, cfg.max_num_batched_tokens) == ("materializing-eager", "v1", 8192)
    assert cfg.speculative_config == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    plain = config_from_args(parse_command_line(["sim"]))
    assert (plain.vllm_version, plain.max_num_batched_tokens, plain.speculative_config) == ("0.32.0", None, None)
    # the fields as given: no num_speculative_tokens is the simulator's start-up error, as vLLM's
    assert config_from_args(parse_command_line(["sim", "-sc", '{"method": "ngram"}'])).speculative_config == {
        "method": "ngram"
    }
