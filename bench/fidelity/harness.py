"""The kvgate side of the fidelity harness: run the probe in vLLM's venv, set each measurement
beside kvgate's V1 estimate, and judge it against the band (never under, at most 15 % over).

The CLI is bench/fidelity/__main__.py; tests/integration/test_fidelity_vllm.py runs the small grid through here.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.fidelity.estimate import CPU_SAMPLER, cpu_only_bytes, cuda_only_bytes, kvgate_bytes
from bench.fidelity.grid import MAX_NUM_BATCHED_TOKENS, Case, measured_bytes, with_baselines
from kvgate.memory.activation import EngineShape
from kvgate.memory.geometry import ModelGeometry, dtype_bytes
from kvgate.memory.vllm_runner import resolve_sampler
from kvgate.model_folder import load_geometry

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
PROBE = Path(__file__).resolve().parent / "probe.py"
DEFAULT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
BAND = (1.0, 1.15)
# Allocations that do not scale with the vocabulary (sampled ids, per-row parameters, the
# [rows, k + 1] top logprobs) are not modelled; "never under" allows them: 1 KiB + 0.1 %.
SLACK_BYTES = 1024
SLACK_FRACTION = 0.001
ENGINE = EngineShape(max_model_len=4096, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=256)
# Model Runner V2's probe engine: a 4,096-token step, so that one step's prompt logprobs hold two
# 1,024-row sub-chunks at once and an 8,192-token prompt spans two full steps (grid.v2_grid).
V2_ENGINE = replace(ENGINE, max_model_len=16384, max_num_batched_tokens=4 * MAX_NUM_BATCHED_TOKENS, runner="v2")


def engine_for(runner: str) -> EngineShape:
    return V2_ENGINE if runner == "v2" else ENGINE


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    case: Case
    measured: int  # what vLLM's code allocated on this device
    cpu_only: int  # of which the CPU run alone allocates (0 on CUDA)
    estimate: int  # kvgate's V1 charge
    sampled_rows: int  # rows of the largest logits the step computed (0 for prompt terms)
    cuda_only: int = 0  # of the estimate, what only CUDA allocates (its sort scratch; 0 on CUDA)

    @property
    def rows_together(self) -> bool:
        """Every row the estimate counts was in one step's batch (else the grid point is wrong)."""
        if self.case.term in ("prompt_logprobs", "prompt_ids"):
            return True
        return self.sampled_rows == self.case.rows * self.case.params.get("n", 1)

    @property
    def transferable(self) -> int:
        """The measurement as the CUDA run of the same code would allocate it."""
        return self.measured - self.cpu_only

    @property
    def judged_estimate(self) -> int:
        """The estimate as the run's device can show it."""
        return self.estimate - self.cuda_only

    @property
    def ratio(self) -> float:
        if self.transferable <= 0:  # nothing allocated (V2's temperature 1.0 alone): 0 is exact
            return 1.0 if self.judged_estimate == 0 else float("inf")
        return self.judged_estimate / self.transferable

    @property
    def in_band(self) -> bool:
        """Never under (but for the per-row bookkeeping kvgate does not model), at most 15 % over."""
        slack = SLACK_BYTES + SLACK_FRACTION * self.transferable
        return self.judged_estimate >= self.transferable - slack and self.ratio <= BAND[1]


def probe_env(scratch: Path, device: str, runner: str, cache: Path | None = None) -> dict[str, str]:
    """In-process engine, offline, every cache in scratch (the suite's vLLM settings); VLLM_CACHE_ROOT
    in `cache` where given (the test session's, tests/support/vllm_server.py `running_vllm`)."""
    for name in ("cache", "inductor", "tmp"):
        (scratch / name).mkdir(parents=True, exist_ok=True)
    env = os.environ | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": str(cache or scratch / "cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
        "TMPDIR": str(scratch / "tmp"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_USE_V2_MODEL_RUNNER": "1" if runner == "v2" else "0",
    }
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


