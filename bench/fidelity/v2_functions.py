"""Model Runner V2's prompt logprobs, vLLM's own functions without an engine
(bench/fidelity/v2_probe.py runs vLLM's ``compute_prompt_logprobs_with_chunking`` and
``LogprobsTensors.cat``) beside kvgate's ``v2_prompt_logprobs``, judged in the same band as the V1
harness (never under, at most 15 % over).

- `python -m bench.fidelity --device cpu --runner v2`: on the CPU, the Triton launches stubbed
  (every tensor they write is allocated by vLLM's Python first).
- `python -m bench.fidelity --device cuda --runner v2 --functions`: on a GPU, vLLM's Triton
  kernels run and CUDA's own scratch (torch.topk's sort for ``-1``) is in the measurement. It needs
  vLLM's Python source and its import-time dependencies, not a CUDA build of vLLM: what a GPU
  image without vLLM can run (docs/memory-model.md, "On a GPU").

On a GPU the same run also measures, over logits made before them, V2's sampler logprobs
(``compute_topk_scores`` of decoding rows, SAMPLER_GRID) and V1's PyTorch top-k/top-p sort
(``apply_top_k_top_p_pytorch``, SORT_GRID): vLLM's sampler functions that need no engine.

The rest of V2 (its sampler's fp32 copy, FlashInfer) needs an engine on a GPU:
``python -m bench.fidelity --device cuda --runner v2`` (grid.v2_grid).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.fidelity.harness import BAND, SLACK_BYTES, SLACK_FRACTION, call_probe, probe_env
from kvgate.memory.activation import EngineShape, v2_prompt_logprobs
from kvgate.memory.geometry import ModelGeometry, dtype_bytes
from kvgate.memory.sampler import SamplerCost

PROBE = Path(__file__).resolve().parent / "v2_probe.py"
# On the CPU a smaller vocabulary than the V1 grid's Llama-3 one keeps a -1 case within a few GB of
# this shared machine's memory (every V2 prompt-logprobs term is linear in it); a GPU takes Llama-3's.
VOCAB = {"cpu": 32_768, "cuda": 128_256}
HIDDEN = 64  # the hidden states are the step's input, made before the measurement


@dataclass(frozen=True)
class V2Case:
    """One prompt's prompt logprobs over `steps` (tokens per step), k logprobs a row."""

    steps: tuple[int, ...]
    k: int

    @property
    def id(self) -> str:
        return f"k={self.k} steps={'+'.join(map(str, self.steps))}"

    @property
    def prompt(self) -> int:
        return sum(self.steps)


# One sub-chunk; two alive at once; three (the last a part); two full steps (the earlier one kept,
# LogprobsTensors.cat); -1 the same ways.
GRID = (
    V2Case((1000,), 1),
    V2Case((3000,), 5),
    V2Case((2048,), 20),
    V2Case((2048, 2048), 5),
    V2Case((1024,), -1),
    V2Case((2100,), -1),
    V2Case((1024, 1024), -1),
)
SMALL_GRID = (V2Case((3000,), 5), V2Case((2100,), -1), V2Case((1024, 1024), -1))


@dataclass(frozen=True)
class V2Row:
    case: V2Case
    measured_peak: int  # the last step's peak above what was alive before it
    measured_held: int  # what the earlier steps left on the device
    kvgate_peak: int  # kvgate's prompt_logprobs term
    kvgate_held: int  # kvgate's prompt_logprobs_kept term

    @property
    def in_band(self) -> bool:
        return in_band(self.kvgate_peak, self.measured_peak) and in_band(self.kvgate_held, self.measured_held)


def in_band(ours: int, measured: int) -> bool:
    """Never under (but for 1 KiB + 0.1 %), at most 15 % over."""
    if measured == 0:
        return ours == 0
    slack = SLACK_BYTES + SLACK_FRACTION * measured
    return measured - slack <= ours <= measured * BAND[1]


@dataclass(frozen=True)
class SamplerCase:
    """A decoding batch of `rows` rows asking k logprobs (gpu/sample/sampler.py compute_topk_scores)."""

    rows: int
    k: int

    @property
    def id(self) -> str:
        return f"sampler rows={self.rows} k={self.k}"

    @property
    def what(self) -> str:
        return f"V2 logprobs {self.k} (compute_topk_scores)"


