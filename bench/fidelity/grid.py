"""The fidelity grid: which requests the probe runs, and how each term is read from its scopes.

Each term is measured *differentially*: the request with the feature against the same request
without it (the `baseline` case: same rows, same prompt, greedy, nothing else), in the vLLM
scope that holds the term. Plain data: the probe side (vLLM's venv) never imports this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

FULL_VOCAB_TOP_K = 128_000  # top-k below the vocabulary forces the sort, like vLLM's profile
SORT = {"temperature": 1.0, "top_p": 0.9, "top_k": FULL_VOCAB_TOP_K}
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}
MAX_NUM_BATCHED_TOKENS = 1024  # the probe engine's step budget


@dataclass(frozen=True)
class Case:
    """One ``LLM.generate`` of `rows` distinct prompts of `prompt_len` token ids."""

    term: str  # what it measures: see measured_bytes
    rows: int
    prompt_len: int
    params: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None  # default: enough for every row to decode in one batch
    label: str = ""  # the grid point, as the table shows it
    base: dict[str, Any] | None = None  # the baseline's sampling parameters when not greedy
    transfers: bool = True  # False: the CPU takes a code path CUDA does not, shown but not judged

    @property
    def id(self) -> str:
        return f"{self.term}[{self.label}]"

    @property
    def baseline(self) -> Case:
        """The same request without the feature: greedy, or `base` (then the sort case)."""
        if self.base is not None:
            return Case(
                "sort", self.rows, self.prompt_len, self.base, self.max_tokens, f"rows={self.rows} top-p 0.9 + top-k"
            )
        return Case(
            "logits",
            self.rows,
            self.prompt_len,
            {"temperature": 0.0},
            self.max_tokens,
            f"rows={self.rows} prompt={self.prompt_len}",
        )

    @property
    def output_tokens(self) -> int:
        """The prompts prefill over several steps when they exceed one step's token budget, and
        the first rows keep decoding meanwhile (their decode tokens take some of each step's
        budget): with four tokens more than the prompts' steps, every row is in the batch
        together for at least one step."""
        if self.max_tokens is not None:
            return self.max_tokens
        return 4 + math.ceil(self.rows * self.prompt_len / MAX_NUM_BATCHED_TOKENS)

    def spec(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "rows": self.rows,
            "prompt_len": self.prompt_len,
            "max_tokens": self.output_tokens,
            "params": self.params,
        }


def _scope(scopes: dict[str, dict[str, int]], name: str, key: str) -> int:
    return scopes.get(name, {}).get(key, 0)


def measured_bytes(case: Case, scopes: dict[str, dict[str, int]], base: dict[str, dict[str, int]]) -> int:
    """The bytes vLLM's code allocated for `case.term`, from the probe's scopes for the case and
    its baseline (peak: highest above the scope's entry; net: what the scope left alive).

    - logits: ``compute_logits``' output (model dtype) + the sampler's peak of a greedy batch
      (its fp32 copy); also for n > 1 and the sort, the logits are counted with the sort.
    - sort / logprobs / penalties: the sampler's peak minus the baseline's.
    - prompt_ids: what ``_make_prompt_token_ids_cpu_tensor`` leaves alive (one copy).
    - prompt_logprobs: ``_get_prompt_logprobs_dict``'s peak minus its host buffer
      (``LogprobsTensors.empty_cpu``, pinned host memory on CUDA, not GPU memory).
    """
    sampler = _scope(scopes, "sampler", "peak")
    if case.term == "logits":
        return _scope(scopes, "compute_logits", "net") + sampler
    if case.term == "n":
        return _scope(scopes, "compute_logits", "net") + sampler
    if case.term in ("sort", "logprobs", "penalties", "logits_fp32"):
        return sampler - _scope(base, "sampler", "peak")
    if case.term == "prompt_ids":
        return _scope(scopes, "prompt_ids", "net")
    if case.term == "prompt_logprobs":
        return _scope(scopes, "prompt_logprobs", "peak") - _scope(scopes, "prompt_logprobs_host", "net")
    raise ValueError(f"unknown term {case.term!r}")


def _sampler_cases(rows: int, prompt_len: int) -> list[Case]:
    at = f"rows={rows}"
    return [
        Case("logits", rows, prompt_len, {"temperature": 0.0}, label=f"rows={rows} prompt={prompt_len}"),
        Case("sort", rows, prompt_len, SORT, label=f"{at} top-p 0.9 + top-k"),
        Case("sort", rows, prompt_len, {"temperature": 1.0, "top_p": 0.9}, label=f"{at} top-p 0.9"),
        Case("logprobs", rows, prompt_len, {"temperature": 0.0, "logprobs": 5}, label=f"{at} logprobs=5 greedy"),
        Case("logprobs", rows, prompt_len, {"temperature": 0.0, "logprobs": 1}, label=f"{at} logprobs=1 greedy"),
        Case(
            "penalties",
            rows,
            prompt_len,
            {"temperature": 0.0, **PENALTIES},
            label=f"{at} presence+frequency+repetition",
        ),
        Case("prompt_ids", rows, prompt_len, {"temperature": 0.0, **PENALTIES}, label=f"{at} prompt={prompt_len}"),
    ]


def _prompt_logprobs_cases(prompt_lens: tuple[int, ...], ks: tuple[int, ...]) -> list[Case]:
    return [
        Case(
            "prompt_logprobs", 1, p, {"temperature": 0.0, "prompt_logprobs": k}, max_tokens=1, label=f"prompt={p} k={k}"
        )
        for p in prompt_lens
        for k in ks
    ]


def small_grid() -> list[Case]:
    """The test suite's grid: every term once, 8 rows (about a minute on 2 cores)."""
    return [
        *_sampler_cases(8, 32),
        Case("n", 1, 32, {**SORT, "n": 4}, label="n=4 top-p 0.9 + top-k"),
        *_prompt_logprobs_cases((64,), (1, 5, -1)),
    ]


def full_grid() -> list[Case]:
    """`python -m bench.fidelity`: 1-256 rows, n, prompt lengths, prompt_logprobs 1, 5, -1."""
    cases = [c for rows in (1, 16, 64, 256) for c in _sampler_cases(rows, 16)]
    # top-k alone: the CPU takes apply_top_k_only (allow_cpu_sync), CUDA's PyTorch path still sorts
    cases += [
        Case("sort", 64, 16, {"temperature": 1.0, "top_k": 50}, label="rows=64 top-k 50", transfers=False),
        Case("logprobs", 64, 16, {**SORT, "logprobs": 5}, label="rows=64 logprobs=5 + top-p/top-k", base=SORT),
    ]
    cases += [
        Case("prompt_ids", 16, p, {"temperature": 0.0, **PENALTIES}, label=f"rows=16 prompt={p}") for p in (256, 1024)
    ]
    cases += [Case("n", 1, 16, {**SORT, "n": n}, label=f"n={n} top-p 0.9 + top-k") for n in (2, 8, 32)]
    cases += _prompt_logprobs_cases((64, 512, 1024), (1, 5))
    cases += _prompt_logprobs_cases((64, 256), (-1,))
    return cases


def v2_grid() -> list[Case]:
    """`--runner v2` (CUDA only, issue #27): what Model Runner V2 runs differently. The fp32 copy of
    greedy rows with penalties and its absence for temperature 1.0 alone (gpu/sample/states.py,
    penalties.py), logprobs -1 (20 B a logit), and prompt logprobs over steps the prompt fills
    (two 1,024-row sub-chunks; -1 over two steps: the last step's LogprobsTensors.cat)."""
    cases = [
        Case("logits_fp32", 64, 16, {"temperature": 0.0, **PENALTIES}, label="rows=64 greedy + penalties"),
        Case("logits_fp32", 64, 16, {"temperature": 1.0}, label="rows=64 temperature 1.0 alone"),
        Case("logits_fp32", 64, 16, {"temperature": 0.7}, label="rows=64 temperature 0.7"),
        Case("logprobs", 64, 16, {"temperature": 0.0, "logprobs": -1}, label="rows=64 logprobs=-1 greedy"),
        Case("sort", 64, 16, SORT, label="rows=64 top-p 0.9 + top-k"),
    ]
    # the probe's V2 engine steps 4,096 tokens (harness.V2_ENGINE): prompts that fill their steps
    cases += _prompt_logprobs_cases((4096,), (1, 5, -1))
    cases += _prompt_logprobs_cases((8192,), (-1,))
    return cases


def with_baselines(cases: list[Case]) -> list[Case]:
    """The cases plus each one's baseline, each request once, baselines first."""
    seen: dict[str, Case] = {}
    for case in cases:
        seen.setdefault(case.baseline.id, case.baseline)
    for case in cases:
        seen.setdefault(case.id, case)
    return list(seen.values())