def run_probe(
    cases: list[Case],
    *,
    device: str,
    runner: str,
    dtype: str,
    model_dir: Path,
    vllm_python: Path,
    scratch: Path,
    gpu_memory_utilization: float = 0.5,
    cache: Path | None = None,
) -> dict[str, Any]:
    """Run the probe in vLLM's interpreter; its result (see probe.py) keyed by case id. `cache`:
    VLLM_CACHE_ROOT (see probe_env)."""
    spec = {
        "device": device,
        "runner": runner,
        "dtype": dtype,
        "model_dir": str(model_dir),
        "gpu_memory_utilization": gpu_memory_utilization,
        "engine": {
            "max_model_len": engine_for(runner).max_model_len,
            "max_num_seqs": engine_for(runner).max_num_seqs,
            "max_num_batched_tokens": engine_for(runner).max_num_batched_tokens,
        },
        "cases": [c.spec() for c in with_baselines(cases)],
    }
    result = call_probe(PROBE, spec, vllm_python, scratch / "probe", probe_env(scratch, device, runner, cache))
    result["by_id"] = {c["id"]: c["scopes"] for c in result["cases"]}
    return result


def call_probe(probe: Path, spec: dict[str, Any], vllm_python: Path, stem: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run `probe` SPEC OUT in vLLM's interpreter (files beside `stem`); its JSON result, or the
    log's tail in the error where it fails."""
    spec_path, out_path, log = stem.with_suffix(".spec.json"), stem.with_suffix(".json"), stem.with_suffix(".log")
    spec_path.write_text(json.dumps(spec, indent=1))
    with log.open("w") as sink:
        proc = subprocess.run(
            [str(vllm_python), str(probe), str(spec_path), str(out_path)],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{probe.name} exited with {proc.returncode}:\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def geometry_of(model_dir: Path, dtype: str) -> ModelGeometry:
    """The probe model's geometry, in the dtype vLLM ran it in (--dtype overrides config.json)."""
    return replace(load_geometry(model_dir), dtype_bytes=dtype_bytes(dtype))


def compare(cases: list[Case], probe: dict[str, Any], geometry: ModelGeometry) -> list[Row]:
    """Each case's measurement beside kvgate's estimate."""
    by_id, on_cpu = probe["by_id"], probe["device"] == "cpu"
    # vllm-cpu sorts (no Triton, no FlashInfer); on CUDA, vLLM's rule for the version and runner it ran.
    runner = probe.get("runner", "v1")
    sampler = CPU_SAMPLER if on_cpu else resolve_sampler(probe["vllm_version"], runner=runner)
    engine = replace(engine_for(runner), sampler=sampler.backend)
    logits_row = geometry.vocab_size * geometry.dtype_bytes
    return [
        Row(
            case,
            measured_bytes(case, by_id[case.id], by_id[case.baseline.id]),
            cpu_only_bytes(case, geometry) if on_cpu else 0,
            kvgate_bytes(case, geometry, engine, sampler),
            by_id[case.id].get("compute_logits", {}).get("net", 0) // logits_row
            if case.term != "prompt_logprobs"
            else 0,
            cuda_only_bytes(case, geometry, engine) if on_cpu else 0,
        )
        for case in cases
    ]


def table(rows: list[Row], geometry: ModelGeometry) -> str:
    """Markdown: term, grid point, measured, CPU-only, kvgate, CUDA-only, ratio, per-element bytes."""
    lines = [
        "| term | grid point | measured peak B | CPU-only B | kvgate V1 B | CUDA-only B | ratio | "
        "B per logit (measured / kvgate) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        elements = _elements(r.case, geometry)
        flag = "" if r.in_band or not r.case.transfers else " **out of band**"
        if not r.case.transfers:
            flag += " (CPU-only path, not judged)"
        if not r.rows_together:
            flag += f" (only {r.sampled_rows} rows in one step)"
        lines.append(
            f"| {r.case.term} | {r.case.label} | {r.measured:,} | {r.cpu_only:,} | {r.estimate:,} | {r.cuda_only:,} | "
            f"{r.ratio:.3f}{flag} | {r.transferable / elements:.2f} / {r.judged_estimate / elements:.2f} |"
        )
    return "\n".join(lines)


def _elements(case: Case, geometry: ModelGeometry) -> int:
    """The ``[rows, V]`` (or ``[prompt tokens, V]``) elements a term scales with."""
    if case.term == "prompt_logprobs":
        return max(1, case.prompt_len - 1) * geometry.vocab_size
    if case.term == "prompt_ids":
        return case.rows * case.prompt_len
    return case.rows * case.params.get("n", 1) * geometry.vocab_size
