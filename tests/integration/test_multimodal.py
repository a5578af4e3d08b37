"""Images in chat messages: counted for Llava as vLLM expands them, refused (400) for other models
and other media, in both tokenizer modes (local and the backend's /tokenize)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import httpx
import pytest

from kvgate.chat_template import TokenizationError
from kvgate.image_rules import CanvasTiles, PatchRows, SplitTiles, image_tokens
from kvgate.media import ImageSize
from kvgate.multimodal import image_kwargs, replace_token_matches
from kvgate.request import ChatInput
from kvgate.tokens import load_tokenizer
from support.vllm_server import VllmPython

# llava-hf/llava-1.5-7b-hf's config.json, the fields vLLM's Llava processing reads.
LLAVA_15 = {
    "model_type": "llava",
    "architectures": ["LlavaForConditionalGeneration"],
    "image_token_index": 32000,
    "vision_feature_select_strategy": "default",
    "vision_config": {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14},
}
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
OTHER_IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/dog.png"}}


def test_llava_images_take_vllms_count() -> None:
    # CLIP 336 / 14: a 24 x 24 grid + a class token, which "default" drops: 576 (llava-1.5).
    assert image_tokens(LLAVA_15).per_image == 576
    assert image_tokens({**LLAVA_15, "vision_feature_select_strategy": "full"}).per_image == 577
    assert image_tokens(LLAVA_15).token_id == 32000
    siglip = {**LLAVA_15, "vision_config": {**LLAVA_15["vision_config"], "model_type": "siglip_vision_model"}}
    assert image_tokens(siglip).per_image == 575  # no class token: 576, less one for "default"
    other = {**LLAVA_15, "vision_config": {**LLAVA_15["vision_config"], "model_type": "dinov2"}}
    assert image_tokens(other) is None  # another tower: kvgate does not know its count
    # CLIP's patches must divide its image (vLLM's CLIPEncoderInfo asserts it): no rule, a 400
    assert image_tokens({**LLAVA_15, "vision_config": {**LLAVA_15["vision_config"], "image_size": 340}}) is None
    assert image_tokens({"model_type": "llama"}) is None


def _chat(*parts: object) -> ChatInput:
    return ChatInput(messages=[{"role": "user", "content": list(parts)}])


class TokenizeBackend:
    """A backend /tokenize that counts words and maps "<image>" to the image token."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        ids = []
        for message in body["messages"]:
            for part in message["content"]:
                ids += [32000 if w == "<image>" else 7 for w in part["text"].split()]
        return httpx.Response(200, json={"tokens": ids, "count": len(ids)})


def _backend_tokenizer(folder: Path, backend: TokenizeBackend):
    client = httpx.AsyncClient(transport=httpx.MockTransport(backend), base_url="http://vllm")
    return load_tokenizer(folder, client, "m")


def test_fallback_counts_llava_images_and_never_sends_them(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAVA_15))  # no tokenizer files
    backend = TokenizeBackend()
    tokenizer = _backend_tokenizer(tmp_path, backend)
    assert tokenizer.source == "backend"
    ids = asyncio.run(tokenizer.encode_chat(_chat({"type": "text", "text": "what is this"}, IMAGE, OTHER_IMAGE)))
    assert len(ids) == 3 + 2 * 576
    assert ids[:3] == [7, 7, 7]
    assert 32000 not in ids
    # Each image's tokens stand for that image: the same image twice shares them, two do not.
    assert len(set(ids[3:579])) == 1
    assert ids[3] != ids[579]
    again = asyncio.run(tokenizer.encode_chat(_chat({"type": "text", "text": "what is this"}, IMAGE, IMAGE)))
    assert again[3:579] == again[579:] == ids[3:579]
    assert all("image_url" not in json.dumps(b) for b in backend.bodies)


@pytest.mark.parametrize(
    "part",
    [
        IMAGE,
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
    ],
    ids=["image-on-a-text-model", "audio", "video"],
)
def test_media_kvgate_cannot_count_is_refused_before_any_backend_call(tmp_path: Path, part: dict) -> None:
    config = {"model_type": "llama"} if part is IMAGE else LLAVA_15
    (tmp_path / "config.json").write_text(json.dumps(config))
    backend = TokenizeBackend()
    tokenizer = _backend_tokenizer(tmp_path, backend)
    with pytest.raises(TokenizationError, match=f"cannot count the prompt tokens of a '{part['type']}'"):
        asyncio.run(tokenizer.encode_chat(_chat({"type": "text", "text": "hi"}, part)))
    assert backend.bodies == []


