"""Media kvgate has no rule for, counted exactly by the backend's own render endpoint.

vLLM 0.32.0 and 0.33.0 serve `POST /v1/chat/completions/render` (vllm/entrypoints/scale_out/
render/api_router.py render_chat_completion; serving.py ServingRender.render_chat_request): it
renders the chat, fetches and processes its media with the model's own multimodal processor, and
answers the GenerateRequest the engine would run (vllm/entrypoints/scale_out/token_in_token_out/
protocol.py GenerateRequest): `token_ids`, the prompt with every placeholder already expanded into
the media's tokens (their count is the request's `usage.prompt_tokens`), and `features`, each
item's hash and placeholder range (MultiModalFeatures). With `"mm_payload": "none"` it leaves the
processed tensors out of the answer (vllm/entrypoints/generate/base/protocol.py MMPayload).

A plain `vllm serve` mounts the route but answers 403 PermissionDeniedError unless started with
`--enable-scale-out` (vllm/entrypoints/scale_out/factories.py register_scale_out_api_routers,
0.32.0 and 0.33.0); an older release answers 404. Either way kvgate refuses the request with a
400 that names the model, the media and that flag: media never pass through uncounted.

Cost: the backend processes the media twice (once to count, once to run) and kvgate sends the
body twice; this is the fallback for what kvgate cannot count itself, not the common path.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvgate.chat_template import TokenizationError
from kvgate.errors import BackendBroke, BackendTimedOut
from kvgate.memory.encoder import OTHER_MODALITY, coded_stand_in
from kvgate.request import ChatInput
from kvgate.work_budget import charge

RENDER_PATH = "/v1/chat/completions/render"
# How long the backend may take to fetch and process the media (a video is decoded in full).
RENDER_TIMEOUT_S = 60.0
# Statuses that mean the backend does not serve the endpoint to kvgate (401: vLLM's --api-key,
# which guards /v1 routes and kvgate sends none; 403: scale-out disabled; 404: a
# release without it; 405, 501: the model has no renderer).
_NOT_SERVED = frozenset({401, 403, 404, 405, 501})
HOW_TO_ENABLE = (
    "start vLLM (0.32 or later) with --enable-scale-out: kvgate then counts such requests exactly "
    f"through its POST {RENDER_PATH}"
)


@dataclass(frozen=True)
class RenderEndpoint:
    """Where kvgate asks vLLM to render a chat it cannot count: the backend's base URL and the
    served model name (empty: vLLM's default)."""

    base_url: str
    model: str = ""
    timeout_s: float = RENDER_TIMEOUT_S


class UncountedMedia(TokenizationError):
    """A media part kvgate has no rule for: a 400 unless the backend renders it."""

    def __init__(self, kind: str, model_type: str | None, counted: str, why_not_rendered: str) -> None:
        super().__init__(
            f"kvgate cannot count the prompt tokens of a {kind!r} content part for this model "
            f"(config.json model_type {model_type!r}; kvgate counts {counted}) and {why_not_rendered}: "
            f"{HOW_TO_ENABLE}; or send text only"
        )
        self.kind = kind
        self.model_type = model_type
        self.counted = counted

    def not_rendered(self, why: str) -> UncountedMedia:
        return UncountedMedia(self.kind, self.model_type, self.counted, why)


def render_body(chat: ChatInput, model: str) -> dict[str, Any]:
    """The chat request vLLM would run, as its render endpoint takes it, without the tensors."""
    body = {
        "model": model or None,
        **chat.backend_fields(),
        "mm_processor_kwargs": chat.mm_processor_kwargs,
        "media_io_kwargs": chat.media_io_kwargs,
        "reasoning_effort": chat.reasoning_effort,
        "mm_payload": "none",
    }
    return {k: v for k, v in body.items() if v is not None}


def _stand_in(item_hash: str, modality: str) -> int:
    """A negative id standing for one media item, from vLLM's own hash of it: two prompts share
    a KV prefix through it only where vLLM's block hashes (which include the item's hash) do. An
    audio is coded OTHER_MODALITY, so that Phi-4-multimodal's is charged to its Conformer, not to
    its image tower (kvgate/memory/encoder.py); an image or video carries no tiles (the
    largest item's are charged)."""
    digest = int.from_bytes(hashlib.blake2b(item_hash.encode(), digest_size=7).digest(), "big")
    return coded_stand_in(digest, OTHER_MODALITY if modality == "audio" else 0)


def prompt_ids(answer: Any) -> list[int]:
    """The rendered prompt's ids, each media item's placeholder range its stand-in; BackendBroke
    for an answer that is not a GenerateRequest."""
    try:
        ids = answer["token_ids"]
        if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
            raise TypeError("token_ids")
        features = answer.get("features") or {}
        hashes, ranges = features.get("mm_hashes") or {}, features.get("mm_placeholders") or {}
        for modality, places in ranges.items():
            for item_hash, place in zip(hashes[modality], places, strict=True):
                start, length = int(place["offset"]), int(place["length"])
                if not (start >= 0 and length > 0 and start + length <= len(ids)):
                    raise ValueError(f"placeholder {start}+{length} outside {len(ids)} tokens")
                ids[start : start + length] = [_stand_in(str(item_hash), str(modality))] * length
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BackendBroke(f"its {RENDER_PATH} answer is not a rendered prompt: {exc!r}") from None
    return ids


async def render_chat(endpoint: RenderEndpoint, chat: ChatInput, uncounted: UncountedMedia) -> Sequence[int]:
    """The chat's prompt ids as the backend renders them; `uncounted` (refined) where the backend
    does not serve the endpoint; vLLM's own 400 where it refuses the request."""
    payload = json.dumps(render_body(chat, endpoint.model), ensure_ascii=False).encode()
    await charge(len(payload))
    try:
        # A client per call: it runs in whichever loop prepares the request (kvgate's, a worker's).
        # Over plain http no CA bundle is loaded (megabytes, charged to the request otherwise).
        tls = endpoint.base_url.lower().startswith("https:")
        async with httpx.AsyncClient(base_url=endpoint.base_url, timeout=endpoint.timeout_s, verify=tls) as client:
            response = await client.post(RENDER_PATH, content=payload, headers={"content-type": "application/json"})
    except httpx.TimeoutException:
        raise BackendTimedOut() from None
    except httpx.HTTPError as exc:
        raise BackendBroke(f"its {RENDER_PATH} failed: {exc!r}") from None
    if response.status_code in _NOT_SERVED:
        raise uncounted.not_rendered(
            f"the backend does not render it (POST {RENDER_PATH} answered {response.status_code})"
        )
    if response.status_code in (400, 413, 422):
        raise TokenizationError(_message(response))
    if response.status_code != 200:
        raise BackendBroke(f"its {RENDER_PATH} answered {response.status_code}: {response.text[:200]}")
    try:
        answer = response.json()
    except ValueError:
        raise BackendBroke(f"its {RENDER_PATH} answer is not JSON") from None
    return prompt_ids(answer)


def _message(response: httpx.Response) -> str:
    """vLLM's error message ({"error": {"message"}}), else the body."""
    try:
        error = response.json().get("error")
        return str(error["message"]) if isinstance(error, dict) else response.text[:500]
    except (ValueError, AttributeError, KeyError):
        return response.text[:500]
