"""vLLM's chat preprocessing, ported so kvgate renders exactly the prompt vLLM will tokenize.

Follows vllm/renderers/chat_utils.py and hf.py of vLLM 0.32: content parts are joined with "\\n"
or kept as parts depending on the template's detected content format (detected by the backend
release's rule: 0.33.0 follows namespace aliases of `messages`), tool definitions are
normalised as vLLM's pydantic models dump them, tool-call arguments become dicts, developer
messages become system messages for templates that do not know the role, and the template is
rendered to text (the caller encodes it with add_special_tokens=False by default: the template
writes BOS itself).
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import json
import re
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, TypeGuard, TypeVar

import jinja2
import jinja2.compiler
import jinja2.filters
import jinja2.meta
import jinja2.sandbox
from jinja2 import nodes
from transformers.utils import chat_template_utils

from kvgate.request import ChatInput

ContentFormat = Literal["string", "openai"]

# Content-part types vLLM reads as text, and the key holding their text.
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Keys of vLLM's content-part TypedDicts; any other key of a text part is kept
# on the part for "openai"-format templates (vllm _collect_extra_fields).
_KNOWN_PART_FIELDS = frozenset(
    [
        "audio_embeds",
        "audio_url",
        "closed",
        "data",
        "file",
        "image_embeds",
        "image_pil",
        "image_url",
        "input_audio",
        "name",
        "prompt_cache_breakpoint",
        "refusal",
        "text",
        "thinking",
        "type",
        "uuid",
        "video_embeds",
        "video_url",
    ]
)
# transformers' named apply_chat_template parameters as vLLM 0.32 lets them
# through (transformers 5.19); any other chat_template_kwargs must be template variables.
_HF_CHAT_PARAMS = frozenset(
    [
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "conversation",
        "documents",
        "max_length",
        "padding",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "self",
        "tokenize",
        "tokenizer_kwargs",
        "tools",
        "truncation",
    ]
)
_BILLING_HEADER = "x-anthropic-billing-header"


class TokenizationError(ValueError):
    """Bad messages or a failing template: the client's fault, answered with HTTP 400."""


class TemplateBudgetExceeded(TokenizationError):
    """A request's chat template ran past its time or output budget."""


# ---------------------------------------------------------------- request templates, sandboxed


@dataclass(frozen=True)
class TemplateBudget:
    """What one render of a request's own template may spend: wall time and output characters.

    A trusted request template is still code from a client: a 146-byte one rendered 100 x 100 kB
    (1.9 GiB of peak memory) and nested loops held the event loop for seconds.
    """

    seconds: float
    chars: int


# The budget and deadline of the render running in this thread (render_within_budget sets it).
_active_budget: ContextVar[tuple[TemplateBudget, float] | None] = ContextVar("kvgate_template_budget", default=None)
_T = TypeVar("_T")


class _Overrun(BaseException):
    """Raised inside the rendering thread when its time is up (BaseException: templates catch
    nothing, but library code may catch Exception)."""


class _TimedRange:
    """jinja2's sandboxed range, but a loop over it gives up when the render's time is up: an
    empty nested loop calls nothing else the sandbox could check."""

    def __init__(self, *args: int) -> None:
        active = _active_budget.get()
        self._range = jinja2.sandbox.safe_range(*args)
        self._deadline = active[1] if active else float("inf")

    def __len__(self) -> int:
        return len(self._range)

    def __getitem__(self, index: Any) -> Any:
        return self._range[index]

    def __iter__(self) -> Iterator[int]:
        for count, value in enumerate(self._range):
            if count % 1024 == 0 and time.monotonic() > self._deadline:
                raise _Overrun()
            yield value


# printf-style conversions (`%` on a string) and str.format fields: the widths and precisions in
# them are characters the result will hold.
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_FIELD = re.compile(r"\{[^{}]*\}")
# str methods that build a string from their arguments, each sized before it runs.
_STR_BUILDERS = frozenset(
    {"center", "ljust", "rjust", "zfill", "expandtabs", "replace", "join", "format", "format_map"}
)


class _CountingCodeGenerator(jinja2.compiler.CodeGenerator):
    """Compiles `a ~ b` to the environment's counted concatenation (jinja2 writes `str_join`)."""

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.counted_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _numbers(text: str) -> int:
    return sum(int(n) for n in re.findall(r"\d+", text))


class BudgetedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox where every operation that builds a string or a list
    is sized before it allocates: `*`, `**`, `+`, `%`, `~`, the str methods that build strings
    (center, ljust, join, format, replace, ...) and the filters that do (join, center, format,
    indent, replace), each against the output budget; the rendered output is counted as it
    grows. The time limit is enforced by render_within_budget, which runs the render in a thread
    of its own (and kvgate runs that in a worker process whose memory it watches)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _CountingCodeGenerator

    def __init__(self, *args: Any, budget_chars: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.budget_chars = budget_chars
        self.filters.update(
            join=jinja2.filters.pass_environment(_counted_join),
            center=jinja2.filters.pass_environment(lambda env, value, width=80: env.sized(str(value), "center", width)),
            format=jinja2.filters.pass_environment(
                lambda env, value, *args, **kwargs: env.sized(str(value), "%", args or kwargs)
            ),
            indent=jinja2.filters.pass_environment(_counted_indent),
            replace=jinja2.filters.pass_eval_context(_counted_replace),
        )

    def check(self, size: int, what: str) -> None:
        if size > self.budget_chars:
            raise TemplateBudgetExceeded(
                f"the chat template builds {what} of {size:,} characters, over its budget of {self.budget_chars:,}"
            )

    def sized(self, text: str, operation: str, *args: Any) -> str:
        """`text` put through a string-building `operation`, sized first."""
        self.check(self._result_size(text, operation, args), f"a string with {operation}")
        if operation == "%":
            return text % args[0]
        return str(getattr(text, operation)(*args))

    def _result_size(self, text: str, operation: str, args: tuple[Any, ...]) -> int:
        """At least as many characters as the result of `text.<operation>(*args)` will have."""
        if operation in ("center", "ljust", "rjust", "zfill"):
            width = args[0] if args else 0
            return max(len(text), width if isinstance(width, int) else 0)
        if operation == "expandtabs":
            size = args[0] if args and isinstance(args[0], int) else 8
            return len(text) + text.count("\t") * max(size, 0)
        if operation == "replace":
            old, new = (str(a) for a in args[:2])
            return len(text) + (text.count(old) if old else len(text) + 1) * max(len(new) - len(old), 0)
        if operation == "%":
            values = args[0] if isinstance(args[0], tuple) else (args[0],)
            specs = _PRINTF_SPEC.findall(text)
            stars = sum(v for v in values if isinstance(v, int) and not isinstance(v, bool))
            widths = sum(int(w) for spec in specs for w in spec if w.isdigit()) + (
                stars if any("*" in spec for spec in specs) else 0
            )
            return len(text) + widths + sum(len(str(v)) for v in values)
        if operation == "format":
            fields = _FORMAT_FIELD.findall(text)
            return len(text) + sum(_numbers(field) for field in fields) + sum(len(str(v)) for v in args)
        return len(text)

    def counted_concat(self, parts: tuple[Any, ...]) -> str:
        """`a ~ b ~ ...`: the pieces as strings, their total sized before they are joined."""
        texts = [str(part) for part in parts]
        self.check(sum(map(len, texts)), "a string with ~")
        return "".join(texts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(count, int):
                    self.check(len(seq) * count, "a value with *")
        elif operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise TemplateBudgetExceeded("the chat template raises a number to a power above 64")
        elif operator == "+" and isinstance(left, (str, list)) and isinstance(right, (str, list)):
            self.check(len(left) + len(right), "a value with +")
        elif operator == "%" and isinstance(left, str):
            return self.sized(left, "%", right)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        """A template's method call; the str methods that build strings are sized first."""
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str) and name in _STR_BUILDERS:
            if name == "join" and args:
                return _counted_join(__self, args[0], owner)
            __self.check(__self._result_size(owner, name, args), f"a string with {name}")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """str.format and format_map, which jinja2's sandbox hands its own formatter, sized first."""
        formatter = super().wrap_str_format(value)
        if formatter is None:
            return None
        text: str = value.__self__

        def sized(*args: Any, **kwargs: Any) -> str:
            values = (*args, *(a for arg in args if isinstance(arg, dict) for a in arg.values()), *kwargs.values())
            self.check(self._result_size(text, "format", values), "a string with format")
            return str(formatter(*args, **kwargs))

        return sized

    def concat(self, pieces: Any) -> str:
        """Template.render's join of the output, stopped once it passes the output budget."""
        out: list[str] = []
        size = 0
        for piece in pieces:
            size += len(piece)
            if size > self.budget_chars:
                raise TemplateBudgetExceeded(
                    f"the chat template's output passed its budget of {self.budget_chars:,} characters"
                )
            out.append(piece)
        return "".join(out)


def _counted_join(env: BudgetedSandbox, value: Any, d: str = "", attribute: Any = None) -> str:
    """jinja2's join filter (and str.join), each item sized as it is taken: a join of a range
    with a long separator built gigabytes in one call."""
    if attribute is not None:
        value = map(jinja2.filters.make_attrgetter(env, attribute), value)
    separator, size = str(d), 0
    texts: list[str] = []
    for item in value:
        text = str(item)
        size += len(text) + (len(separator) if texts else 0)
        env.check(size, "a string with join")
        texts.append(text)
    return separator.join(texts)


def _counted_indent(env: BudgetedSandbox, value: Any, width: Any = 4, first: bool = False, blank: bool = False) -> str:
    text = str(value)
    pad_size = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
    env.check(len(text) + (text.count("\n") + 1) * pad_size, "a string with indent")
    return str(jinja2.filters.do_indent(text, width, first, blank))


def _counted_replace(eval_ctx: Any, value: Any, old: Any, new: Any, count: int | None = None) -> str:
    env: BudgetedSandbox = eval_ctx.environment
    text = str(value)
    env.check(env._result_size(text, "replace", (old, new)), "a string with replace")
    return str(jinja2.filters.do_replace(eval_ctx, text, old, new, count))


@lru_cache(maxsize=32)
def _budgeted_template(template: str, budget_chars: int) -> jinja2.Template:
    """`template` compiled as transformers compiles chat templates (its extensions, filters and
    globals, read off transformers' own environment), in a BudgetedSandbox."""
    reference = _transformers_compile("").environment
    env = BudgetedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        budget_chars=budget_chars,
        extensions=[type(ext) for ext in reference.extensions.values()],
    )
    env.filters["tojson"] = reference.filters["tojson"]
    for name in ("raise_exception", "strftime_now", "dict", "namespace"):
        env.globals[name] = reference.globals[name]
    env.globals["range"] = _TimedRange
    return env.from_string(template)


