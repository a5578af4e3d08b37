"""Images in chat messages: counted as vLLM counts them where the model's config says how many
tokens an image takes, refused with a 400 otherwise, whichever tokenizer kvgate uses.

vLLM (0.32.0) puts a placeholder in the prompt for each image and its multimodal processor then
replaces that placeholder token with one token per vision feature. For Llava with a CLIP vision
tower (vllm/model_executor/models/llava.py, LlavaProcessingInfo.get_num_image_tokens, and
PromptReplacement of `image_token_index` in LlavaMultiModalProcessor._get_prompt_updates) that
count does not depend on the image: CLIPEncoderInfo.get_num_image_tokens in clip.py gives
(image_size // patch_size)**2 patches + 1 class token, and get_num_selected_vision_tokens in
vision.py keeps all of them ("full"), all but the class token ("default") or only it ("class").
Every other model, and audio or video, is refused: kvgate cannot count what it would pass through.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgate.chat_template import TokenizationError
from kvgate.request import ChatInput

if TYPE_CHECKING:
    from kvgate.tokens import Tokenizer

# vLLM's content-part types that carry an image, and those that carry other media.
_IMAGE_PARTS = frozenset({"image_url", "input_image", "image_pil", "image_embeds"})
_OTHER_MEDIA = frozenset({"audio_url", "input_audio", "audio_embeds", "video_url", "video_embeds", "file"})
_SELECTED = {"default": lambda n: n - 1, "full": lambda n: n, "class": lambda n: 1}


@dataclass(frozen=True)
class ImageTokens:
    """How vLLM expands an image in this model's prompt."""

    placeholder: str  # the text vLLM's chat preprocessing puts in the prompt for an image
    token_id: int  # the placeholder's token id, which the processor repeats
    per_image: int  # tokens one image takes in the prompt


def image_tokens(config: dict[str, Any]) -> ImageTokens | None:
    """A Llava config's image expansion, or None where kvgate does not know it."""
    vision = config.get("vision_config") or {}
    strategy = config.get("vision_feature_select_strategy", "default")
    if (
        config.get("model_type") != "llava"
        or vision.get("model_type") != "clip_vision_model"
        or strategy not in _SELECTED
        or "image_token_index" not in config
    ):
        return None
    image_size, patch_size = vision.get("image_size"), vision.get("patch_size")
    if not image_size or not patch_size or image_size % patch_size:
        return None
    per_image = _SELECTED[strategy]((image_size // patch_size) ** 2 + 1)
    return ImageTokens("<image>", int(config["image_token_index"]), per_image)


def image_tokens_of(model_dir: str | Path | None) -> ImageTokens | None:
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return None
    return image_tokens(json.loads((Path(model_dir) / "config.json").read_text()))


def _media_kind(part: Any) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else None
    return kind if kind in _IMAGE_PARTS or kind in _OTHER_MEDIA else None


def _image_key(part: dict) -> str:
    """What identifies an image (vLLM hashes the image itself; kvgate has only the reference)."""
    return json.dumps(part.get(part["type"]), sort_keys=True, default=str)


def with_placeholders(chat: ChatInput, images: ImageTokens | None) -> tuple[ChatInput, list[str]]:
    """The chat with each image part replaced by a text part holding the placeholder, and a key
    per image in prompt order; TokenizationError (400) for media kvgate cannot count."""
    keys: list[str] = []
    messages = []
    for message in chat.messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_media_kind(p) for p in content):
            messages.append(message)
            continue
        parts = []
        for part in content:
            kind = _media_kind(part)
            if kind is None:
                parts.append(part)
            elif kind in _OTHER_MEDIA or images is None:
                raise TokenizationError(
                    f"kvgate cannot count the prompt tokens of a {kind!r} content part for this "
                    "model (its config.json says how many tokens an item takes only for Llava "
                    "images): send text only, or put this request to vLLM without kvgate"
                )
            else:
                keys.append(_image_key(part))
                parts.append({"type": "text", "text": images.placeholder})
        messages.append({**message, "content": parts})
    return replace(chat, messages=tuple(messages)), keys


def expand_images(ids: Sequence[int], images: ImageTokens, keys: list[str]) -> list[int]:
    """Each placeholder token becomes the image's tokens. Their ids stand for the image (a hash
    of its reference), so that two requests share a KV prefix only if they share the image, as
    vLLM's block hashes, which include each image's hash, decide."""
    at = [i for i, token in enumerate(ids) if token == images.token_id]
    if len(at) != len(keys):
        raise TokenizationError(f"the prompt has {len(at)} {images.placeholder} placeholders for {len(keys)} images")
    out: list[int] = []
    start = 0
    for position, key in zip(at, keys, strict=True):
        stand_in = -1 - int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "big")
        out += ids[start:position]
        out += [stand_in] * images.per_image
        start = position + 1
    return out + list(ids[start:])


class MediaCounting:
    """A tokenizer that counts Llava images and refuses other media, around either tokenizer."""

    def __init__(self, inner: Tokenizer, images: ImageTokens | None) -> None:
        self._inner = inner
        self._images = images
        self.source = inner.source

    async def encode_prompt(
        self, prompt: str, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> Sequence[int]:
        return await self._inner.encode_prompt(prompt, add_special_tokens, max_tokens)

    async def encode_prompts(
        self, prompts: list[str], add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> Sequence[Sequence[int]]:
        return await self._inner.encode_prompts(prompts, add_special_tokens, max_tokens)

    def refuse_certainly_too_long(self, text: str, max_tokens: int | None) -> None:
        self._inner.refuse_certainly_too_long(text, max_tokens)

    async def encode_chat(
        self, chat: ChatInput, max_tokens: int | None = None, namespace_aliases: bool = False
    ) -> Sequence[int]:
        # The text's bound holds with images too: their tokens only add to the text's.
        text_chat, keys = with_placeholders(chat, self._images)
        ids = await self._inner.encode_chat(text_chat, max_tokens, namespace_aliases)
        if not keys:
            return ids
        assert self._images is not None
        return expand_images(ids, self._images, keys)
