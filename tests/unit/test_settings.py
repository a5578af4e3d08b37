"""Configuration: flags beat KVGATE_* variables beat defaults; the backend's report beats flags."""

from __future__ import annotations

import logging

import pytest

from kvgate.cli import build_parser
from kvgate.composition import engine_flags
from kvgate.engine_config import build_predictor, resolve
from kvgate.memory.geometry import ModelGeometry
from kvgate.settings import Settings, settings_from_args
from kvgate.telemetry.vllm import CacheConfig, ServedModel
from support.geometry import model_geometry


def settings_for(*argv: str) -> Settings:
    return settings_from_args(build_parser().parse_args(["serve", *argv]))


def test_flag_beats_environment_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert settings_for().max_queue == 1024
    monkeypatch.setenv("KVGATE_MAX_QUEUE", "7")
    monkeypatch.setenv("KVGATE_ENABLE_PREFIX_CACHING", "false")
    assert settings_for().max_queue == 7
    assert settings_for().enable_prefix_caching is False
    assert settings_for("--max-queue", "5").max_queue == 5
    assert settings_for("--enable-prefix-caching").enable_prefix_caching is True


def test_bad_values_exit_with_the_flag_named() -> None:
    with pytest.raises(SystemExit) as bad:
        settings_for("--max-queue", "lots")
    assert "--max-queue" in str(bad.value)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--attention-backend", "magic"])


def test_help_documents_every_setting_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
        assert f"KVGATE_{name.upper()}; default: {field.default}]" in text, name


def test_backend_report_wins_over_flags_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    geometry = ModelGeometry.from_config(
        {
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "intermediate_size": 256,
            "vocab_size": 2048,
            "max_position_embeddings": 4096,
        }
    )
    settings = settings_for("--block-size", "16", "--no-enable-prefix-caching", "--max-model-len", "2048")
    cache = CacheConfig(
        num_gpu_blocks=100,
        block_size=128,
        cache_dtype="auto",
        enable_prefix_caching=True,
        gpu_memory_utilization=0.92,
    )
    with caplog.at_level(logging.WARNING):
        deployment = resolve(engine_flags(settings), geometry, cache, ServedModel("tiny", 1024))
    assert (deployment.block_size, deployment.enable_prefix_caching, deployment.max_model_len) == (128, True, 1024)
    assert deployment.num_gpu_blocks == 100
    assert deployment.gpu_memory_utilization == 0.92
    warned = caplog.text
    assert "block_size=128" in warned
    assert "max_model_len=1024" in warned
    assert "enable_prefix_caching=True" in warned
    assert "gpu_memory_utilization" not in warned  # not given as a flag: nothing to disagree with


def test_without_a_backend_report_flags_and_model_apply() -> None:
    geometry = ModelGeometry.from_config(
        {
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "intermediate_size": 256,
            "vocab_size": 2048,
            "max_position_embeddings": 4096,
        }
    )
    deployment = resolve(engine_flags(settings_for("--block-size", "32")), geometry, None, None)
    assert (deployment.block_size, deployment.max_model_len, deployment.num_gpu_blocks) == (32, 4096, None)
    assert deployment.attention_backend == "flash-attn"


def test_hybrid_state_models_take_the_backends_block_size_and_cache_mode(caplog: pytest.LogCaptureFixture) -> None:
    geometry = ModelGeometry.from_config(
        {
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 4,
            "intermediate_size": 256,
            "vocab_size": 2048,
            "max_position_embeddings": 4096,
            "layer_types": ["mamba", "mamba", "mamba", "attention"],
        }
    )
    with caplog.at_level(logging.WARNING):
        resolve(engine_flags(settings_for()), geometry, None, None)
    assert "recurrent state" in caplog.text
    assert "--block-size" in caplog.text
    caplog.clear()
    cache = CacheConfig(
        num_gpu_blocks=100,
        block_size=400,
        cache_dtype="auto",
        enable_prefix_caching=True,
        gpu_memory_utilization=0.9,
        mamba_cache_mode="align",
    )
    with caplog.at_level(logging.WARNING):
        deployment = resolve(engine_flags(settings_for()), geometry, cache, None)
    assert caplog.text == ""
    layout = build_predictor(deployment, geometry).layout
    assert (layout.block_size, layout.mamba_cache_mode) == (400, "align")
    # 3 state groups of one layer, two pages each in align mode, + the attention layer's blocks
    assert layout.blocks_for_request(1_000, 1_000, 1, 2048, 4096) == 3 * 2 + 3