# transformers' own compiler, kept once the budget hook replaces it (install_budget_hook).
_original_compile: Callable[[str], jinja2.Template] | None = None
_hook_lock = threading.Lock()


def _transformers_compile(template: str) -> jinja2.Template:
    """transformers' template compiler (cached by transformers), hook or no hook."""
    compile_template = _original_compile or chat_template_utils._compile_jinja_template
    return compile_template(template)


def _compile_for_render(template: str) -> jinja2.Template:
    """transformers' template compiler, unless a budgeted render is running in this context."""
    active = _active_budget.get()
    if active is None:
        return _transformers_compile(template)
    return _budgeted_template(template, active[0].chars)


def install_budget_hook() -> None:
    """Route transformers' template compiler through `_compile_for_render`, once per process,
    before the first budgeted render (render_within_budget): importing this module changes
    nothing of transformers.

    transformers compiles in `render_jinja_template` (chat_template_utils, transformers 5.x)
    through this module-level name; replacing it is the one hook that keeps transformers' own
    rendering (generation tracking, continue_final_message) for a budgeted template. Outside a
    budgeted render the hook calls transformers' own compiler."""
    global _original_compile
    with _hook_lock:
        if _original_compile is None:
            _original_compile = chat_template_utils._compile_jinja_template
            chat_template_utils._compile_jinja_template = _compile_for_render  # type: ignore[assignment]  # replaced on purpose


async def render_within_budget(render: Callable[[], _T], budget: TemplateBudget) -> _T:
    """`render()` in a thread of its own under `budget`: the event loop stays free, and a render
    still running when the time is up is stopped by an exception raised in that thread (Python's
    PyThreadState_SetAsyncExc; it lands at the next bytecode, and the size checks keep each
    single operation short)."""
    install_budget_hook()
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        _active_budget.set((budget, time.monotonic() + budget.seconds))
        try:
            result = render()
        except _Overrun:
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, exc)
            return
        loop.call_soon_threadsafe(settle, result, None)

    thread = threading.Thread(target=run, name="kvgate-template", daemon=True)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.shield(done), budget.seconds)
    except TimeoutError:
        if thread.is_alive() and thread.ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Overrun))
        raise TemplateBudgetExceeded(f"the chat template ran past its budget of {budget.seconds:g} s") from None


# ---------------------------------------------------------------- template analysis


