"""The measuring side of the fidelity harness: runs inside vLLM's own venv, in one process.

`python bench/fidelity/probe.py SPEC.json OUT.json` starts vLLM's engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the model runner, sampler and prompt-logprobs code run in
this interpreter), wraps the vLLM functions that hold each memory term in named *scopes*, runs
each case of the spec as one ``LLM.generate`` and records, per scope, the largest peak above the
memory alive at the scope's entry and the largest net growth (what the scope leaves alive).

How memory is read:
- ``cpu``: ``torch.profiler.profile(profile_memory=True)`` records every CPU tensor allocation and
  free with a timestamp; each scope is a ``record_function`` range on the same clock, and the
  live-bytes curve is replayed over it. The CPU allocator has no peak counter of its own and
  does not cache, so the curve is the tensors' bytes exactly, with no allocator rounding.
- ``cuda``: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` with
  ``reset_peak_memory_stats`` at every scope entry and exit (nested scopes fold the peak they saw
  into the scopes around them). Pinned host buffers are not GPU memory and are not counted.

Only the vLLM side lives here (torch and vLLM are imported); kvgate's side (bench/fidelity/
__main__.py) writes the spec, reads the result and sets it beside kvgate's estimate.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch

# Scope name -> (module, attribute path) per runner. Missing attributes are reported, not fatal:
# a newer vLLM may move them.
SCOPES: dict[str, dict[str, tuple[str, str]]] = {
    "v1": {
        "compute_logits": ("vllm.model_executor.models.llama", "LlamaForCausalLM.compute_logits"),
        "sampler": ("vllm.v1.sample.sampler", "Sampler.forward"),
        "prompt_logprobs": ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._get_prompt_logprobs_dict"),
        "prompt_logprobs_host": ("vllm.v1.outputs", "LogprobsTensors.empty_cpu"),
        "prompt_ids": ("vllm.v1.worker.gpu_input_batch", "InputBatch._make_prompt_token_ids_cpu_tensor"),
    },
    "v2": {
        "compute_logits": ("vllm.model_executor.models.llama", "LlamaForCausalLM.compute_logits"),
        "sampler": ("vllm.v1.worker.gpu.sample.sampler", "Sampler.__call__"),
        "prompt_logprobs": ("vllm.v1.worker.gpu.sample.prompt_logprob", "PromptLogprobsWorker.compute_prompt_logprobs"),
        "prompt_logprobs_host": ("vllm.v1.outputs", "LogprobsTensors.empty_cpu"),
    },
}


class CudaScopes:
    """Per-scope peak and net bytes from torch.cuda's allocator statistics."""

    def __init__(self) -> None:
        self.open: list[list[Any]] = []  # [name, bytes at entry, highest seen]
        self.records: list[tuple[str, int, int]] = []  # (name, peak above entry, net)

    def _fold_peak(self) -> None:
        torch.cuda.synchronize()
        high = torch.cuda.max_memory_allocated()
        for frame in self.open:
            frame[2] = max(frame[2], high)

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self._fold_peak()
        now = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        frame = [name, now, now]
        self.open.append(frame)
        try:
            yield
        finally:
            self._fold_peak()
            self.open.pop()  # scopes nest: this frame is the innermost
            self.records.append((name, frame[2] - frame[1], torch.cuda.memory_allocated() - frame[1]))

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self.records = []
        yield

    def results(self) -> list[tuple[str, int, int]]:
        return self.records


class CpuScopes:
    """Per-scope peak and net bytes replayed from the profiler's allocation events."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.profiler: torch.profiler.profile | None = None

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(name):
            yield

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            yield
        self.profiler = prof

    def results(self) -> list[tuple[str, int, int]]:
        events = self.profiler.profiler.kineto_results.events()
        memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        times = [t for t, _ in memory]
        live = list(itertools.accumulate(n for _, n in memory))
        out = []
        for e in events:
            if e.name() not in self.names:
                continue
            first, last = bisect.bisect_left(times, e.start_ns()), bisect.bisect_right(times, e.end_ns())
            entry = live[first - 1] if first else 0
            peak = max(live[first:last], default=entry)
            out.append((e.name(), peak - entry, (live[last - 1] if last else 0) - entry))
        return out


def install_scopes(runner: str, tracker: CudaScopes | CpuScopes) -> dict[str, str]:
    """Wrap each scope's vLLM function; returns the scopes that could not be found and why."""
    import importlib

    missing = {}
    for name, (module_name, path) in SCOPES[runner].items():
        owner_name, attr = path.rsplit(".", 1)
        try:
            owner = getattr(importlib.import_module(module_name), owner_name)
            raw = owner.__dict__[attr]
        except (ImportError, AttributeError, KeyError) as exc:
            missing[name] = f"{module_name}.{path}: {exc!r}"
            continue
        is_static = isinstance(raw, staticmethod)
        original: Callable[..., Any] = raw.__func__ if is_static else raw

        def wrapper(*args: Any, _original: Callable[..., Any] = original, _name: str = name, **kwargs: Any) -> Any:
            with tracker.scope(_name):
                return _original(*args, **kwargs)

        functools.update_wrapper(wrapper, original)
        setattr(owner, attr, staticmethod(wrapper) if is_static else wrapper)
    return missing