def test_vllms_capacity_report_is_a_floor_on_blocks_per_sequence(caplog: pytest.LogCaptureFixture) -> None:
    geometry = ModelGeometry.from_config(
        {
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "intermediate_size": 256,
            "vocab_size": 2048,
            "max_position_embeddings": 4096,
        }
    )

    def layout_when_vllm_reports(blocks_per_request: float):
        cache = CacheConfig(
            num_gpu_blocks=1000,
            block_size=16,
            cache_dtype="auto",
            enable_prefix_caching=True,
            gpu_memory_utilization=0.9,
            max_request_blocks=blocks_per_request,
        )
        deployment = resolve(engine_flags(settings_for()), geometry, cache, ServedModel("m", 4096))
        return build_predictor(deployment, geometry).layout

    with caplog.at_level(logging.WARNING):
        same = layout_when_vllm_reports(256.0)  # 4096 / 16: the layout agrees
    assert same.extra_blocks_per_sequence == 0
    assert caplog.text == ""
    # vLLM counts 3 more blocks per request (e.g. state groups kvgate does not know of):
    # every sequence reserves them, a 100-token one included
    with caplog.at_level(logging.WARNING):
        more = layout_when_vllm_reports(259.0000000001)
    assert more.extra_blocks_per_sequence == 3
    assert "reserves 3 more blocks" in caplog.text
    assert more.blocks_for_request(100, 100, 1, 2048, 4096) == 7 + 3
    assert more.blocks_for_request(100, 150, 2, 2048, 4096) == (6 + 2 * (10 - 6)) + 2 * 3
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        fewer = layout_when_vllm_reports(128.0)
    assert fewer.extra_blocks_per_sequence == 0
    assert "admit fewer requests than fit" in caplog.text


def test_a_fixed_kv_pool_sizes_the_blocks_and_the_headroom_without_the_utilization() -> None:
    from kvgate.composition import engine_flags
    from kvgate.engine_config import static_limits, weights_bytes

    geometry = ModelGeometry.from_config(
        {
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_hidden_layers": 32,
            "intermediate_size": 14336,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "torch_dtype": "bfloat16",
        }
    )
    settings = settings_for(
        "--kv-cache-memory-bytes", "40GiB", "--gpu-memory-bytes", str(80 * 2**30), "--gpu-memory-utilization", "0.5"
    )
    deployment = resolve(engine_flags(settings), geometry, None, None)
    predictor = build_predictor(deployment, geometry)
    budget = static_limits(
        deployment, predictor, settings.free_memory_bytes, settings.gpu_memory_bytes, settings.kv_cache_memory_bytes
    )
    # 40 GiB / (32 layers x 2 x 8 heads x 128 x 2 B = 128 KiB per token) = 327,680 tokens = 20,480 blocks
    assert budget.kv_blocks == 20480 - 1
    # less the profile's non-torch increase (0.16 GiB, vLLM PR #12126) and the CUDA context (500 MiB)
    used = 40 * 2**30 + weights_bytes(predictor.layout) + predictor.profiled_peak_bytes
    # the profile region at its segments' size: a 2,048-token forward pass needs 274 MiB of
    # segments for its 200 MiB allocated peak after a step of another size (kvgate/memory/allocator.py)
    used += 74 * 2**20
    expected = 80 * 2**30 - used - int(0.16 * 2**30) - 500 * 2**20
    assert budget.transient_headroom_bytes == expected  # not 80 GiB x (1 - 0.5)
    assert 20 * 2**30 < expected < 30 * 2**30  # ~16 GB of weights, ~1 GiB of profile peak
    # with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True freed memory strands nowhere
    expandable = static_limits(
        deployment,
        predictor,
        settings.free_memory_bytes,
        settings.gpu_memory_bytes,
        settings.kv_cache_memory_bytes,
        expandable_segments=True,
    )
    assert expandable.transient_headroom_bytes == expected + 74 * 2**20
    assert expandable.segment_overhead == 0.0
    assert settings_for("--expandable-segments").expandable_segments
    assert not settings.expandable_segments  # kvgate cannot read vLLM's environment: off unless told


def llama_3_8b() -> ModelGeometry:
    return model_geometry("llama-3-8b")


def flags_mode_headroom(*flags: str) -> int:
    """kvgate's static transient headroom from flags alone (no backend, no --free-memory-bytes)."""
    from kvgate.composition import engine_flags
    from kvgate.engine_config import static_limits

    geometry = llama_3_8b()
    settings = settings_for("--gpu-memory-bytes", str(80 * 2**30), "--gpu-memory-utilization", "0.9", *flags)
    deployment = resolve(engine_flags(settings), geometry, None, None)
    predictor = build_predictor(deployment, geometry)
    limits = static_limits(
        deployment,
        predictor,
        settings.free_memory_bytes,
        settings.gpu_memory_bytes,
        settings.kv_cache_memory_bytes,
        settings.cuda_context_bytes,
    )
    assert limits.transient_headroom_bytes is not None
    return limits.transient_headroom_bytes


def test_the_cuda_context_and_tp_buffers_come_off_the_utilizations_rest() -> None:
    """vLLM 0.32 takes its memory snapshot after the CUDA context and the distributed set-up, so
    both sit outside total x gpu_memory_utilization (kvgate/memory/envelope.py)."""
    rest = int(80 * 2**30 * (1 - 0.9))
    tp1 = flags_mode_headroom()
    assert tp1 == rest - 500 * 2**20  # the CUDA context, --cuda-context-bytes' default
    assert flags_mode_headroom("--cuda-context-bytes", str(300 * 2**20)) == rest - 300 * 2**20
    # TP 2: NCCL (128 MiB, assumed) + symmetric memory (64 MiB) + custom all-reduce (meta 1 + 8,
    # buffer 16, rank data 8, MNNVL 6 x 16 MiB) per GPU
    tp2 = flags_mode_headroom("--tensor-parallel-size", "2")
    assert tp1 - tp2 == (128 + 64 + 9 + 16 + 8 + 96) * 2**20
    # vLLM 0.10 allocated the communicators before its snapshot: inside the envelope then
    assert flags_mode_headroom("--tensor-parallel-size", "2", "--vllm-version", "0.10.1") == tp1