def _reads(node: nodes.Node, var: str) -> bool:
    """`node` reads `var`: a name, or a namespace attribute spelt ``ns.attr`` (only vLLM 0.33's
    rule makes such aliases: vllm 0.33.0 renderers/hf.py:364-373 `_is_var_access`)."""
    if isinstance(node, nodes.Name):
        return node.ctx == "load" and node.name == var
    if isinstance(node, nodes.Getattr) and "." in var:
        base, _, attr = var.rpartition(".")
        return node.attr == attr and _reads(node.node, base)
    return False


def _accesses(node: nodes.Node, var: str, key: str | None = None) -> bool:
    """`var` (or `var[key]` / `var.key`), possibly sliced, filtered or tested."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _accesses(node.node, var, key)
    if isinstance(node, nodes.Test):
        return _accesses(node.node, var, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _accesses(node.node, var, key)
    if key is None:
        return _reads(node, var)
    if isinstance(node, nodes.Getitem):
        return _reads(node.node, var) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    return isinstance(node, nodes.Getattr) and _reads(node.node, var) and node.attr == key


def _loop_target(loop: nodes.For) -> str:
    if not isinstance(loop.target, nodes.Name):
        raise TypeError("tuple loop target")  # vLLM gives up on these: "string" format
    return loop.target.name


def _calls_namespace(node: nodes.Node) -> TypeGuard[nodes.Call]:
    return isinstance(node, nodes.Call) and isinstance(node.node, nodes.Name) and node.node.name == "namespace"


def _assigned_aliases(assign: nodes.Assign, var: str, namespace_aliases: bool) -> list[str]:
    """The names `assign` binds to `var` (or its elements): vLLM's `_iter_nodes_assign_var_or_elems`.

    vllm 0.32.0 renderers/hf.py:364-385 follows plain names and asserts that any other target
    (``ns.attr``, a tuple) assigned from `var` is a name: the AssertionError makes the whole
    template "string" (hf.py:491-506, the default). vllm 0.33.0 hf.py:424-470 also follows
    namespace aliases, ``namespace(attr=var)`` and ``{% set ns.attr = var %}``, as ``ns.attr``,
    and passes over other targets."""
    target, value = assign.target, assign.node
    if isinstance(target, nodes.Name) and _accesses(value, var):
        return [target.name]
    if not namespace_aliases:
        if _accesses(value, var):
            raise TypeError("assignment to a non-name")  # 0.32.0 hf.py:380 assert: "string"
        return []
    if isinstance(target, nodes.Name) and _calls_namespace(value):
        return [f"{target.name}.{kwarg.key}" for kwarg in value.kwargs if _accesses(kwarg.value, var)]
    if isinstance(target, nodes.NSRef) and _accesses(value, var):
        return [f"{target.name}.{target.attr}"]
    return []


def _aliases(root: nodes.Template, var: str, namespace_aliases: bool) -> set[str]:
    """`var` and every name assigned from it, transitively (vLLM 0.32.0 keeps no set of the names
    it has seen and loops for ever on ``a = b; b = a``; 0.33.0 keeps one, as this does)."""
    found, todo = {var}, deque([var])
    while todo:
        current = todo.popleft()
        for assign in root.find_all(nodes.Assign):
            for alias in _assigned_aliases(assign, current, namespace_aliases):
                if alias not in found:
                    found.add(alias)
                    todo.append(alias)
    return found


def _content_loops(root: nodes.Template, namespace_aliases: bool) -> Iterator[nodes.For]:
    """Loops over a message's content: vllm/renderers/hf.py _iter_nodes_assign_content_item (the
    same in 0.32.0 :405-476 and 0.33.0 :493-564; only the aliases of `messages` differ)."""
    message_lists = _aliases(root, "messages", namespace_aliases)
    message_vars = {
        _loop_target(loop) for loop in root.find_all(nodes.For) if any(_accesses(loop.iter, v) for v in message_lists)
    }

    def is_content(node: nodes.Node) -> bool:
        return any(_accesses(node, v, "content") for v in message_vars)

    in_macros: set[int] = set()
    macro_params: dict[int, set[str]] = {}  # loop id -> macro parameters bound to content
    for macro in root.find_all(nodes.Macro):
        names = [arg.name for arg in macro.args]
        bound: set[str] = set()
        for call in root.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                bound |= {names[i] for i, a in enumerate(call.args[: len(names)]) if is_content(a)}
                bound |= {k.key for k in call.kwargs if k.key in names and is_content(k.value)}
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if bound:
                macro_params[id(loop)] = bound

    for loop in root.find_all(nodes.For):
        name = loop.iter.name if isinstance(loop.iter, nodes.Name) else None
        if (
            is_content(loop.iter)
            or (name is not None and name in macro_params.get(id(loop), ()))
            or (id(loop) not in in_macros and name == "content")
        ):
            _loop_target(loop)
            yield loop


@dataclass(frozen=True)
class _TemplateInfo:
    content_format: ContentFormat
    variables: frozenset[str]
    has_developer: bool


@lru_cache(maxsize=32)
def _template_info(template: str, namespace_aliases: bool) -> _TemplateInfo:
    """Parsed once per template text and release rule; the hot path only looks it up."""
    try:  # a request's own template is compiled in its budget: jinja2 folds constants as it compiles
        ast = _compile_for_render(template).environment.parse(template)
    except (jinja2.TemplateError, ImportError) as e:
        raise TokenizationError(f"chat template does not parse: {e}") from e
    try:
        fmt: ContentFormat = "openai" if next(_content_loops(ast, namespace_aliases), None) else "string"
    except TypeError:
        fmt = "string"
    return _TemplateInfo(
        content_format=fmt,
        variables=frozenset(jinja2.meta.find_undeclared_variables(ast)),
        has_developer='"developer"' in template or "'developer'" in template,
    )


# ---------------------------------------------------------------- messages


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    """vLLM drops the first line of Claude Code's per-request system header part."""
    out = []
    for part in parts:
        text = part if isinstance(part, str) else None
        if isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
        elif rest := text.partition("\n")[2]:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


