"""Images in chat messages: counted as vLLM's multimodal processor expands them, by the model
family's rule (kvgate/image_rules.py), refused with a 400 where kvgate has no rule.

This module finds the media parts of a chat, merges `--mm-processor-kwargs` with the request's
`mm_processor_kwargs` as vLLM does, reads each image's size from its header (kvgate/media.py),
and expands each placeholder token into the image's tokens (its features as a stand-in id per
image, for prefix sharing); likewise WAV audio on the audio families (kvgate/audio.py) and videos on
Qwen2-VL, Qwen2.5-VL and Qwen3-VL, sent as frames or in an MP4 / WebM file (kvgate/video_container.py).
Other audio and video, and images on a model without a rule, are counted by
the backend's render endpoint where it serves one (kvgate/multimodal_render.py), else refused:
kvgate never passes through what it has not counted. An image by URL is not fetched and counts as
the largest the processor can make of any image.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from kvgate.audio import (
    AUDIO_RULES,
    PHI4MM_AUDIO_TOKEN,
    AudioByUrl,
    AudioLength,
    AudioNotCounted,
    AudioRule,
    audio_data,
    read_audio,
)
from kvgate.chat_template import MediaPlaceholder, TokenizationError
from kvgate.image_rules import (
    PHI4MM_IMAGE_TOKEN,
    RULES,
    DynamicResolution,
    Expanding,
    ImageRule,
    ImageTokens,
    Replacement,
    TimedFrames,
    TimedVideoGrid,
    VideoGrid,
)
from kvgate.media import (
    VLLM_VIDEO_FRAMES,
    ImageByUrl,
    ImageSize,
    MediaError,
    VideoFrames,
    data_url_cost,
    image_url,
    read_image,
    video_frames,
)
from kvgate.memory.encoder import OTHER_MODALITY, coded_stand_in
from kvgate.multimodal_render import RenderEndpoint, UncountedMedia, render_chat
from kvgate.request import ChatInput
from kvgate.video_container import (
    QWEN2_VL_FPS,
    QWEN3_VL_FPS,
    VideoNotCounted,
    container_video,
    qwen2_vl_frames,
    qwen3_vl_indices,
)
from kvgate.work_budget import charge

if TYPE_CHECKING:
    from kvgate.tokens import Tokenizer

# vLLM's content-part types that carry an image, and those that carry other media.
_IMAGE_PARTS = frozenset({"image_url", "input_image", "image_pil", "image_embeds"})
_OTHER_MEDIA = frozenset({"audio_url", "input_audio", "audio_embeds", "video_url", "video_embeds", "file"})
_AUDIO_PARTS = frozenset({"audio_url", "input_audio"})  # those kvgate reads a length from
# vLLM's default --limit-mm-per-prompt for a modality it is not given (vllm/config/multimodal.py
# MultiModalConfig.get_limit_per_prompt, 0.32.0 and 0.33.0).
DEFAULT_LIMIT_PER_PROMPT = 999
# The HF processor kwarg scopes vLLM routes flat mm_processor_kwargs into (vllm/multimodal/
# processing/context.py _resolve_mm_processor_kwargs); kvgate reads the images' one.
_KWARG_SCOPES = ("text_kwargs", "images_kwargs", "videos_kwargs", "audio_kwargs")


@dataclass(frozen=True)
class MediaOptions:
    """vLLM's `--mm-processor-kwargs` and `--limit-mm-per-prompt`, as kvgate counts with them."""

    processor_kwargs: Mapping[str, Any] = field(default_factory=dict)
    limits: Mapping[str, int] = field(default_factory=dict)
    render: RenderEndpoint | None = None  # the backend that renders what kvgate has no rule for
    media_io: Mapping[str, Any] = field(default_factory=dict)  # vLLM's --media-io-kwargs
    # --limit-mm-per-prompt's profiling options a modality ({"image": {"width": 64, "height": 64}}):
    # the sizes of the start-up profile's dummy items (kvgate/memory/encoder.py reads them)
    dummy: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def media_options(
    processor_kwargs: Mapping[str, Any] | None,
    limits: Mapping[str, Any] | None,
    render: RenderEndpoint | None = None,
    media_io: Mapping[str, Any] | None = None,
) -> MediaOptions:
    """From vLLM's flags: `--limit-mm-per-prompt` gives a count per modality, either alone or as
    {"count": n, ...options for profiling} (vllm/config/multimodal.py MultiModalDummyOptions);
    `render`: the backend's render endpoint, for media kvgate has no rule for."""
    counts = {}
    dummy = {}
    for modality, value in (limits or {}).items():
        count = value.get("count", DEFAULT_LIMIT_PER_PROMPT) if isinstance(value, Mapping) else value
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt: {modality!r} needs a count of 0 or more, got {value!r}")
        counts[modality] = count
        if isinstance(value, Mapping):
            dummy[modality] = {k: v for k, v in value.items() if k != "count"}
    return MediaOptions(dict(processor_kwargs or {}), counts, render, dict(media_io or {}), dummy)