# GPU only: -1 through each of CUDA's sort paths (one row; 2 - 127 rows, the full sort; 128+, the
# segmented one) and a top-20 whose select is all its scratch.
SAMPLER_GRID = (
    SamplerCase(1, -1),
    SamplerCase(16, -1),
    SamplerCase(127, -1),
    SamplerCase(128, -1),
    SamplerCase(1024, -1),
    SamplerCase(16, 20),
    SamplerCase(256, 20),
    SamplerCase(1024, 20),
)


@dataclass(frozen=True)
class SamplerRow:
    case: SamplerCase | SortCase
    measured_peak: int  # the function's peak above the logits made before it
    kvgate: int  # the sampler stage's logprobs + logprobs_topk_sort, or its top-k/top-p sort

    @property
    def in_band(self) -> bool:
        return in_band(self.kvgate, self.measured_peak)


@dataclass(frozen=True)
class SortCase:
    """V1's PyTorch top-k/top-p over `rows` fp32 rows (v1/sample/ops/topk_topp_sampler.py)."""

    rows: int

    @property
    def id(self) -> str:
        return f"v1 sort rows={self.rows}"

    @property
    def what(self) -> str:
        return "V1 top-k 50 + top-p 0.9 (apply_top_k_top_p_pytorch)"


# One row and 128+ (CUDA's segmented sort, 20 B a logit of scratch), 2 - 127 (its full sort, 32 B).
SORT_GRID = (SortCase(1), SortCase(16), SortCase(127), SortCase(128), SortCase(1024))


def kvgate_sort(case: SortCase, vocab: int) -> int:
    """kvgate's V1 top-k/top-p term (the sort: kvgate/memory/sampler.py sort_bytes)."""
    return SamplerCost(vocab, 2, 1024, 8192, "v1", sampler="pytorch").top_k_top_p(case.rows)[0]


def kvgate_sampler_logprobs(case: SamplerCase, dtype: str, vocab: int) -> int:
    """kvgate's V2 sampler stage for the batch asking only logprobs: logprobs + logprobs_topk_sort."""
    cost = SamplerCost(vocab, dtype_bytes(dtype), 1024, 8192, "v2", max_logprobs=max(case.k, 0))
    stage = cost.stage(
        case.rows, True, False, 0, random=False, all_vocab_logprobs=case.k == -1, processing=False, filtered=False
    )
    return stage.logprobs + stage.logprobs_topk_sort


def kvgate_terms(case: V2Case, dtype: str, vocab: int = VOCAB["cpu"], device: str = "cpu") -> tuple[int, int]:
    """kvgate's (prompt_logprobs, prompt_logprobs_kept) for the case, the prompt alone on its steps;
    on a GPU the first with what CUDA's topk sort adds to it (prompt_logprobs_topk_sort), which
    the CPU does not allocate."""
    geometry = ModelGeometry(1, 1, 1, HIDDEN, HIDDEN, HIDDEN, vocab, dtype_bytes(dtype), case.prompt)
    engine = EngineShape(case.prompt, case.steps[0], 256, runner="v2")
    terms = {t.name: t.bytes for t in v2_prompt_logprobs(geometry, engine, case.steps[0], case.prompt, case.k)}
    sort = terms.get("prompt_logprobs_topk_sort", 0) if device == "cuda" else 0
    return terms.get("prompt_logprobs", 0) + sort, terms.get("prompt_logprobs_kept", 0)


def run(
    grid: tuple[V2Case, ...],
    *,
    dtype: str,
    vllm_python: Path,
    scratch: Path,
    device: str = "cpu",
    vocab: int | None = None,
) -> tuple[dict[str, Any], list[V2Row], list[SamplerRow]]:
    """Run the probe in vLLM's interpreter; its result and the rows beside kvgate's terms (the
    sampler's rows on a GPU only)."""
    vocab = vocab or VOCAB[device]
    sampler_grid = SAMPLER_GRID if device == "cuda" else ()
    sort_grid = SORT_GRID if device == "cuda" else ()
    spec = {
        "device": device,
        "dtype": dtype,
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "cases": [{"id": c.id, "steps": list(c.steps), "k": c.k} for c in grid],
        "sampler_cases": [{"id": c.id, "rows": c.rows, "k": c.k} for c in sampler_grid],
        "sort_cases": [{"id": c.id, "rows": c.rows} for c in sort_grid],
    }
    probe = call_probe(PROBE, spec, vllm_python, scratch / "v2probe", probe_env(scratch, device, "v2"))
    by_id = {c["id"]: c for c in probe["cases"]}
    rows = []
    for case in grid:
        peak, held = kvgate_terms(case, dtype, vocab, device)
        rows.append(V2Row(case, by_id[case.id]["peak"], by_id[case.id]["held"], peak, held))
    sampled = {c["id"]: c for c in probe.get("sampler_cases", [])}
    sampler_rows = [
        SamplerRow(case, sampled[case.id]["peak"], kvgate_sampler_logprobs(case, dtype, vocab)) for case in sampler_grid
    ]
    sorted_ = {c["id"]: c for c in probe.get("sort_cases", [])}
    sampler_rows += [SamplerRow(case, sorted_[case.id]["peak"], kvgate_sort(case, vocab)) for case in sort_grid]
    return probe, rows, sampler_rows