@dataclass(frozen=True)
class MediaPlaceholder:
    """Where a media item was in a message (kvgate/multimodal.py puts it in the image part's
    place): an "openai"-format template gets vLLM's {"type": modality} part and writes the item's
    text itself; a "string"-format one gets `text`, the model's placeholder, where vLLM puts it
    (_full_multimodal_text)."""

    modality: str
    text: str
    part: dict[str, Any]  # the request's part: its fields vLLM does not know reach the template


def _full_multimodal_text(placeholders: list[str], texts: list[str]) -> str:
    """vLLM 0.32.0 / 0.33.0 renderers/chat_utils.py _get_full_multimodal_text_prompt (without
    --interleave-mm-strings): the text parts joined by "\n", and in front of them, each joined by
    "\n", the placeholders the text does not already hold."""
    text = "\n".join(texts)
    missing: list[str] = []
    for placeholder, count in Counter(placeholders).items():
        count -= text.count(placeholder)
        if count < 0:
            raise TokenizationError(
                f"Found more '{placeholder}' placeholders in input prompt than actual multimodal data items."
            )
        missing += [placeholder] * count
    return "\n".join([*missing, text] if text else missing)


def _part(part: Any, wrap: bool) -> Any:
    """One content part as vLLM keeps it: text (or a dict for "openai" templates), or None."""
    if isinstance(part, MediaPlaceholder):  # chat_utils.py _collect_extra_fields for the extras
        extra = {k: v for k, v in part.part.items() if k not in _KNOWN_PART_FIELDS}
        return {"type": part.modality, **extra} if wrap else part
    if isinstance(part, str):
        return {"type": "text", "text": part} if wrap else part
    if not isinstance(part, dict):
        raise TokenizationError("content parts must be objects or strings")
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        text = part.get(_TEXT_PARTS[kind])
        if text is None:
            return None
        if not isinstance(text, str):
            raise TokenizationError(f"content part {kind!r} needs a string")
        if not wrap:
            return text
        extra = {k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS}
        return {"type": "text", "text": text, **extra}
    if kind == "tool_reference":
        return {"type": "tool_reference", "name": part.get("name")} if wrap else part.get("name")
    if kind is None:
        raise TokenizationError("Missing 'type' field in content part.")
    raise TokenizationError(f"Unsupported content part type for a text model: {kind!r}")


def _content(role: str, content: Any, wrap: bool) -> str | list[Any]:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise TokenizationError("message content must be a string, a list of parts or null")
    if role == "system":
        parts = _strip_billing_header(parts)
    kept = [p for p in (_part(p, wrap) for p in parts) if p]
    if wrap:
        return kept
    placeholders = [p.text for p in kept if isinstance(p, MediaPlaceholder)]
    texts = [p for p in kept if not isinstance(p, MediaPlaceholder)]
    return _full_multimodal_text(placeholders, texts) if placeholders else "\n".join(texts)


