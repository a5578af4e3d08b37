"""`--speculative-config` -> the draft model kvgate charges (kvgate/memory/draft.py).

The method is resolved the way vLLM 0.32.0 ``config/speculative.py`` ``SpeculativeConfig``
resolves it: an MTP model type is "mtp"; no method with a draft model named "eagle-..." is
"eagle", "...eagle3..." is "eagle3", a draft whose config says ``medusa``/``mlp_speculator``/an
MTP type is that, anything else "draft_model"; MTP without a model drafts with the target's own
``num_nextn_predict_layers``. The draft's shape comes from its config.json (a folder, a hub cache
entry or a cached model id, never downloaded). When kvgate cannot read it, one warning says so and
kvgate assumes, cautiously: one layer shaped like the target's for a draft head (EAGLE, EAGLE-3,
MTP, DFlash, DSpark: vLLM's heads are one or a few such layers), the target's own shape for a
separate draft model (a draft larger than its target would not be used).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from packaging.version import InvalidVersion, Version

from kvgate.memory.draft import Drafter
from kvgate.memory.geometry import ModelGeometry
from kvgate.memory.vllm_runner import release_of
from kvgate.model_folder import ModelFolderError, read_model_config, resolve_model_folder

log = logging.getLogger("kvgate.speculative")

# vllm 0.32.0 config/speculative.py: methods without a draft model, and MTPModelTypes.
NO_DRAFT_MODEL = frozenset({"ngram", "[ngram]", "ngram_gpu", "suffix"})
# Draft heads of MLP layers only (no KV) or of a shape kvgate does not model: no draft KV.
NOT_MODELLED = frozenset({"medusa", "mlp_speculator", "extract_hidden_states", "custom_class"})
HEADS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})
MTP_MODEL_TYPES = frozenset(
    {
        "deepseek_mtp",
        "dots3_note_mtp",
        "mimo_mtp",
        "mimo_v2_mtp",
        "glm4_moe_mtp",
        "glm4_moe_lite_mtp",
        "glm_ocr_mtp",
        "ernie_mtp",
        "nemotron_h_mtp",
        "exaone_moe_mtp",
        "exaone4_5_mtp",
        "qwen3_next_mtp",
        "qwen4_exp_mtp",
        "qwen3_5_mtp",
        "longcat_flash_mtp",
        "bailing_hybrid_v3_mtp",
        "minimax_m3_mtp",
        "bailing_hybrid_mtp",
        "mtp",
        "kimi_k3_mtp",
        "pangu_ultra_moe_mtp",
        "step3p5_mtp",
        "hy_v3_mtp",
        "hy_v4_mtp",
        "gemma4_mtp",
        "inkling_mtp",
        "glm5_next_mtp",
    }
)
# Config keys that count a target's own MTP layers (DeepSeek-V3: num_nextn_predict_layers;
# Qwen3-Next: num_nextn_predict_layers; MiMo: num_nextn_predict_layers).
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
# vllm 0.32.0 model_executor/models/interfaces.py get_eagle3_default_aux_hidden_state_layers:
# EAGLE-3 reads three target layers' hidden states, (2, layers // 2, layers - 3).
EAGLE3_AUX_LAYERS = 3


# vllm 0.33.0 config/speculative.py:74-82 `SpeculativeMethod`: medusa and mlp_speculator are no
# longer methods (0.32.0 :75-76 listed them); a draft whose config says so is a "draft_model".
HEADS_GONE_IN_033 = frozenset({"medusa", "mlp_speculator"})


def resolve_drafter(
    method: str | None,
    model: str | None,
    target: ModelGeometry,
    target_config: dict[str, Any],
    draft_sample_method: str = "greedy",
    release: str | None = None,
) -> Drafter | None:
    """The draft model vLLM runs for this `--speculative-config`, or None when it has none.
    `release`: the vLLM version kvgate models (kvgate/memory/vllm_runner.py), None for older rules."""
    newer = release is not None and _since_033(release)
    if newer and method in HEADS_GONE_IN_033:
        log.warning(
            "--speculative-config method %s: vLLM %s has no such method (config/speculative.py:74-82) and "
            "refuses to start with it; kvgate models no speculative decoding",
            method,
            release,
        )
        return None
    drafter = _drafter(method, model, target, target_config, newer)
    if drafter is None or draft_sample_method != "probabilistic":
        return drafter
    return replace(drafter, probabilistic=True)


def _since_033(release: str) -> bool:
    """`release` (a pre-release counts as its release) follows 0.33.0's methods; a version that
    is no version number is modelled as the newest known release, as resolve_runtime does."""
    try:
        return release_of(release) >= Version("0.33.0")
    except InvalidVersion:
        return True


def _drafter(
    method: str | None, model: str | None, target: ModelGeometry, target_config: dict[str, Any], since_033: bool
) -> Drafter | None:
    if method is None and model is None:
        return None
    config = _draft_config(model) if model else None
    method = _method(method, model, config, since_033)
    if method in NO_DRAFT_MODEL:
        return None
    if method in NOT_MODELLED:
        log.warning(
            "--speculative-config method %s: kvgate does not model its draft's memory (only the target's "
            "1 + num_speculative_tokens verified rows)",
            method,
        )
        return None
    if method == "mtp" and (model is None or config is None):
        layers = next((int(target_config[k]) for k in MTP_LAYER_KEYS if target_config.get(k)), 1)
        return Drafter("mtp", target, layers, target.vocab_size, "the target's own MTP layers")
    if config is None:
        return _assumed(method, model, target)
    geometry = replace(ModelGeometry.from_config(config), dtype_bytes=target.dtype_bytes)
    vocab = int(config.get("draft_vocab_size") or geometry.vocab_size)
    aux = EAGLE3_AUX_LAYERS if method == "eagle3" else 0
    return Drafter(method, geometry, geometry.num_layers, vocab, f"config.json of {model}", aux)


def _method(method: str | None, model: str | None, config: dict[str, Any] | None, since_033: bool = False) -> str:
    """vLLM's method for this config (SpeculativeConfig.__post_init__; 0.33.0 :1440-1480 no
    longer turns a medusa or mlp_speculator config into its own method)."""
    if method in MTP_MODEL_TYPES:
        return "mtp"
    if method is not None:
        return method
    name = (model or "").lower()
    if name in ("ngram", "[ngram]"):
        return "ngram"
    if "eagle-" in name:
        return "eagle"
    if "eagle3" in name:
        return "eagle3"
    model_type = (config or {}).get("model_type")
    if model_type in HEADS_GONE_IN_033 and not since_033:
        return str(model_type)
    if model_type in MTP_MODEL_TYPES:
        return "mtp"
    return "draft_model"


def _draft_config(model: str) -> dict[str, Any] | None:
    try:
        return read_model_config(resolve_model_folder(model))
    except (ModelFolderError, OSError, ValueError):
        return None


def _assumed(method: str, model: str | None, target: ModelGeometry) -> Drafter:
    """The cautious stand-in for a draft whose config.json kvgate cannot read."""
    if method == "draft_model":
        layers, what = target.num_layers, f"the target's shape ({target.num_layers} layers)"
    else:
        layers, what = 1, "one layer shaped like the target's"
    log.warning(
        "--speculative-config: cannot read the config.json of the draft model %r (not a folder, hub cache "
        "entry or cached model id): kvgate assumes %s for its KV cache and activations; give the "
        "draft's folder to be exact",
        model,
        what,
    )
    aux = EAGLE3_AUX_LAYERS if method == "eagle3" else 0
    return Drafter(method, target, layers, target.vocab_size, f"assumed: {what}", aux)