def _merge(low: Mapping[str, Any], high: Mapping[str, Any]) -> dict[str, Any]:
    """Nested mappings merged recursively, `high`'s values first (vllm/config/multimodal.py
    _recursively_merge_mm_processor_kwargs)."""
    out = dict(low)
    for key, value in high.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _complete_size_aliases(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2VLProcessingInfo._complete_mm_processor_size_aliases, for the flat kwargs and the
    images_kwargs alike: min_pixels / max_pixels and size's edges completed from each other."""
    out = dict(kwargs)
    size = dict(out["size"]) if isinstance(out.get("size"), Mapping) else {}
    for edge, alias in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
        if alias not in out:
            if size.get(edge) is not None:
                out[alias] = size[edge]
        elif out[alias] is not None and edge not in size:
            size[edge] = out[alias]
            out["size"] = size
    for scope in ("images_kwargs", "videos_kwargs"):
        if isinstance(out.get(scope), Mapping):
            out[scope] = _complete_size_aliases(out[scope])
    return out


def _images_scope(kwargs: Mapping[str, Any], name: str = "images_kwargs") -> Mapping[str, Any]:
    scope = kwargs.get(name)
    return scope if isinstance(scope, Mapping) else {}


def image_kwargs(
    configured: Mapping[str, Any], request: Mapping[str, Any] | None, scope_name: str = "images_kwargs"
) -> dict[str, Any]:
    """The kwargs the image processor runs with, from `--mm-processor-kwargs` and the request's
    `mm_processor_kwargs`, as vLLM 0.32.0 / 0.33.0 merge them: the request's Qwen-VL size aliases
    completed (qwen2_vl.py _complete_mm_processor_size_aliases), flat keys merged request over
    configured; in the images_kwargs scope, configured flat < configured scoped < request flat <
    request scoped for the scope's keys (vllm/config/multimodal.py _merge_mm_processor_kwargs,
    _merge_mm_processor_scope); then flat keys routed into the scope, its values first
    (vllm/multimodal/processing/context.py _resolve_mm_processor_kwargs). `scope_name`
    "videos_kwargs": the video processor's, merged alike."""
    if request is not None and not isinstance(request, Mapping):
        raise TokenizationError("'mm_processor_kwargs' must be an object.")
    request = _complete_size_aliases(request or {})
    configured_flat = {k: v for k, v in configured.items() if k not in _KWARG_SCOPES}
    request_flat = {k: v for k, v in request.items() if k not in _KWARG_SCOPES}
    configured_scope, request_scope = _images_scope(configured, scope_name), _images_scope(request, scope_name)
    keys = configured_scope.keys() | request_scope.keys()
    scope = _merge({k: v for k, v in configured_flat.items() if k in keys}, configured_scope)
    scope = _merge(_merge(scope, {k: v for k, v in request_flat.items() if k in keys}), request_scope)
    return _merge(_merge(configured_flat, request_flat), scope)


def audio_kwargs(configured: Mapping[str, Any], request: Mapping[str, Any] | None) -> dict[str, Any]:
    """The kwargs the audio feature extractor runs with: flat keys, request over configured, then
    each side's audio_kwargs scope over them (vllm/config/multimodal.py
    _merge_mm_processor_kwargs; vllm/multimodal/processing/context.py _resolve_mm_processor_kwargs)."""
    if request is not None and not isinstance(request, Mapping):
        raise TokenizationError("'mm_processor_kwargs' must be an object.")
    out: dict[str, Any] = {}
    for side in (configured, request or {}):
        out = _merge(out, {k: v for k, v in side.items() if k not in _KWARG_SCOPES})
    for side in (configured, request or {}):
        scope = side.get("audio_kwargs")
        out = _merge(out, scope if isinstance(scope, Mapping) else {})
    return out


def _media_kind(part: Any) -> str | None:
    kind = part.get("type") if isinstance(part, dict) else None
    return kind if kind in _IMAGE_PARTS or kind in _OTHER_MEDIA else None


def _image_key(part: dict) -> str:
    """What identifies an image (vLLM hashes the image itself; kvgate has only the reference)."""
    return json.dumps(part.get(part["type"]), sort_keys=True, default=str)


@dataclass(frozen=True)
class ImagePart:
    key: str  # what the image's stand-in tokens are derived from
    url: str | None  # a data or remote URL to read the size from; None: no URL (embeds, PIL)


def _counted(images: ImageRule | None, audio: AudioRule | None) -> str:
    """What kvgate counts, for the refusal of what it does not."""
    audio_families = f"audio of {', '.join(sorted(AUDIO_RULES))} models (WAV)"
    if audio is not None:
        return f"this model's audio in WAV files; {audio_families}; images of {', '.join(sorted(RULES))} models"
    return f"images of {', '.join(sorted(RULES))} models, {audio_families}, and {_VIDEOS_COUNTED}"


def with_placeholders(
    chat: ChatInput,
    images: ImageRule | None,
    model_type: str | None = None,
    as_text: bool = False,
    audio: AudioRule | None = None,
    heard: list[ImagePart] | None = None,
    watched: list[ImagePart] | None = None,
) -> tuple[ChatInput, list[ImagePart]]:
    """The chat with each image part replaced by a MediaPlaceholder, which kvgate's renderer
    hands the template as vLLM does (an image part, or the placeholder where vLLM puts it), or
    `as_text`, for the backend's /tokenize, by a text part holding the placeholder; and the images
    in prompt order; TokenizationError (400) for media kvgate cannot count. With an `audio` rule,
    audio parts likewise (vLLM's placeholder numbers them: "Audio 1: ..."), appended to `heard`;
    with a rule that counts videos (Qwen2-VL's), video_url parts, appended to `watched`."""
    found: list[ImagePart] = []
    messages = []
    changed = False  # a chat without media is handed back as it is (most chats: no copy)
    for message in chat.messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_media_kind(p) for p in content):
            messages.append(message)
            continue
        changed = True
        parts = []
        for part in content:
            kind = _media_kind(part)
            if kind is None:
                parts.append(part)
                continue
            if kind in _AUDIO_PARTS and audio is not None and heard is not None:
                url = audio_data(part)
                if url is None:
                    raise UncountedMedia(
                        kind, model_type, _counted(images, audio), "this kvgate has no backend to render it"
                    )
                heard.append(ImagePart("audio:" + _image_key(part), url))
                placeholder = audio.placeholder_text(len(heard))
                text = {"type": "text", "text": placeholder}
                parts.append(text if as_text else MediaPlaceholder("audio", placeholder, part))
                continue
            video = images.video if isinstance(images, DynamicResolution) else None
            if kind == "video_url" and video is not None and watched is not None:
                value = part.get("video_url")
                url = value.get("url") if isinstance(value, dict) else value
                if not isinstance(url, str):
                    raise TokenizationError("A 'video_url' part needs a URL: {'video_url': {'url': ...}}.")
                watched.append(ImagePart("video:" + _image_key(part), url))
                text = {"type": "text", "text": video.placeholder}
                parts.append(text if as_text else MediaPlaceholder("video", video.placeholder, part))
                continue
            if kind in _OTHER_MEDIA or images is None:
                raise UncountedMedia(
                    kind, model_type, _counted(images, audio), "this kvgate has no backend to render it"
                )
            url = image_url(part)
            # Embeddings are never counted here: vLLM refuses them without --enable-mm-embeds and
            # with it counts an item by its rows, even on a fixed-count family (`parse_image_embeds`:
            # 0.32.0 renderers/chat_utils.py, 0.33.0 renderers/chat_utils/content_parser.py;
            # llava.py `get_replacement`: `ImageEmbeddingItems.get_feature_size`, both): the
            # backend's render says which.
            if url is None and (kind == "image_embeds" or not isinstance(images, ImageTokens)):
                raise UncountedMedia(
                    kind,
                    model_type,
                    f"{images.family} images by their size, which a {kind!r} part does not give: send "
                    "the image as an image_url (a data URL or an http(s) URL)",
                    "this kvgate has no backend to render it",
                )
            found.append(ImagePart(_image_key(part), url))
            placeholder = images.placeholder_for(len(found))
            text = {"type": "text", "text": placeholder}
            parts.append(text if as_text else MediaPlaceholder("image", placeholder, part))
        messages.append({**message, "content": parts})
    return (replace(chat, messages=tuple(messages)) if changed else chat), found