def _tool_calls(calls: Any) -> list[dict]:
    """Copies with arguments parsed to dicts, as templates expect (vllm _postprocess_messages)."""
    if not isinstance(calls, list):
        raise TokenizationError("assistant tool_calls must be a list")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise TokenizationError("assistant tool_calls entries must be function objects")
        args = function.get("arguments")
        if isinstance(args, str) and args:
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None  # vLLM coerces bad history to {} rather than fail every later turn
        args = args if isinstance(args, dict) else {}
        out.append({**call, "function": {**function, "arguments": args}})
    return out


def _message(msg: dict[str, Any], wrap: bool) -> dict:
    """One message as vLLM hands it to the template (its role is a string: kvgate/openai.py)."""
    role = msg["role"]
    out: dict[str, Any] = {"role": role, "content": _content(role, msg.get("content"), wrap)}
    if role == "assistant":
        if msg.get("tool_calls") is not None:
            calls = _tool_calls(msg["tool_calls"])
            if calls:  # an empty list would steer templates off the plain assistant path
                out["tool_calls"] = calls
        if msg.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = msg["reasoning"]
    elif role == "tool":
        if "tool_call_id" in msg:
            out["tool_call_id"] = msg["tool_call_id"]
        parts = out["content"]
        if isinstance(parts, list) and all(p.get("type") == "text" for p in parts):
            out["content"] = "\n".join(p.get("text", "") for p in parts)
    for key in ("name", "task"):
        if isinstance(msg.get(key), str):
            out[key] = msg[key]
    if role == "developer":
        out["tools"] = msg.get("tools")
    return out


def _developer_as_system(conversation: list[dict]) -> list[dict]:
    """For templates without a developer role: developer -> system, systems merged first."""
    conversation = [
        {k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
        for m in conversation
    ]
    systems: list[Any] = []
    others: list[Any] = []
    merge = False
    for i, m in enumerate(conversation):
        if m["role"] != "system":
            others.append(m)
            continue
        merge = merge or i > 0 or bool(systems)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p if isinstance(p, str) else p["text"]
                for p in content
                if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
            )
        if content:
            systems.append(content)
    return [{"role": "system", "content": "\n\n".join(systems)}, *others] if merge else conversation


def _tool(tool: Any) -> dict:
    """A tool as vLLM's ChatCompletionToolsParam dumps it: fixed keys and order, None defaults."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise TokenizationError("each tool needs a 'function' object with a string 'name'")
    if tool.get("type", "function") != "function":
        raise TokenizationError("only tools of type 'function' are supported")
    if not isinstance(function.get("parameters"), dict | None):
        raise TokenizationError("tool parameters must be an object")
    defer = tool.get("defer_loading")
    out = {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    for key in ("strict", "defer_loading"):
        value = function.get(key, defer if key == "defer_loading" else None)
        if value is not None:
            out[key] = value
    dumped = {"type": "function", "function": out}
    return dumped if defer is None else dumped | {"defer_loading": defer}


def _merge(defaults: dict | None, overrides: dict | None) -> dict:
    """vllm.renderers.params.merge_kwargs: None and "auto" do not override."""
    overrides = overrides or {}
    return (defaults or {}) | {k: v for k, v in overrides.items() if v not in (None, "auto")}


def _template_error(exc: BaseException) -> str:
    """The template's own reason (e.g. raise_exception text), as vLLM reports it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)


def _template(tokenizer: Any, name_or_text: str | None, tools: list[dict] | None) -> str:
    try:
        return tokenizer.get_chat_template(name_or_text, tools=tools)
    except ValueError as e:
        raise TokenizationError(str(e)) from e


# Keys of a message whose string values transformers hands the template as they are.
_PLAIN_MESSAGE_KEYS = frozenset({"role", "content", "name"})
_PLAIN_VALUES = (str, bool, int, float, type(None))


@lru_cache(maxsize=8)
def _render_parameters(tokenizer_class: Any) -> frozenset[str]:
    """apply_chat_template's own parameters in the installed transformers: the request kwargs
    bearing these names are not template variables."""
    return frozenset(inspect.signature(tokenizer_class.apply_chat_template).parameters)