def table(rows: list[V2Row]) -> str:
    lines = [
        "| prompt logprobs | steps | measured last-step peak B | kvgate prompt_logprobs (+ topk sort on a GPU) B | ratio | "
        "measured kept B | kvgate prompt_logprobs_kept B | in band |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = r.kvgate_peak / r.measured_peak if r.measured_peak else float("inf")
        lines.append(
            f"| {r.case.k} | {' + '.join(map(str, r.case.steps))} | {r.measured_peak:,} | {r.kvgate_peak:,} | "
            f"{ratio:.3f} | {r.measured_held:,} | {r.kvgate_held:,} | {'yes' if r.in_band else '**no**'} |"
        )
    return "\n".join(lines)


def sampler_table(rows: list[SamplerRow]) -> str:
    lines = [
        "| sampler function | rows | measured peak B | kvgate B | ratio | in band |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = r.kvgate / r.measured_peak if r.measured_peak else float("inf")
        lines.append(
            f"| {r.case.what} | {r.case.rows} | {r.measured_peak:,} | {r.kvgate:,} | {ratio:.3f} | "
            f"{'yes' if r.in_band else '**no**'} |"
        )
    return "\n".join(lines)


_HOW = {
    "cpu": "their Triton launches stubbed (every tensor they write is allocated by vLLM's Python first); "
    "logits_fn returns the [rows, V] logits the lm_head makes. Not shown on the CPU: CUDA's scratch "
    "inside torch.topk (its sort for k > 4,096, so -1), which a GPU run measures.",
    "cuda": "their Triton kernels run; a scope's peak is torch.cuda.max_memory_allocated() above its "
    "entry, CUDA's topk scratch included; logits_fn returns the [rows, V] logits the lm_head makes.",
}


def report(
    grid: tuple[V2Case, ...], *, dtype: str, vllm_python: Path, device: str = "cpu", vocab: int | None = None
) -> tuple[str, dict[str, Any], list[V2Row], list[SamplerRow]]:
    """The markdown text, the probe's result and the rows."""
    vocab = vocab or VOCAB[device]
    with tempfile.TemporaryDirectory(prefix="kvgate-fidelity-v2-") as tmp:
        probe, rows, sampler_rows = run(
            grid, dtype=dtype, vllm_python=vllm_python, scratch=Path(tmp), device=device, vocab=vocab
        )
    inside = sum(r.in_band for r in rows)
    text = (
        f"vLLM {probe['vllm_version']} (Model Runner V2's prompt_logprob.py, the same file in 0.33.0; "
        f"CHUNK_SIZE {probe['chunk_size']}), torch {probe['torch_version']}, {probe['device_name']}; "
        f"vocabulary {vocab:,}, {dtype}. vLLM's compute_prompt_logprobs_with_chunking and "
        f"LogprobsTensors.cat run as written, {_HOW[device]}\n\n"
        f"{table(rows)}\n\n{inside} of {len(rows)} grid points within {BAND[0]:.2f}-{BAND[1]:.2f} "
        "(never under but for 1 KiB + 0.1 %).\n"
    )
    if sampler_rows:
        text += (
            "\nThe sampler of a decoding batch, over [rows, V] logits made before it: V2's logprobs, vLLM's "
            "compute_topk_scores (gpu/sample/logprob.py, as gpu/sample/sampler.py calls it without "
            "logprob_token_ids), beside kvgate's V2 sampler stage for the batch (logprobs + logprobs_topk_sort); "
            "V1's PyTorch top-k/top-p over fp32 logits (v1/sample/ops/topk_topp_sampler.py "
            "apply_top_k_top_p_pytorch), beside kvgate's top-k/top-p term (the sort):\n\n"
            f"{sampler_table(sampler_rows)}\n\n{sum(r.in_band for r in sampler_rows)} of {len(sampler_rows)} "
            f"within {BAND[0]:.2f}-{BAND[1]:.2f}.\n"
        )
    return text, probe, rows, sampler_rows