def _stand_in(key: str, tiles: int = 0) -> int:
    """A negative id standing for one image: two requests share a KV prefix only if they share the
    image, as vLLM's block hashes, which include each image's hash, decide. It carries the tiles
    its vision tower runs (`Replacement.tiles`) for the encoder's charge (kvgate/memory/encoder.py
    `coded_stand_in`)."""
    return coded_stand_in(int.from_bytes(hashlib.blake2b(key.encode(), digest_size=7).digest(), "big"), tiles)


def replace_token_matches(ids: list[int], match: Sequence[int], new: Sequence[int]) -> list[int]:
    """Every non-overlapping run of `match`, left to right, becomes `new` (vllm/multimodal/
    processing/processor.py replace_token_matches and iter_token_matches, 0.32.0 and 0.33.0,
    with their C-level scan for the run's first token)."""
    wanted = list(match)
    if not wanted:
        return ids
    out: list[int] = []
    start = found = 0
    while True:
        try:
            found = ids.index(wanted[0], found, max(len(ids) - len(wanted) + 1, 0))
        except ValueError:
            break
        if ids[found : found + len(wanted)] == wanted:
            out += ids[start:found]
            out += new
            start = found = found + len(wanted)
        else:
            found += 1
    return out + ids[start:]


def expand_images(
    ids: Sequence[int],
    rule: Expanding,
    images: Sequence[tuple[str, Replacement, Sequence[int] | None]],
    merges: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
    target: int | None = None,
) -> list[int]:
    """Each placeholder token (`target`, else the rule's) becomes its image's replacement, the
    feature tokens the image's stand-in; `images`: (key, replacement, the replacement text's
    token ids or None)."""
    target = rule.target_token if target is None else target
    at = [i for i, token in enumerate(ids) if token == target]
    if len(at) != len(images):
        raise TokenizationError(
            f"the prompt has {len(at)} {rule.placeholder} placeholders for {len(images)} {rule.family} media items"
        )
    out: list[int] = []
    start = 0
    for position, (key, replacement, text_ids) in zip(at, images, strict=True):
        stand_in = _stand_in(key, replacement.tiles)
        out += ids[start:position]
        if text_ids is None:
            out += [stand_in] * replacement.features
        else:
            features = sum(1 for t in text_ids if t == rule.feature_token)
            if features != replacement.features:
                raise TokenizationError(
                    f"the model's tokenizer makes {features} image tokens of the {rule.family} image "
                    f"sequence, not {replacement.features}: kvgate cannot count this model's images"
                )
            out += [stand_in if t == rule.feature_token else t for t in text_ids]
        start = position + 1
    out += ids[start:]
    for match, new in merges:
        out = replace_token_matches(out, match, new)
    return out