def emulate_cuda_repetition_penalty() -> None:
    """On CUDA, ``vllm._custom_ops.apply_repetition_penalties`` is a kernel that works in place
    (no allocation); on CPU vLLM falls back to ``apply_repetition_penalties_torch``, which builds
    four ``[rows, V]`` temporaries CUDA never has. Swap in an in-place equivalent over vocabulary
    slices of 1,024 columns, so the CPU run allocates what the CUDA run does (to within
    rows x 1,024 x ~10 B)."""
    import vllm._custom_ops as ops

    def in_place(
        logits: torch.Tensor, prompt_mask: torch.Tensor, output_mask: torch.Tensor, repetition_penalties: torch.Tensor
    ) -> None:
        penalty = repetition_penalties.unsqueeze(1)
        for start in range(0, logits.shape[1], 1024):
            cols = slice(start, start + 1024)
            seen = prompt_mask[:, cols] | output_mask[:, cols]
            block = logits[:, cols]
            scale = torch.where(block > 0, 1.0 / penalty, penalty)
            block.mul_(torch.where(seen, scale, 1.0))

    ops.apply_repetition_penalties = in_place


def prompts(rows: int, length: int, seed: int) -> list[dict[str, list[int]]]:
    """Distinct random prompts (no shared prefix), as token ids: ids 4+ are ordinary words."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(4, 100_000) for _ in range(length)]} for _ in range(rows)]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    device, runner = spec["device"], spec["runner"]
    tracker: CudaScopes | CpuScopes = CudaScopes() if device == "cuda" else CpuScopes(set(SCOPES[runner]))
    missing = install_scopes(runner, tracker)
    if device == "cpu" and spec.get("emulate_cuda_kernels", True):
        emulate_cuda_repetition_penalty()
    engine = spec["engine"]
    started = time.monotonic()
    llm = LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        seed=0,
        enforce_eager=True,
        max_model_len=engine["max_model_len"],
        max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        max_logprobs=-1,
        enable_prefix_caching=False,
        **({"gpu_memory_utilization": spec["gpu_memory_utilization"]} if device == "cuda" else {}),
    )
    startup_s = time.monotonic() - started
    # Warm-up: torch.compile'd helpers (batched_count_greater_than) compile on first use.
    llm.generate(
        prompts(2, 8, 0), SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=1, detokenize=False), use_tqdm=False
    )
    cases = []
    for case in spec["cases"]:
        params = SamplingParams(max_tokens=case["max_tokens"], ignore_eos=True, detokenize=False, **case["params"])
        batch = prompts(case["rows"], case["prompt_len"], seed=len(cases) + 1)
        started = time.monotonic()
        with tracker.recording():
            llm.generate(batch, params, use_tqdm=False)
        scopes: dict[str, dict[str, int]] = {}
        for name, peak, net in tracker.results():
            s = scopes.setdefault(name, {"peak": 0, "net": 0, "calls": 0})
            s["peak"], s["net"], s["calls"] = max(s["peak"], peak), max(s["net"], net), s["calls"] + 1
        cases.append({"id": case["id"], "scopes": scopes, "seconds": round(time.monotonic() - started, 2)})
        print(f"probe: {case['id']}: {json.dumps(scopes)}", file=sys.stderr, flush=True)
    import vllm

    return {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "runner": runner,
        "missing_scopes": missing,
        "startup_s": round(startup_s, 1),
        "cases": cases,
    }


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    if spec["device"] == "cuda":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if spec["runner"] == "v2" else "0"
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.fidelity.model import build_model

    spec["model_dir"] = str(build_model(Path(spec["model_dir"])))
    Path(argv[2]).write_text(json.dumps(run(spec), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