def _plain_kwargs(tokenizer: Any, kwargs: dict[str, Any]) -> bool:
    """Kwargs with which transformers' apply_chat_template (5.x: `_normalize_chat_messages`,
    `render_jinja_template`) hands the operator's template the messages unchanged (with
    _plain_messages): no final message to continue, no dict to return, no documents, plain
    values, apart from add_generation_prompt none of them one of its own parameters."""
    if kwargs.get("continue_final_message") or kwargs.get("return_dict"):
        return False
    if kwargs.get("documents") is not None:
        return False
    own = _render_parameters(tokenizer.__class__)
    return all(
        type(value) in _PLAIN_VALUES and (key not in own or key in _PLAIN_RENDER_KWARGS)
        for key, value in kwargs.items()
    )


def _plain_messages(conversation: list[dict]) -> bool:
    """Messages apply_chat_template hands the template as they are: role, content and name
    strings only (no None to drop, no reasoning field to alias, no object to turn into plain
    data)."""
    return bool(conversation) and all(
        type(message) is dict
        and all(type(value) is str and key in _PLAIN_MESSAGE_KEYS for key, value in message.items())
        for message in conversation
    )


# Parameters of apply_chat_template a plain render reads (continue_final_message and return_dict
# only when false, documents only when None).
_PLAIN_RENDER_KWARGS = frozenset({"add_generation_prompt", "continue_final_message", "return_dict", "documents"})


@dataclass(frozen=True)
class _Settled:
    """What render_chat works out from a chat's options, before its messages: the template to
    render with, the content format, the kwargs the template accepts. For a chat that sets none
    of the options (no template, tools, documents, kwargs or reasoning effort: most chats) it
    depends only on the tokenizer's template and the two generation flags, and ChatRenderer
    keeps it."""

    template: str
    wrap: bool  # the content format is "openai": content parts stay parts
    has_developer: bool  # the template knows the developer role
    kwargs: dict[str, Any]
    tools: list[dict] | None
    tokenize: Any
    plain: bool  # tools None, tokenize False, the model's template, _plain_kwargs


def _settle(tokenizer: Any, chat: ChatInput, namespace_aliases: bool) -> _Settled:
    tools = None if chat.tools is None else [_tool(t) for t in chat.tools]
    extra = {
        "add_generation_prompt": chat.add_generation_prompt,
        "continue_final_message": chat.continue_final_message,
        "documents": None if chat.documents is None else list(chat.documents),
        # vllm 0.32.0/0.33.0 chat_completion/protocol.py build_chat_params: the request's
        # reasoning_effort goes to the template, and turns thinking on (off for "none") unless the
        # request's kwargs say enable_thinking (0.33.0's --reasoning-effort-map is not followed)
        "reasoning_effort": chat.reasoning_effort,
    }
    if chat.reasoning_effort is not None and "enable_thinking" not in (chat.chat_template_kwargs or {}):
        extra["enable_thinking"] = chat.reasoning_effort != "none"
    request_kwargs = _merge(chat.chat_template_kwargs, extra)
    kwargs = _merge(_merge(None, {"tools": tools, "tokenize": False}), request_kwargs)
    kwargs = _merge(kwargs, {"chat_template": chat.chat_template, "return_dict": False})
    tools, tokenize = kwargs.pop("tools", None), kwargs.pop("tokenize", True)

    # vLLM picks the content format from the request's template, renders with kwargs'.
    fmt = _template_info(_template(tokenizer, chat.chat_template, tools), namespace_aliases).content_format
    template = _template(tokenizer, kwargs.pop("chat_template", None), tools)
    info = _template_info(template, namespace_aliases)
    accepted = info.variables | _HF_CHAT_PARAMS
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    plain = tools is None and tokenize is False and chat.chat_template is None and _plain_kwargs(tokenizer, kwargs)
    return _Settled(template, fmt == "openai", info.has_developer, kwargs, tools, tokenize, plain)


def _options_unset(chat: ChatInput) -> bool:
    """The chat sets none of the options but the two generation flags (ChatRenderer keeps what
    _settle makes of it)."""
    return (
        chat.chat_template is None
        and chat.tools is None
        and chat.documents is None
        and chat.chat_template_kwargs is None
        and chat.reasoning_effort is None
    )


def _message_of(msg: dict[str, Any], wrap: bool) -> dict:
    """_message, without its parts machinery for the commonest message: a string content and
    nothing else, of a role _message has no rule for (a system message's only when it does not
    start with the billing header vLLM strips). The string as one text part comes out as itself
    ("string" format; "" joins to "") or as that one part ("openai", an empty one too)."""
    role = msg["role"]
    content = msg.get("content")
    if (
        type(content) is str
        and len(msg) == 2
        and role not in ("assistant", "tool", "developer")
        and not (role == "system" and content.startswith(_BILLING_HEADER))
    ):
        if not wrap:
            return {"role": role, "content": content}
        return {"role": role, "content": [{"type": "text", "text": content}]}
    return _message(msg, wrap)