# Videos kvgate counts, and kwargs with which transformers' video processor samples frames itself
# (Qwen2VLVideoProcessor.sample_frames), which kvgate leaves to the render endpoint.
_VIDEOS_COUNTED = (
    "Qwen2-VL, Qwen2.5-VL and Qwen3-VL videos in a base64 data URL: their frames (data:video/jpeg;base64, comma-separated "
    "images) or an MP4 / MOV / WebM / Matroska file whose header gives its frames (kvgate fetches no video URL)"
)
_FRAME_SAMPLING = frozenset({"do_sample_frames", "fps", "num_frames", "min_frames", "max_frames"})
_NO_RENDER = "this kvgate has no backend to render it"

# A data URL longer than this is decoded in a thread: kvgate's event loop answers other requests
# meanwhile (base64 decodes at about 1 GB/s: a 32 MiB body is tens of milliseconds).
READ_IN_THREAD_CHARS = 256 * 1024
_T = TypeVar("_T")


async def _read(url: str) -> ImageSize | ImageByUrl:
    return await _in_thread_if_long(read_image, url)


async def _in_thread_if_long(read: Callable[..., _T], url: str, *args: Any) -> _T:
    """read(url, *args), in a thread for a long data URL."""
    if len(url) > READ_IN_THREAD_CHARS:
        return await asyncio.to_thread(read, url, *args)
    return read(url, *args)


# Replacement texts MediaCounting keeps tokenized, and the distinct token texts one image's
# replacement may hold (Idefics3's <row_i_col_j>: 16 to 25 for the released processors; a
# request's max_image_size can ask for thousands, each a tokenizer call, a /tokenize round trip
# without the tokenizer files).
MAX_ENCODED_TEXTS = 4096
MAX_DISTINCT_RUNS = 256

# The most image tokens a prompt may carry where the context limit is not known (vLLM's longest
# contexts are a few million tokens): each is an int64 in kvgate's memory before it is counted.
MAX_IMAGE_TOKENS = 1 << 24


def _refuse_beyond(image_tokens: int, max_tokens: int | None) -> None:
    """The images alone take more tokens than the context holds: the refusal vLLM gives a prompt
    too long (kvgate/tokens.py PromptTooLong), before any of them is built."""
    if max_tokens is not None and image_tokens > max_tokens:
        from kvgate.tokens import PromptTooLong  # tokens.py imports this module at its top

        raise PromptTooLong(image_tokens, max_tokens)
    if image_tokens > MAX_IMAGE_TOKENS:
        raise TokenizationError(
            f"The prompt's images take at least {image_tokens:,} tokens, more than kvgate counts "
            f"({MAX_IMAGE_TOKENS:,}) where the model's context length is not known."
        )


def _data_urls_cost(parts: list[ImagePart]) -> int:
    """The memory reading the parts' data URLs takes (kvgate/media.py data_url_cost); URLs that
    are not data URLs are not read."""
    return sum(data_url_cost(p.url) for p in parts if p.url is not None and p.url[:5].lower() == "data:")


# The text of the feature tokens numbered placeholders become (vLLM decodes them in its text
# path): phi4mm.py's _IMAGE_PLACEHOLDER_TOKEN_ID and _AUDIO_PLACEHOLDER_TOKEN_ID in its vocabulary.
FEATURE_TEXTS = {PHI4MM_IMAGE_TOKEN: "<|endoftext10|>", PHI4MM_AUDIO_TOKEN: "<|endoftext11|>"}


@dataclass(frozen=True)
class NumberedItem:
    """A media item behind a numbered placeholder (`ImageRule.indexed`)."""

    placeholder: str  # its text, "<|image_2|>"
    key: str  # what its stand-in tokens are derived from
    features: int
    feature_text: str  # the text of its feature token
    tiles: int = 0  # the tiles its tower runs (`Replacement.tiles`)


