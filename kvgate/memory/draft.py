"""The draft model of speculative decoding, as its memory needs it.

vLLM 0.32.0 loads the draft's attention layers into the same ``static_forward_context`` as the
target's, so ``get_kv_cache_spec`` (V1 ``v1/worker/gpu_model_runner.py``; V2
``v1/worker/gpu/model_runner.py``, which names them ``speculator.draft_attn_layer_names``) returns
them beside the target's and ``v1/core/kv_cache_utils.py`` ``get_kv_cache_groups`` puts them in
the pool: full attention of the target's page size joins the target's group; a draft of another
width makes a ``UniformTypeKVCacheSpecs`` group whose page is the sum of every layer's page. Either
way one pool block holds the draft's pages too, so the pool has fewer blocks and a request takes
as many. ``SpeculativeConfig.uses_draft_kv_cache`` (config/speculative.py): EAGLE, EAGLE-3, MTP,
DFlash, DSpark and draft models; ngram and suffix decoding have no draft model.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.memory.geometry import ModelGeometry


@dataclass(frozen=True)
class Drafter:
    """The draft of ``--speculative-config``: its shape, the attention layers it adds to the KV
    cache, the vocabulary its logits span and where kvgate learned all that."""

    method: str  # vLLM's resolved method: eagle, eagle3, mtp, draft_model, dflash, dspark
    geometry: ModelGeometry  # in the target's dtype (vLLM builds the draft's config with it)
    num_layers: int  # attention layers the draft adds to vLLM's KV cache
    vocab_size: int  # columns of the draft's logits (EAGLE-3: draft_vocab_size)
    basis: str  # "config.json in DIR", or the assumption kvgate made
    aux_hidden_states: int = 0  # EAGLE-3: target layers whose hidden states the draft reads
    probabilistic: bool = False  # draft_sample_method "probabilistic": V1 keeps its probabilities
