"""GPT-OSS chats rendered as vLLM renders them: with Harmony, not the chat template.

For a model whose config.json says ``model_type: gpt_oss`` vLLM's chat route (and the Responses
route, and from 0.33.0 a chat-form ``/tokenize``) never renders the chat template: vllm 0.32.0
and 0.33.0 ``renderers/online_renderer.py`` ``_make_request_with_harmony`` takes the first system
or developer message's text as instructions, builds a system message (reasoning effort, the
conversation's start date) and, with instructions or tools, a developer message (the function
tools), turns the other messages into Harmony messages and renders them with openai_harmony's
GPT-OSS encoding (``entrypoints/openai/parser/harmony_utils.py``, the same file in both
releases). This module does the same with the same library (oss-harmony, a vLLM dependency whose
GPT-OSS vocabulary is embedded: nothing is downloaded). tests/integration/test_harmony_vllm.py
checks its ids against vLLM's own functions.

Followed as vLLM's defaults: ``VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS`` unset (instructions go
to the developer message) and ``VLLM_SYSTEM_START_DATE`` unset (today's date, as vLLM's clock
reads it).
"""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

from kvgate.chat_template import TokenizationError
from kvgate.image_rules import model_type_of
from kvgate.request import ChatInput
from kvgate.work_budget import TOKENIZE_BYTES_PER_TEXT_BYTE, charge

GPT_OSS_MODEL_TYPE = "gpt_oss"
# harmony_utils.py REASONING_EFFORT: the efforts Harmony takes (vLLM answers 400 to others).
REASONING_EFFORTS = ("high", "medium", "low")
# Chats with more content characters than this render in a thread (LocalTokenizer's threshold).
OFFLOAD_CHARS = 4000
# get_developer_message: built-in tools it leaves out, and the one type it describes.
_BUILT_IN_TOOLS = ("web_search_preview", "code_interpreter", "container")


def renders_with_harmony(model_dir: str | Path | None) -> bool:
    """vLLM renders this model's chats with Harmony (``model_type == "gpt_oss"``,
    renderers/online_renderer.py ``use_harmony``): no chat template, the request's own included,
    is ever rendered for it."""
    return model_type_of(model_dir) == GPT_OSS_MODEL_TYPE