def test_local_tokenizer_counts_llava_images(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The model's own tokenizer, with "<image>" as an added token as Llava's tokenizers have it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tok.save_pretrained(str(tmp_path))
    image_id = tok.convert_tokens_to_ids("<image>")
    (tmp_path / "config.json").write_text(json.dumps({**LLAVA_15, "image_token_index": image_id}))
    client = httpx.AsyncClient(base_url="http://never-called")
    tokenizer = load_tokenizer(tmp_path, client, "m")
    assert tokenizer.source == "local"
    text = {"type": "text", "text": "Describe the picture."}
    plain = asyncio.run(tokenizer.encode_chat(_chat(text)))
    placeholder = asyncio.run(tokenizer.encode_chat(_chat(text, {"type": "text", "text": "<image>"})))
    with_image = asyncio.run(tokenizer.encode_chat(_chat(text, IMAGE)))
    assert len(placeholder) > len(plain)
    assert len(with_image) == len(placeholder) - 1 + 576
    assert image_id not in with_image
    # The tiny Llama's template takes strings: vLLM puts the placeholder in front of the text
    # unless the text holds it already, where the image then goes; one too many is vLLM's 400.
    own = asyncio.run(tokenizer.encode_chat(_chat({"type": "text", "text": "<image>"}, IMAGE)))
    assert len(own) == len(asyncio.run(tokenizer.encode_chat(_chat({"type": "text", "text": "<image>"})))) - 1 + 576
    with pytest.raises(TokenizationError, match="Found more '<image>' placeholders in input prompt"):
        asyncio.run(tokenizer.encode_chat(_chat({"type": "text", "text": "<image> <image>"}, IMAGE)))
    # A template that loops over the parts gets an image part and writes its own text for it
    # (llava-v1.6's: the images first, each with a newline, then the texts).
    template = (
        "{% for m in messages %}{% for c in m['content'] | selectattr('type', 'equalto', 'image') %}"
        "<image>\n{% endfor %}{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}"
        "{{ c['text'] }}{% endfor %}{% endfor %}"
    )
    chat = ChatInput(messages=({"role": "user", "content": [text, IMAGE]},), chat_template=template)
    written = asyncio.run(tokenizer.encode_prompt("<image>\nDescribe the picture.", add_special_tokens=False))
    assert len(asyncio.run(tokenizer.encode_chat(chat))) == len(written) - 1 + 576


_VLLM_FULL_TEXT = """
import json, sys
from vllm.renderers.chat_utils import _get_full_multimodal_text_prompt
from vllm.exceptions import VLLMValidationError
out = []
for placeholders, texts in json.loads(sys.stdin.read()):
    storage = {}
    for p in placeholders:
        storage.setdefault("image" if p == "<image>" else "audio", []).append(p)
    try:
        out.append(_get_full_multimodal_text_prompt(storage, list(texts), False))
    except VLLMValidationError:
        out.append(None)
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_string_templates_get_placeholders_where_vllm_puts_them(vllm_python: VllmPython) -> None:
    """For a template that takes strings, kvgate's renderer puts the media placeholders as vLLM
    0.32.0's _get_full_multimodal_text_prompt does (in front, unless the text holds them; more in
    the text than items: refused), on 300 random messages."""
    from kvgate.chat_template import _full_multimodal_text

    rng = random.Random(11)
    words = ["a", "<image>", "<|audio|>", "b c", "", "<image><image>", "\n"]
    cases = []
    for _ in range(300):
        placeholders = [rng.choice(["<image>", "<|audio|>"]) for _ in range(rng.randint(1, 3))]
        cases.append(
            (placeholders, ["".join(rng.choices(words, k=rng.randint(0, 3))) for _ in range(rng.randint(0, 3))])
        )
    theirs = json.loads(vllm_python("-c", _VLLM_FULL_TEXT, input=json.dumps(cases)).strip().splitlines()[-1])
    ours = []
    for placeholders, texts in cases:
        try:
            ours.append(_full_multimodal_text(placeholders, texts))
        except TokenizationError:
            ours.append(None)
    assert ours == theirs
    assert 0 < ours.count(None) < 150


_VLLM_COUNT = """
import json, sys
from transformers import LlavaConfig
from vllm.model_executor.models.vision import get_num_selected_vision_tokens, get_vision_encoder_info
out = []
for config in json.loads(sys.argv[1]):
    hf = LlavaConfig(**config)
    n = get_vision_encoder_info(hf).get_num_image_tokens(image_width=640, image_height=480)
    out.append(get_num_selected_vision_tokens(n, hf.vision_feature_select_strategy))
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_counts_equal_vllms_own_functions(vllm_python: VllmPython) -> None:
    """vLLM 0.32.0's get_vision_encoder_info (CLIPEncoderInfo or SiglipEncoderInfo) and
    get_num_selected_vision_tokens, run in the vLLM venv."""
    configs = [
        LLAVA_15,
        {**LLAVA_15, "vision_feature_select_strategy": "full"},
        {**LLAVA_15, "vision_config": {**LLAVA_15["vision_config"], "image_size": 224}},
        {**LLAVA_15, "vision_config": {**LLAVA_15["vision_config"], "image_size": 224, "patch_size": 32}},
        # llava-hf/llava-interleave-qwen-7b-hf: SigLIP so400m, 384 / 14 (not a multiple), "full"
        {
            **LLAVA_15,
            "vision_feature_select_strategy": "full",
            "vision_config": {"model_type": "siglip_vision_model", "image_size": 384, "patch_size": 14},
        },
    ]
    theirs = json.loads(vllm_python("-c", _VLLM_COUNT, json.dumps(configs)).strip().splitlines()[-1])
    assert theirs == [image_tokens(c).per_image for c in configs] == [576, 577, 256, 49, 729]