def _starts(sequence: Sequence[int] | str, targets: Sequence[Sequence[int] | str]) -> list[list[int]]:
    """Every position each target starts at in `sequence`, overlapping ones included; none for an
    empty target (vLLM ignores empty matches). Token targets are looked up in one pass over the
    ids, by their first token and length (a prompt of 100,000 "<" tokens and 200 placeholders
    starting with "<" is one pass, not 200)."""
    out: list[list[int]] = [[] for _ in targets]
    if isinstance(sequence, str):
        for found, target in zip(out, targets, strict=True):
            assert isinstance(target, str)
            at = sequence.find(target) if target else -1
            while at >= 0:
                found.append(at)
                at = sequence.find(target, at + 1)
        return out
    by_length: dict[int, dict[tuple[int, ...], list[int]]] = {}
    for index, target in enumerate(targets):
        assert not isinstance(target, str)
        if target:
            by_length.setdefault(len(target), {}).setdefault(tuple(target), []).append(index)
    firsts = {target[0] for target in targets if target}
    ids = list(sequence)
    for at, token in enumerate(ids):
        if token in firsts:
            for length, table in by_length.items():
                for index in table.get(tuple(ids[at : at + length]), ()):
                    out[index].append(at)
    return out


def plan_matches(
    sequence: Sequence[int] | str, targets: Sequence[Sequence[int] | str]
) -> list[tuple[int, int, int]] | None:
    """Where each item's target is replaced, (start, end, item) in prompt order, as vLLM 0.32.0 /
    0.33.0 plan it for items that each have their own target (vllm/multimodal/processing/
    processor.py _plan_prompt_updates_with, by tokens or by text): from the end of the last
    replacement on, the earliest match of any item left (the earliest end, then the first item,
    on a tie) is the next; None where some item's target is not found (vLLM's token plan then
    falls back to text, its text plan fails)."""
    starts = _starts(sequence, targets)
    left = list(range(len(targets)))
    plan: list[tuple[int, int, int]] = []
    end = 0
    while left:
        best: tuple[int, int, int] | None = None
        for item in left:
            found = bisect_left(starts[item], end)
            if found < len(starts[item]):
                match = (starts[item][found], starts[item][found] + len(targets[item]), item)
                best = match if best is None or match < best else best
        if best is None:
            return None
        plan.append(best)
        end = best[1]
        left.remove(best[2])
    return plan