class ChatRenderer:
    """render_chat for one tokenizer, with what depends only on its template worked out once:
    the settled options of a chat that sets none, the compiled template's globals and the
    special tokens (kvgate/tokens.py LocalTokenizer keeps one for the tokenizer it loaded, and a
    new tokenizer gets a new renderer: nothing kept outlives the template it was made from).

    Working them out again for every chat was a third of its render: four merges of kwargs, the
    template's lookup, the special tokens map built from the tokenizer's attributes, and jinja's
    context made from the template's chained globals."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._settled: dict[tuple[bool, bool, bool], _Settled] = {}
        self._plain_context: dict[str, tuple[jinja2.Template, dict[str, Any]]] = {}

    def render(self, chat: ChatInput, namespace_aliases: bool = False) -> str | list[int]:
        """The prompt text vLLM renders for `chat` (token ids if kwargs say tokenize=True).
        `namespace_aliases`: the backend release's rule for the template's content format
        (VllmRuntime.content_format_namespace_aliases: vLLM 0.33.0 follows namespace aliases)."""
        if chat.add_generation_prompt and chat.continue_final_message:
            raise TokenizationError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        settled: _Settled | None = None
        key = None
        if _options_unset(chat):
            key = (chat.add_generation_prompt, chat.continue_final_message, namespace_aliases)
            settled = self._settled.get(key)
        if settled is None:
            settled = _settle(self.tokenizer, chat, namespace_aliases)
            if key is not None:
                self._settled[key] = settled
        conversation = [_message_of(m, settled.wrap) for m in chat.messages]
        if not settled.has_developer and any(m["role"] == "developer" for m in conversation):
            conversation = _developer_as_system(conversation)
        try:
            if settled.plain and _plain_messages(conversation):
                return self._render_plain(settled.template, conversation, settled.kwargs)
            return self.tokenizer.apply_chat_template(
                conversation=conversation,
                tools=settled.tools,
                chat_template=settled.template,
                tokenize=settled.tokenize,
                **settled.kwargs,
            )
        except MemoryError:  # the kernel's limit on a preparation worker: its grant, not a template error
            raise
        except Exception as e:  # template code raises anything; all of it is the request's fault
            raise TokenizationError(_template_error(e)) from e

    def _render_plain(self, template: str, conversation: list[dict], kwargs: dict[str, Any]) -> str:
        """What apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs)
        returns for a plain chat (_plain_kwargs, _plain_messages), without its copies of the conversation: the compiled template
        rendered with the messages, no tools or documents, the special tokens and the kwargs that
        are template variables (render_jinja_template's call). A fifth of a short chat's CPU was
        those copies (tests/unit/test_chat_render_plain.py compares the two).

        Rendered as jinja2's Template.render does (jinja2 3.1: a context whose parent is the
        template's globals updated with the variables, then its root render function), from a
        copy of globals and special tokens made once per template."""
        kept = self._plain_context.get(template)
        if kept is None:
            compiled = _transformers_compile(template)
            base = dict(compiled.globals)
            base.update(self.tokenizer.special_tokens_map)
            base.update(tools=None, documents=None)
            kept = self._plain_context[template] = (compiled, base)
        compiled, base = kept
        variables = base.copy()
        variables["messages"] = conversation
        variables["add_generation_prompt"] = kwargs.get("add_generation_prompt", False)
        variables.update((k, v) for k, v in kwargs.items() if k not in _PLAIN_RENDER_KWARGS)
        context = compiled.new_context(variables, shared=True)
        try:
            return compiled.environment.concat(compiled.root_render_func(context))
        except Exception:
            compiled.environment.handle_exception()
            raise  # handle_exception always raises


def render_chat(tokenizer: Any, chat: ChatInput, namespace_aliases: bool = False) -> str | list[int]:
    """The prompt text vLLM renders for `chat` (token ids if kwargs say tokenize=True), with
    nothing kept from one call to the next (ChatRenderer keeps what a tokenizer's chats share).
    `namespace_aliases`: the backend release's rule for the template's content format
    (VllmRuntime.content_format_namespace_aliases: vLLM 0.33.0 follows namespace aliases)."""
    return ChatRenderer(tokenizer).render(chat, namespace_aliases)