class HarmonyChats:
    """A tokenizer whose chats are rendered with Harmony, as vLLM renders a GPT-OSS model's; its
    prompts (completions) go to the model's own tokenizer or the backend's /tokenize as before."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.source = inner.source
        _encoding()  # loaded with the tokenizer (1-2 s here), not inside a request's time budget

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def encode_chat(
        self, chat: ChatInput, max_tokens: int | None = None, namespace_aliases: bool = False
    ) -> Sequence[int]:
        """vLLM's Harmony branch ignores the chat template, its kwargs and the content format. A
        body whose messages are not shaped as OpenAI's (vLLM's request model refuses those) is a
        TokenizationError, not a crash."""
        size = sum(len(json.dumps(message.get("content"), ensure_ascii=False)) for message in chat.messages)
        # Harmony took 0.66 s and 13 MB of RSS for a 1 MB chat here: charged as the tokenizer's
        # encoding is (kvgate/work_budget.py), off the event loop past a few thousand characters
        await charge(TOKENIZE_BYTES_PER_TEXT_BYTE * size)
        try:
            if size > OFFLOAD_CHARS:
                return await asyncio.to_thread(render_harmony, chat)
            return render_harmony(chat)
        except (AttributeError, TypeError, ValueError, KeyError) as exc:
            raise TokenizationError(f"the messages cannot be rendered with Harmony: {exc}") from exc


@cache
def _encoding() -> Any:
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def render_harmony(chat: ChatInput, start_date: str | None = None) -> list[int]:
    """The prompt token ids vLLM renders for `chat` on a GPT-OSS model (`start_date`: today's)."""
    from openai_harmony import Conversation, RenderConversationConfig, Role

    if chat.reasoning_effort == "none":
        raise TokenizationError("Harmony does not support reasoning_effort='none'")
    instructions, messages = _instructions(list(chat.messages))
    rendered = _preamble(instructions, chat.tools, chat.reasoning_effort, start_date)
    rendered += _conversation(messages)
    conversation = Conversation.from_messages(_drop_analysis(rendered))
    ids = _encoding().render_conversation_for_completion(
        conversation, Role.ASSISTANT, config=RenderConversationConfig(auto_drop_analysis=False)
    )
    return _legacy_tool_call_headers(list(ids))


def _text(content: Any) -> str | None:
    """harmony_utils.py ``flatten_input_text_content``: a string, or the text parts joined."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts: list[str] = []
    for item in content:
        text = item if isinstance(item, str) else item.get("text") if isinstance(item, dict) else None
        if text is not None:
            texts.append(text)
    return "".join(texts) if texts else None


def _instructions(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """``extract_instructions_from_messages``: a leading system or developer message's text."""
    if messages and messages[0].get("role") in ("system", "developer"):
        return _text(messages[0].get("content")), messages[1:]
    return None, messages


def _preamble(
    instructions: str | None, tools: Sequence[dict[str, Any]] | None, effort: str | None, start_date: str | None
) -> list[Any]:
    """``build_harmony_preamble``: the system message, and a developer message with instructions
    or tools (``get_system_message``, ``get_developer_message``)."""
    from openai_harmony import DeveloperContent, Message, ReasoningEffort, Role, SystemContent

    system = SystemContent.new()
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise TokenizationError(
                f"reasoning_effort={effort!r} is not supported by Harmony. "
                f"Supported values are: {', '.join(REASONING_EFFORTS)}."
            )
        system = system.with_reasoning_effort(ReasoningEffort[effort.upper()])
    date = start_date or datetime.datetime.now().strftime("%Y-%m-%d")  # local time, as vLLM reads it
    rendered = [Message.from_role_and_content(Role.SYSTEM, system.with_conversation_start_date(date))]
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions is not None:
            developer = developer.with_instructions(instructions)
        functions = [_function(tool) for tool in tools or () if _function_tool(tool)]
        if functions:
            developer = developer.with_function_tools(functions)
        rendered.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    return rendered


def _function_tool(tool: dict[str, Any]) -> bool:
    kind = tool.get("type")
    if kind == "function":
        return True
    if kind in _BUILT_IN_TOOLS:
        return False
    raise TokenizationError(f"tool type {kind!r} is not supported.")


def _function(tool: dict[str, Any]) -> Any:
    """``create_tool_definition`` of a chat tool."""
    from openai_harmony import ToolDescription

    function = tool.get("function") or {}
    return ToolDescription.new(
        name=function.get("name"), description=function.get("description") or "", parameters=function.get("parameters")
    )


def _conversation(messages: list[dict[str, Any]]) -> list[Any]:
    """``parse_chat_inputs_to_harmony_messages``: tool results name their call's function."""
    names = {
        call.get("id"): (call.get("function") or {}).get("name")
        for message in messages
        for call in message.get("tool_calls") or ()
    }
    return [harmony for message in messages for harmony in _message(message, names)]


def _message(message: dict[str, Any], names: dict[Any, Any]) -> list[Any]:
    """``parse_chat_input_to_harmony_message`` of one chat message."""
    from openai_harmony import Author, DeveloperContent, Message, Role, TextContent

    role, out = message.get("role"), []
    calls = message.get("tool_calls") or []
    if role == "assistant" and calls:
        content = _text(message.get("content"))
        if content:
            out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("commentary"))
        if message.get("reasoning"):
            out.append(Message.from_role_and_content(Role.ASSISTANT, message["reasoning"]).with_channel("analysis"))
        for call in calls:
            function = call.get("function") or {}
            out.append(
                Message.from_role_and_content(Role.ASSISTANT, function.get("arguments", "") or "")
                .with_channel("commentary")
                .with_recipient(f"functions.{function.get('name', '')}")
                .with_content_type("json")
            )
        return out
    if role == "tool":
        name = names.get(message.get("tool_call_id", ""), "")
        author = Author.new(Role.TOOL, f"functions.{name}")
        text = _text(message.get("content")) or ""
        return [Message.from_author_and_content(author, text).with_channel("commentary").with_recipient("assistant")]
    if role == "assistant" and message.get("reasoning"):
        out.append(Message.from_role_and_content(Role.ASSISTANT, message["reasoning"]).with_channel("analysis"))
    content = message.get("content") or ""
    if not isinstance(content, str) and not (isinstance(content, list) and all(isinstance(c, dict) for c in content)):
        raise TokenizationError("a message's content must be a string or a list of content parts")
    parts = (
        [TextContent(text=content)]
        if isinstance(content, str)
        else [TextContent(text=c.get("text", "")) for c in content]
    )
    if role == "assistant" and parts and parts[0].text:
        out.append(Message.from_role_and_contents(role, parts).with_channel("final"))
    elif role in ("system", "developer"):
        instructions = _text(message.get("content"))
        if instructions is not None:  # get_system_or_developer_message: a developer message
            developer = DeveloperContent.new().with_instructions(instructions)
            out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    elif role != "assistant":
        out.append(Message.from_role_and_contents(role, parts))
    return out


def _drop_analysis(messages: list[Any]) -> list[Any]:
    """``auto_drop_analysis_messages``: analysis before the last final answer is dropped."""
    last_final = next(
        (
            i
            for i in range(len(messages) - 1, -1, -1)
            if messages[i].author.role == "assistant" and messages[i].channel == "final"
        ),
        -1,
    )
    return [m for i, m in enumerate(messages) if not (i < last_final and m.channel == "analysis")]


def _legacy_tool_call_headers(ids: list[int]) -> list[int]:
    """``_use_legacy_tool_call_headers``: an assistant tool-call header ``assistant<|channel|>
    commentary to=X <|constrain|>json`` goes back to ``assistant to=X<|channel|>commentary json``,
    as vLLM rewrites it (oss-harmony 0.0.10 changed the shape)."""
    encoding = _encoding()
    start, channel_token, constrain, message = (
        encoding.encode(token, allowed_special="all")[0]
        for token in ("<|start|>", "<|channel|>", "<|constrain|>", "<|message|>")
    )
    index = 0
    while index < len(ids):
        if ids[index] != start:
            index += 1
            continue
        try:
            header_end = ids.index(message, index + 1)
            channel_at = ids.index(channel_token, index + 1, header_end)
            constrain_at = ids.index(constrain, channel_at + 1, header_end)
        except ValueError:
            index += 1
            continue
        author = encoding.decode(ids[index + 1 : channel_at])
        channel_and_recipient = encoding.decode(ids[channel_at + 1 : constrain_at])
        content_type = encoding.decode(ids[constrain_at + 1 : header_end])
        if author != "assistant" or " to=" not in channel_and_recipient or not channel_and_recipient.endswith(" "):
            index = header_end + 1
            continue
        channel, recipient = channel_and_recipient[:-1].split(" to=", 1)
        if not channel or not recipient or not content_type:
            index = header_end + 1
            continue
        legacy = [
            start,
            *encoding.encode(f"assistant to={recipient}"),
            channel_token,
            *encoding.encode(f"{channel} {content_type}"),
            message,
        ]
        ids[index : header_end + 1] = legacy
        index += len(legacy)
    return ids