class MediaCounting:
    """A tokenizer that counts images by the model's rule and refuses other media, around either
    tokenizer (the model folder's, or the backend's /tokenize)."""

    def __init__(
        self,
        inner: Tokenizer,
        images: ImageRule | None,
        options: MediaOptions | None = None,
        model_type: str | None = None,
        audio: AudioRule | None = None,
    ) -> None:
        self._inner = inner
        self._options = options or MediaOptions()
        self._images = images.configured(image_kwargs(self._options.processor_kwargs, None)) if images else None
        self._audio = audio
        self._model_type = model_type
        self._encoded: dict[str, list[int]] = {}  # replacement and merge texts, tokenized once
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

    async def _encode(self, text: str) -> list[int]:
        if text not in self._encoded:
            if len(self._encoded) >= MAX_ENCODED_TEXTS:  # requests' tile grids cannot grow it for ever
                self._encoded.clear()
            self._encoded[text] = list(await self._inner.encode_prompt(text, add_special_tokens=False))
        return self._encoded[text]

    def _refuse_past_limit(self, modality: str, parts: list[ImagePart], most_items: int | None = None) -> None:
        """vLLM's --limit-mm-per-prompt for `modality`, as vLLM words its refusal; and the most
        items a rule's numbered placeholders can name (`most_items`: Phi-4-multimodal's 100, past
        which vLLM's processor fails)."""
        limit = self._options.limits.get(modality, DEFAULT_LIMIT_PER_PROMPT)
        if len(parts) > limit:
            raise TokenizationError(f"At most {limit} {modality}(s) may be provided in one prompt.")
        if most_items is not None and len(parts) > most_items:
            raise TokenizationError(
                f"This model's processor has {most_items} numbered {modality} placeholders: at most {most_items} "
                f"{modality}(s) fit in one prompt."
            )

    async def _replacements(
        self, rule: ImageRule, found: list[ImagePart], request_kwargs: Any, max_tokens: int | None
    ) -> list[tuple[str, Replacement, Sequence[int] | None]]:
        self._refuse_past_limit("image", found, rule.most_items)
        kwargs = image_kwargs(self._options.processor_kwargs, request_kwargs)
        await charge(_data_urls_cost(found))
        sizes: list[ImageSize | None] = []
        for part in found:
            seen = await _read(part.url) if part.url is not None else None
            # Not fetched (a URL): the largest; a fixed count does not depend on the size.
            sizes.append(None if isinstance(seen, ImageByUrl) or isinstance(rule, ImageTokens) else seen)
        _refuse_beyond(sum(rule.most_features(size, kwargs) for size in sizes), max_tokens)
        out: list[tuple[str, Replacement, Sequence[int] | None]] = []
        for part, size in zip(found, sizes, strict=True):
            replacement = rule.replacement(size, kwargs)
            out.append((part.key, replacement, await self._replacement_ids(replacement)))
        return out

    async def _replacement_ids(self, replacement: Replacement) -> Sequence[int] | None:
        if replacement.text is not None:
            return await self._encode(replacement.text)
        if replacement.runs is None:
            return None
        if len({text for text, _ in replacement.runs}) > MAX_DISTINCT_RUNS:
            raise TokenizationError(
                f"kvgate counts images of at most {MAX_DISTINCT_RUNS} distinct tile tokens (each is tokenized "
                "once): ask for fewer tiles in mm_processor_kwargs"
            )
        ids: list[int] = []
        for text, count in replacement.runs:
            ids += await self._encode(text) * count
        return ids

    async def _merges(self, rule: ImageRule) -> list[tuple[list[int], list[int]]]:
        out = []
        for sequence, joined in rule.merges:
            parts = [await self._encode(text) for text in sequence]
            new = await self._encode(joined)
            if all(len(p) == 1 for p in parts) and len(new) == 1:
                out.append(([p[0] for p in parts], new))
        return out

    async def encode_chat(
        self, chat: ChatInput, max_tokens: int | None = None, namespace_aliases: bool = False
    ) -> Sequence[int]:
        # The text's bound holds with images too: their tokens only add to the text's.
        as_text = self._inner.source == "backend"  # /tokenize takes JSON: the placeholder as text
        heard: list[ImagePart] = []
        watched: list[ImagePart] = []
        try:
            text_chat, found = with_placeholders(
                chat, self._images, self._model_type, as_text, self._audio, heard, watched
            )
            sounds = await self._audio_replacements(heard, chat.mm_processor_kwargs, max_tokens)
            clips = await self._video_replacements(watched, chat, max_tokens)
        except UncountedMedia as uncounted:
            return await self._rendered(chat, uncounted, max_tokens)
        rule = self._images
        replacements = (
            await self._replacements(rule, found, chat.mm_processor_kwargs, max_tokens) if rule and found else []
        )
        ids = await self._inner.encode_chat(text_chat, max_tokens, namespace_aliases)
        # Numbered placeholders (Phi-4-multimodal's) first, images and audio in one plan, on the
        # tokenizer's own ids: vLLM plans every modality's updates together.
        numbered: list[NumberedItem] = []
        if rule is not None and rule.indexed:
            text = FEATURE_TEXTS[rule.feature_token]
            numbered += [
                NumberedItem(rule.placeholder_for(i), key, r.features, text, r.tiles)
                for i, (key, r, _) in enumerate(replacements, 1)
            ]
        if self._audio is not None and self._audio.indexed:
            text = FEATURE_TEXTS[self._audio.feature_token]
            numbered += [
                # not the image tower's: its Conformer's (kvgate/memory/encoder.py ConformerTower), sized by its embeddings
                NumberedItem(self._audio.placeholder_text(i), key, r.features, text, OTHER_MODALITY)
                for i, (key, r, _) in enumerate(sounds, 1)
            ]
        if numbered:
            expanded = await self._expand_numbered(ids, numbered)
            if expanded is None:
                unmatched = UncountedMedia(
                    "image_url" if found else "input_audio",
                    self._model_type,
                    "numbered placeholders that vLLM finds only in the prompt's text (the tokenizer splits them "
                    "differently there) where it has the model's tokenizer files and the prompt holds no "
                    f"{' or '.join(FEATURE_TEXTS.values())} text of its own",
                    _NO_RENDER,
                )
                return await self._rendered(chat, unmatched, max_tokens)
            ids = expanded
        if rule is not None and found and not rule.indexed:
            ids = expand_images(ids, rule, replacements, await self._merges(rule), await self._target(rule))
        if self._audio is not None and heard and not self._audio.indexed:
            ids = expand_images(ids, self._audio, sounds)
        if watched:
            video = rule.video if isinstance(rule, DynamicResolution) else None
            assert video is not None  # with_placeholders takes videos only where the rule counts them
            ids = expand_images(ids, video, clips)
        return ids

    async def _expand_numbered(self, ids: Sequence[int], items: list[NumberedItem]) -> list[int] | None:
        """Each item's numbered placeholder replaced by `features` stand-ins of the item, as vLLM
        0.32.0 / 0.33.0 apply the updates (vllm/multimodal/processing/processor.py
        BaseMultiModalProcessor._apply_prompt_updates): on the prompt's ids where every
        placeholder's tokens are found there (`plan_matches`), else on its text: the ids decoded,
        the placeholders replaced by their feature tokens' text, the text encoded again
        (_apply_prompt_updates_via_text). kvgate encodes one feature token's text an item where
        vLLM has `features` of them: the same ids but for their number, the feature token being
        one special token the tokenizer splits out before anything else (checked). None where
        kvgate cannot decode (the backend's /tokenize) or the prompt's own text holds a feature
        token's text."""
        targets = [await self._encode(item.placeholder) for item in items]
        ids = list(ids)
        plan = plan_matches(ids, targets)
        if plan is not None:
            out: list[int] = []
            previous = 0
            for start, end, index in plan:
                out += ids[previous:start]
                out += [_stand_in(items[index].key, items[index].tiles)] * items[index].features
                previous = end
            return out + ids[previous:]
        decode = getattr(self._inner, "decode", None)
        if decode is None:
            return None
        text = await asyncio.to_thread(decode, ids)
        text_plan = plan_matches(text, [decode(target) for target in targets])
        if text_plan is None:
            raise TokenizationError(
                "Failed to apply prompt replacement: a media placeholder is missing from the prompt"
            )
        feature_ids = {}
        for item in items:
            encoded = await self._encode(item.feature_text)
            if len(encoded) != 1:
                raise TokenizationError(
                    f"the model's tokenizer makes {len(encoded)} tokens of {item.feature_text}: kvgate cannot "
                    "count its media"
                )
            feature_ids[encoded[0]] = item.feature_text
        joined, previous = [], 0
        for start, end, index in text_plan:
            joined += [text[previous:start], items[index].feature_text]
            previous = end
        joined.append(text[previous:])
        if any(feature in piece for piece in joined[::2] for feature in feature_ids.values()):
            return None
        encoded_prompt = (await self._inner.encode_prompts(["".join(joined)], add_special_tokens=False))[0]
        at = [i for i, token in enumerate(encoded_prompt) if token in feature_ids]
        if len(at) != len(text_plan):
            raise TokenizationError("the prompt's media placeholders did not re-tokenize as their items")
        out, previous = [], 0
        for position, (_, _, index) in zip(at, text_plan, strict=True):
            out += encoded_prompt[previous:position]
            out += [_stand_in(items[index].key, items[index].tiles)] * items[index].features
            previous = position + 1
        return out + list(encoded_prompt[previous:])

    def _video_io(self, chat: ChatInput) -> dict[str, Any]:
        """The video loader's kwargs: the request's media_io_kwargs over --media-io-kwargs
        (vllm/multimodal/media/video.py VideoMediaIO.merge_kwargs, 0.32.0 and 0.33.0: a request's
        fps alone drops the flag's num_frames, its num_frames alone the flag's fps)."""
        request = (chat.media_io_kwargs or {}).get("video")
        request = request if isinstance(request, Mapping) else {}
        flag = self._options.media_io.get("video")
        merged = {**(flag if isinstance(flag, Mapping) else {}), **request}
        if "fps" in request and "num_frames" not in request:
            merged.pop("num_frames", None)
        elif "num_frames" in request and "fps" not in request:
            merged.pop("fps", None)
        return merged

    def _num_frames(self, video_io: Mapping[str, Any]) -> int:
        """The frames of a video sent as frames that vLLM keeps (VideoMediaIO's num_frames)."""
        frames = video_io.get("num_frames", VLLM_VIDEO_FRAMES)
        if not isinstance(frames, int) or isinstance(frames, bool):
            raise MediaError(f"media_io_kwargs video num_frames must be an integer, got {frames!r}")
        return frames

    def _loaded(self, rule: VideoGrid | TimedVideoGrid, video_io: Mapping[str, Any], container: bool) -> float | None:
        """The fps media_io_kwargs give vLLM's video loader (None: its default); UncountedMedia where
        vLLM would load or process the video in a way kvgate does not model: another video
        processor's loader, loader kwargs other than fps and num_frames (which Qwen3-VL's frames
        sent as images and every container video read)."""
        others = sorted(video_io.keys() - {"fps", "num_frames"})
        timed = isinstance(rule, TimedVideoGrid)
        loader = rule.qwen3_vl_loader if isinstance(rule, TimedVideoGrid) else rule.qwen2_vl_loader
        why = None
        if container and not loader:
            why = "another video processor"
        elif (container or timed) and others:
            why = f"media_io_kwargs {others}"
        if why is not None:
            raise UncountedMedia("video_url", self._model_type, f"{_VIDEOS_COUNTED}, not with {why}", _NO_RENDER)
        fps = video_io.get("fps")
        if fps is not None and (not isinstance(fps, int | float) or isinstance(fps, bool)):
            raise MediaError(f"media_io_kwargs video fps must be a number, got {fps!r}")
        return fps

    async def _clip(
        self, url: str, rule: VideoGrid | TimedVideoGrid, video_io: Mapping[str, Any], num_frames: int
    ) -> VideoFrames | TimedFrames:
        """The frames vLLM hands the model's processor: sent as images (kvgate/media.py
        video_frames), or sampled from a container's header (kvgate/video_container.py) by the
        model's loader (Qwen2VLVideoBackend: fps 2; Qwen3VLVideoBackend: fps 2, with the indices
        and rate the metadata carries); UncountedMedia for a video kvgate does not read."""
        frames = await _in_thread_if_long(video_frames, url, num_frames)
        if frames is not None:
            fps = self._loaded(rule, video_io, container=False)
            if isinstance(rule, VideoGrid):
                return frames
            # VideoMediaIO.load_base64's metadata: indices 0 to n - 1, fps media_io's or 1, no sampling.
            rate = float(1 if fps is None else fps)
            return TimedFrames(tuple(range(frames.frames)), rate, frames.frames, False, frames.size)
        try:
            header = await _in_thread_if_long(container_video, url)
        except VideoNotCounted as exc:
            raise UncountedMedia("video_url", self._model_type, f"{_VIDEOS_COUNTED}, not {exc}", _NO_RENDER) from None
        if header is None:
            raise UncountedMedia("video_url", self._model_type, _VIDEOS_COUNTED, _NO_RENDER)
        fps = self._loaded(rule, video_io, container=True)
        size = ImageSize(header.width, header.height)
        if isinstance(rule, VideoGrid):
            return VideoFrames(qwen2_vl_frames(header, QWEN2_VL_FPS if fps is None else fps), size)
        indices, rate = qwen3_vl_indices(header, QWEN3_VL_FPS if fps is None else fps)
        return TimedFrames(tuple(indices), rate, header.frames, len(indices) == header.frames, size)

    async def _video_replacements(
        self, watched: list[ImagePart], chat: ChatInput, max_tokens: int | None
    ) -> list[tuple[str, Replacement, Sequence[int] | None]]:
        """Each video's replacement, from its frames' or its container's header; UncountedMedia
        (the render endpoint's, where there is one) for a video kvgate does not read, or one
        transformers' video processor would sample frames of by the request's kwargs."""
        rule = self._images.video if isinstance(self._images, DynamicResolution) else None
        if rule is None or not watched:
            return []
        self._refuse_past_limit("video", watched)
        kwargs = image_kwargs(self._options.processor_kwargs, chat.mm_processor_kwargs, "videos_kwargs")
        sampling = sorted(_FRAME_SAMPLING & kwargs.keys())
        if not isinstance(kwargs.get("cap_pixels_per_frame", False), bool):
            sampling.append("a cap_pixels_per_frame other than true or false")
        if sampling:
            raise UncountedMedia(
                "video_url",
                self._model_type,
                f"videos whose frames the processor keeps, not with {sampling}",
                _NO_RENDER,
            )
        video_io = self._video_io(chat)
        num_frames = self._num_frames(video_io)
        # The URL's bytes, one frame's text and its decoded bytes at a time.
        await charge(sum(2 * len(p.url) for p in watched if p.url is not None and p.url[:5].lower() == "data:"))
        out: list[tuple[str, Replacement, Sequence[int] | None]] = []
        for part in watched:
            assert part.url is not None  # with_placeholders keeps only parts with a URL
            clip = await self._clip(part.url, rule, video_io, num_frames)
            if isinstance(rule, VideoGrid):
                assert isinstance(clip, VideoFrames)
                out.append((part.key, rule.replacement(clip, kwargs), None))
                continue
            assert isinstance(clip, TimedFrames)
            per_patch, stamps = rule.frames(clip, kwargs)
            ids: list[int] = []
            for stamp in stamps:
                ids += await self._encode(stamp)
                ids += [rule.vision_start, *[rule.target_token] * per_patch, rule.vision_end]
            out.append((part.key, Replacement(per_patch * len(stamps)), ids))
        _refuse_beyond(sum(r.features if ids is None else len(ids) for _, r, ids in out), max_tokens)
        return out

    async def _audio_replacements(
        self, heard: list[ImagePart], request_kwargs: Any, max_tokens: int | None
    ) -> list[tuple[str, Replacement, Sequence[int] | None]]:
        """Each audio part's replacement (kvgate/audio.py), from its WAV header; UncountedMedia for
        a container kvgate does not read (the render endpoint's, where there is one)."""
        rule = self._audio
        if rule is None or not heard:
            return []
        self._refuse_past_limit("audio", heard, rule.most_items)
        kwargs = audio_kwargs(self._options.processor_kwargs, request_kwargs)
        await charge(_data_urls_cost(heard))
        lengths: list[AudioLength | None] = []
        for part in heard:
            assert part.url is not None  # with_placeholders keeps only parts with data
            try:
                seen = (
                    await asyncio.to_thread(read_audio, part.url)
                    if len(part.url) > READ_IN_THREAD_CHARS
                    else read_audio(part.url)
                )
            except AudioNotCounted as exc:
                raise UncountedMedia(
                    "audio", self._model_type, str(exc), "this kvgate has no backend to render it"
                ) from None
            lengths.append(None if isinstance(seen, AudioByUrl) else seen)
        _refuse_beyond(sum(rule.features(length, kwargs) for length in lengths), max_tokens)
        return [(part.key, rule.replacement(length, kwargs), None) for part, length in zip(heard, lengths, strict=True)]

    async def _rendered(self, chat: ChatInput, uncounted: UncountedMedia, max_tokens: int | None) -> Sequence[int]:
        """Media kvgate has no rule for, counted by the backend's render endpoint
        (kvgate/multimodal_render.py), or refused."""
        if self._options.render is None:
            raise uncounted
        ids = await render_chat(self._options.render, chat, uncounted)
        _refuse_beyond(len(ids), max_tokens)
        return ids

    async def _target(self, rule: ImageRule) -> int:
        """The placeholder's token: config.json's, or where config.json has none (Llama 4's
        <|image|>) the tokenizer's, which must make it one token."""
        if rule.target_token >= 0:
            return rule.target_token
        ids = await self._encode(rule.placeholder)
        if len(ids) != 1:
            raise TokenizationError(f"the model's tokenizer makes {len(ids)} tokens of {rule.placeholder}, not one")
        return ids[0]