def _sizes() -> list[tuple[int, int]]:
    """Many sizes and aspect ratios: edges of the resize rules and a seeded spread up to 8k."""
    rng = random.Random(23)
    edges = [(1, 1), (27, 27), (28, 28), (29, 57), (56, 56), (640, 480), (480, 640), (1920, 1080), (4000, 3000)]
    edges += [(200, 1), (201, 1), (28, 5600), (5600, 27), (50_000, 300), (3584, 3584), (12_000, 9_000)]
    edges += [(1153, 944), (946, 1156)]  # OneVision: vLLM's "most features" size, and one with more
    # One-pixel and few-pixel strips both ways, sides around the 14 / 16-pixel patches
    edges += [(1, 4000), (4000, 1), (2, 4000), (4000, 2), (1, 20_000), (20_000, 1), (13, 13), (15, 15), (1, 199)]
    edges += [(199, 1), (1, 201), (56, 11_199), (11_199, 56), (7, 1400), (1400, 7), (16, 3200), (3200, 16)]
    spread = [(rng.randint(1, 8192), rng.randint(1, 8192)) for _ in range(150)]
    thin = [(rng.randint(1, 40), rng.randint(100, 8000)) for _ in range(30)]
    return edges + spread + thin


QWEN2_VL_7B = {  # Qwen/Qwen2-VL-7B-Instruct's config.json and preprocessor_config.json, the fields read
    "config": {
        "model_type": "qwen2_vl",
        "image_token_id": 151655,
        "vision_config": {"patch_size": 14, "spatial_merge_size": 2},
    },
    "processor": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2},
}
QWEN2_5_VL = {  # Qwen2.5-VL's preprocessor uses the same keys; its config the 2.5 model_type
    "config": {**QWEN2_VL_7B["config"], "model_type": "qwen2_5_vl"},
    "processor": {"size": {"shortest_edge": 3136, "longest_edge": 12845056}, "patch_size": 14, "merge_size": 2},
}
QWEN3_VL_8B = {  # Qwen/Qwen3-VL-8B-Instruct's config.json and preprocessor_config.json, the fields read
    "config": {
        "model_type": "qwen3_vl",
        "image_token_id": 151655,
        "vision_config": {"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    },
    "processor": {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16, "merge_size": 2},
}
QWEN3_VL_MOE = {  # Qwen/Qwen3-VL-30B-A3B-Instruct: the same processor, the MoE model_type
    "config": {**QWEN3_VL_8B["config"], "model_type": "qwen3_vl_moe"},
    "processor": QWEN3_VL_8B["processor"],
}
GEMMA3_4B = {  # google/gemma-3-4b-it's config.json and preprocessor_config.json, the fields read
    "config": {
        "model_type": "gemma3",
        "image_token_index": 262144,
        "boi_token_index": 255999,
        "mm_tokens_per_image": 256,
    },
    "processor": {"image_seq_length": 256, "do_pan_and_scan": None, "pan_and_scan_max_num_crops": None},
}
MISTRAL_SMALL_31 = {  # mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json and preprocessor_config.json
    "config": {
        "model_type": "mistral3",
        "image_token_index": 10,
        "spatial_merge_size": 2,
        "vision_config": {"model_type": "pixtral", "patch_size": 14, "image_size": 1540},
    },
    "processor": {"size": {"longest_edge": 1540}, "patch_size": 14},
}
PIXTRAL_12B_HF = {  # mistral-community/pixtral-12b (Llava format): the size is vision_config's
    "config": {
        "model_type": "llava",
        "image_token_index": 10,
        "vision_config": {"model_type": "pixtral", "patch_size": 16, "image_size": 1024},
    },
    "processor": {"size": {"longest_edge": 1024}, "patch_size": 16},
}
LLAVA_NEXT_MISTRAL = {  # llava-hf/llava-v1.6-mistral-7b-hf's config.json, the fields read
    "config": {
        "model_type": "llava_next",
        "image_token_index": 32000,
        "vision_feature_select_strategy": "default",
        "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
        "vision_config": {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14},
    },
    "processor": {},
}
LLAVA_ONEVISION_7B = {  # llava-hf/llava-onevision-qwen2-7b-ov-hf's config.json: SigLIP 384/14, anyres_max_9
    "config": {
        "model_type": "llava_onevision",
        "image_token_index": 151646,
        "vision_feature_select_strategy": "full",
        "image_grid_pinpoints": [[384 * a, 384 * b] for a in range(1, 7) for b in range(1, 7)],
        "vision_config": {"model_type": "siglip_vision_model", "image_size": 384, "patch_size": 14},
    },
    "processor": {},
}
LLAMA4_SCOUT = {  # meta-llama/Llama-4-Scout-17B-16E-Instruct's config.json and preprocessor_config.json
    "config": {
        "model_type": "llama4",
        "image_token_index": 200092,
        "vision_config": {"image_size": 336, "patch_size": 14, "pixel_shuffle_ratio": 0.5},
    },
    "processor": {"max_patches": 16, "resize_to_max_canvas": False},
}
INTERNVL3_HF = {  # OpenGVLab/InternVL3-1B-hf: config.json, processor_config.json, preprocessor_config.json
    "config": {"model_type": "internvl", "image_token_id": 151667},
    "processor": {
        "image_seq_length": 256,
        "crop_to_patches": False,
        "size": {"height": 448, "width": 448},
        "min_patches": 1,
        "max_patches": 12,
    },
}
SMOLVLM2 = {  # HuggingFaceTB/SmolVLM2-2.2B-Instruct: config.json, processor_config.json, preprocessor_config.json
    "config": {"model_type": "smolvlm", "image_token_id": 49190},
    "processor": {
        "image_seq_len": 81,
        "size": {"longest_edge": 1536},
        "max_image_size": {"longest_edge": 384},
        "do_image_splitting": True,
    },
}
IDEFICS3_8B = {  # HuggingFaceM4/Idefics3-8B-Llama3
    "config": {"model_type": "idefics3", "image_token_id": 128257},
    "processor": {
        "image_seq_len": 169,
        "size": {"longest_edge": 1456},
        "max_image_size": {"longest_edge": 364},
        "do_image_splitting": True,
    },
}
QWEN2_5_VL_3B = {  # Qwen/Qwen2.5-VL-3B-Instruct's preprocessor_config.json: the flat keys
    "config": QWEN2_5_VL["config"],
    "processor": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2},
}
CASES = [
    {**QWEN2_VL_7B, "cli_kwargs": {}, "request_kwargs": {}},
    {**QWEN2_VL_7B, "cli_kwargs": {"max_pixels": 1003520}, "request_kwargs": {}},
    {
        **QWEN2_VL_7B,
        "cli_kwargs": {"max_pixels": 1003520},
        "request_kwargs": {"max_pixels": 200_704, "min_pixels": 50_176},
    },
    {**QWEN2_VL_7B, "cli_kwargs": {}, "request_kwargs": {"size": {"longest_edge": 313_600}}},
    {
        **QWEN2_VL_7B,
        "cli_kwargs": {"images_kwargs": {"max_pixels": 401_408}},
        "request_kwargs": {"max_pixels": 9_999_999},
    },
    {**QWEN2_5_VL, "cli_kwargs": {}, "request_kwargs": {}},
    {**QWEN2_5_VL, "cli_kwargs": {"min_pixels": 200_000}, "request_kwargs": {"images_kwargs": {"max_pixels": 700_000}}},
    {**QWEN3_VL_8B, "cli_kwargs": {}, "request_kwargs": {}},
    {**QWEN3_VL_8B, "cli_kwargs": {"max_pixels": 1_003_520}, "request_kwargs": {"min_pixels": 200_704}},
    {**QWEN3_VL_MOE, "cli_kwargs": {}, "request_kwargs": {"images_kwargs": {"max_pixels": 802_816}}},
    {**MISTRAL_SMALL_31, "cli_kwargs": {}, "request_kwargs": {}},
    {**MISTRAL_SMALL_31, "cli_kwargs": {"size": {"longest_edge": 1024}}, "request_kwargs": {}},
    {**MISTRAL_SMALL_31, "cli_kwargs": {}, "request_kwargs": {"images_kwargs": {"size": {"longest_edge": 700}}}},
    {**PIXTRAL_12B_HF, "cli_kwargs": {}, "request_kwargs": {"size": {"longest_edge": 512}}},
    {**LLAVA_NEXT_MISTRAL, "cli_kwargs": {}, "request_kwargs": {}},
    {**LLAVA_ONEVISION_7B, "cli_kwargs": {}, "request_kwargs": {}},
    {**LLAMA4_SCOUT, "cli_kwargs": {}, "request_kwargs": {}},
    {**LLAMA4_SCOUT, "cli_kwargs": {"max_patches": 6}, "request_kwargs": {"resize_to_max_canvas": True}},
    {**INTERNVL3_HF, "cli_kwargs": {}, "request_kwargs": {}},
    {**INTERNVL3_HF, "cli_kwargs": {"max_patches": 6}, "request_kwargs": {"min_patches": 2}},
    {**INTERNVL3_HF, "cli_kwargs": {}, "request_kwargs": {"crop_to_patches": False}},
    {**SMOLVLM2, "cli_kwargs": {}, "request_kwargs": {}},
    {
        **SMOLVLM2,
        "cli_kwargs": {"size": {"longest_edge": 768}},
        "request_kwargs": {"max_image_size": {"longest_edge": 256}},
    },
    {**IDEFICS3_8B, "cli_kwargs": {}, "request_kwargs": {"do_image_splitting": False}},
    {**IDEFICS3_8B, "cli_kwargs": {}, "request_kwargs": {}},
    {**GEMMA3_4B, "cli_kwargs": {}, "request_kwargs": {}},
    {**GEMMA3_4B, "cli_kwargs": {"do_pan_and_scan": True}, "request_kwargs": {}},
    {**GEMMA3_4B, "cli_kwargs": {"do_pan_and_scan": True}, "request_kwargs": {"pan_and_scan_max_num_crops": 7}},
    {**GEMMA3_4B, "cli_kwargs": {}, "request_kwargs": {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 100}},
    # processor_config.json's image_seq_length, not config.json's mm_tokens_per_image
    {**GEMMA3_4B, "processor": {"image_seq_length": 64}, "cli_kwargs": {"do_pan_and_scan": True}, "request_kwargs": {}},
    # preprocessor_config.json's pan-and-scan settings are overridden by the processor's defaults
    {
        **GEMMA3_4B,
        "processor": {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 2},
        "cli_kwargs": {},
        "request_kwargs": {},
    },
    # Settings first tried in session 35's audit (bench/results/mmaudit-session35): pixel bounds off
    # the 28 x 28 grid, equal or crossed; other pan-and-scan thresholds; other tile limits and grids
    {**QWEN2_5_VL_3B, "cli_kwargs": {"max_pixels": 1_000_001, "min_pixels": 3_137}, "request_kwargs": {}},
    {**QWEN2_5_VL_3B, "cli_kwargs": {"min_pixels": 401_408, "max_pixels": 401_408}, "request_kwargs": {}},
    {**QWEN2_5_VL_3B, "cli_kwargs": {}, "request_kwargs": {"min_pixels": 802_816, "max_pixels": 200_704}},
    {
        **QWEN2_5_VL_3B,
        "cli_kwargs": {"images_kwargs": {"min_pixels": 100_000}},
        "request_kwargs": {"size": {"longest_edge": 123_457}},
    },
    {**QWEN3_VL_8B, "cli_kwargs": {"size": {"longest_edge": 2_000_000}}, "request_kwargs": {}},
    {
        **QWEN3_VL_8B,
        "processor": {"size": {"shortest_edge": 200_000, "longest_edge": 600_000}, "patch_size": 16, "merge_size": 2},
        "cli_kwargs": {},
        "request_kwargs": {},
    },
    {
        **GEMMA3_4B,
        "cli_kwargs": {"do_pan_and_scan": True, "pan_and_scan_min_ratio_to_activate": 1.0},
        "request_kwargs": {},
    },
    {
        **GEMMA3_4B,
        "cli_kwargs": {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32, "pan_and_scan_max_num_crops": 12},
        "request_kwargs": {},
    },
    {**GEMMA3_4B, "cli_kwargs": {}, "request_kwargs": {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 1}},
    {**GEMMA3_4B, "cli_kwargs": {"do_pan_and_scan": True}, "request_kwargs": {"do_pan_and_scan": False}},
    {**LLAMA4_SCOUT, "cli_kwargs": {"max_patches": 1}, "request_kwargs": {}},
    {
        **LLAMA4_SCOUT,
        "processor": {"max_patches": 9, "resize_to_max_canvas": True},
        "cli_kwargs": {},
        "request_kwargs": {},
    },
    {
        **INTERNVL3_HF,
        "processor": {**INTERNVL3_HF["processor"], "crop_to_patches": True, "max_patches": 24, "min_patches": 3},
        "cli_kwargs": {},
        "request_kwargs": {},
    },
    {**MISTRAL_SMALL_31, "cli_kwargs": {"size": {"longest_edge": 1001}}, "request_kwargs": {}},
    {**MISTRAL_SMALL_31, "cli_kwargs": {"images_kwargs": {"size": {"longest_edge": 14}}}, "request_kwargs": {}},
    {
        **LLAVA_NEXT_MISTRAL,
        "config": {
            **LLAVA_NEXT_MISTRAL["config"],
            "vision_feature_select_strategy": "full",
            "image_grid_pinpoints": [[336, 336], [336, 1344], [1344, 336], [672, 1008]],
        },
        "cli_kwargs": {},
        "request_kwargs": {},
    },
    {
        **LLAVA_ONEVISION_7B,
        "config": {
            **LLAVA_ONEVISION_7B["config"],
            "image_grid_pinpoints": [[384 * a, 384 * b] for a in range(1, 4) for b in range(1, 4)],
        },
        "cli_kwargs": {},
        "request_kwargs": {},
    },
    {**SMOLVLM2, "cli_kwargs": {"do_image_splitting": False}, "request_kwargs": {}},
]


def _kvgate_count(rule, size: ImageSize | None, kwargs: dict) -> int | list[int] | None:
    """The count; for Pixtral's rows the (ncols, nrows) grid the replacement is built from; for
    Llama 4 [features, tokens]."""
    try:
        if isinstance(rule, PatchRows):
            return list(rule.grid(size, kwargs))
        replacement = rule.replacement(size, kwargs)
        if isinstance(rule, SplitTiles):  # the text vLLM tokenizes
            return "".join(text * count for text, count in replacement.runs or ())
        if isinstance(rule, CanvasTiles):
            return [replacement.features, sum(count for _, count in replacement.runs or ())]
        return replacement.features
    except TokenizationError:
        return None


@pytest.mark.vllm
def test_dynamic_and_fixed_counts_equal_vllms_processing_info(vllm_python: VllmPython) -> None:
    """Every family with a rule, on 215 sizes and aspect ratios under 49 settings (config,
    --mm-processor-kwargs, request mm_processor_kwargs, flat and scoped): kvgate's count equals
    vLLM 0.32.0's own (Qwen2VLProcessingInfo, Qwen3VLProcessingInfo, Gemma3ProcessingInfo,
    LlavaNextProcessingInfo and LlavaOnevisionProcessingInfo.get_num_image_tokens; Pixtral's grid
    from Mistral3ProcessingInfo.get_vision_encoder_info or PixtralHFEncoderInfo; InternVL's from
    the HF processor's kwargs and GotOcr2ImageProcessor, which the prompt holds; Idefics3's and
    SmolVLM's replacement text from Idefics3ProcessingInfo.get_image_repl; Llama 4's canvas
    from transformers' get_best_fit as Mllama4MultiModalProcessor calls it, and the tokens of
    Llama4Processor._prompt_split_image), and an image
    kvgate does not see counts vLLM's get_max_image_tokens, except on OneVision, where vLLM's is
    not the most, and InternVL, where vLLM's processing info disagrees with the prompt (kvgate's
    is above every count); where vLLM raises (aspect ratio over 200, a
    Pixtral grid without rows), kvgate refuses."""
    sizes = _sizes()
    cases = [{**case, "processor": {k: v for k, v in case["processor"].items() if v is not None}} for case in CASES]
    script = str(Path(__file__).parents[1] / "support" / "vllm_image_counts.py")
    theirs = json.loads(
        vllm_python(script, input=json.dumps([{**c, "sizes": sizes} for c in cases])).strip().splitlines()[-1]
    )
    refused = 0
    for case, vllm in zip(cases, theirs, strict=True):
        rule = image_tokens(case["config"], case["processor"]).configured(image_kwargs(case["cli_kwargs"], None))
        kwargs = image_kwargs(case["cli_kwargs"], case["request_kwargs"])
        ours = [_kvgate_count(rule, ImageSize(w, h), kwargs) for w, h in sizes]
        assert ours == vllm["counts"], case
        refused += ours.count(None)
        if isinstance(rule, SplitTiles):  # the square's tiles at most
            most = rule.most_features(None, kwargs)
            assert all(c is None or c.count("<image>") <= most for c in vllm["counts"]), case
        if rule.family == "internvl":  # the image and its crops at most: above every count
            largest = _kvgate_count(rule, None, kwargs)
            assert largest >= max(c for c in vllm["counts"] if c is not None), case
        if rule.family == "internvl" and not kwargs and not case["processor"]["crop_to_patches"]:
            # vLLM's own processing info reads the image processor's crop_to_patches (off in this
            # checkpoint's preprocessor_config.json): one patch for every image, which the prompt
            # (the HF processor, crop_to_patches on by its default) does not hold
            assert set(vllm["info"]) == {256}
            assert max(vllm["counts"]) > 256
        if vllm["largest"] is not None:
            largest = _kvgate_count(rule, None, image_kwargs(case["cli_kwargs"], {}))
            if case["config"]["model_type"] == "llava_onevision":
                # vLLM's largest (1153 x 944) is not: kvgate's bound is at least every count
                assert largest >= max(c for c in vllm["counts"] if c is not None) > vllm["largest"]
            else:
                assert largest == vllm["largest"], case
    assert refused > 0  # the aspect-ratio refusals were exercised
    assert len({json.dumps(c) for v in theirs for c in v["counts"]}) > 100  # and many distinct counts


_VLLM_MERGES = """
import json, sys
from vllm.multimodal.processing.processor import replace_token_matches
out = []
for ids in json.loads(sys.stdin.read()):
    for match, new in ([1, 2], [3]), ([2, 1], [3]), ([2, 2], [4]):
        ids = replace_token_matches(ids, match, new)
    out.append(ids)
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_newline_joins_equal_vllms_replace_token_matches(vllm_python: VllmPython) -> None:
    """Gemma 3's three joins ("\\n" "\\n\\n" -> "\\n\\n\\n", "\\n\\n" "\\n" -> "\\n\\n\\n", "\\n\\n" "\\n\\n"
    -> "\\n\\n\\n\\n": ids 1, 2, 3, 4 here) applied in order by kvgate equal vLLM 0.32.0's
    replace_token_matches on 300 random runs of newline tokens and others."""
    rng = random.Random(5)
    runs = [[rng.choice([1, 2, 2, 3, 7]) for _ in range(rng.randint(0, 40))] for _ in range(300)]
    theirs = json.loads(vllm_python("-c", _VLLM_MERGES, input=json.dumps(runs)).strip().splitlines()[-1])
    ours = []
    for ids in runs:
        for match, new in ([1, 2], [3]), ([2, 1], [3]), ([2, 2], [4]):
            ids = replace_token_matches(ids, match, new)
        ours.append(ids)
    assert ours == theirs
    assert sum(len(a) != len(b) for a, b in zip(runs, ours, strict=True)) > 100  # joins happened
