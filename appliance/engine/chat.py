"""Turning chat messages into one prompt (pure: file reads, no IO framework).

* The model's own template: a GGUF's ``tokenizer.chat_template`` (a Jinja2 template, as Hugging Face writes it),
  read within bounds by :func:`read_chat_template` (with the text of its BOS and EOS tokens and of its control
  tokens) and rendered by :func:`render_prompt` in a sandboxed Jinja2 environment (``messages``, ``tools`` when the
  request has some, ``add_generation_prompt=True``, ``bos_token``, ``eos_token``, ``raise_exception``,
  ``strftime_now``). A template that does not compile or fails to render is a P4 ``BAD_REQUEST``
  (``details.param = "messages"``), never a 500.
* The plain fallback for a model without one (the tiny demo models): ``<role>: <content>`` lines, then
  ``assistant: ``. The generation prompt is a prefix of the assistant message the client sends back next turn
  (``assistant: <content>``), so a conversation's next prompt starts with the text it already holds.

A rendered prompt is an :class:`~appliance.engine.interface.Prompt`: the template's own text is ``special`` (its
control-token texts become control tokens), and the client's text (message contents, tool results, the strings of
call arguments) is not, whatever it holds. The template renders twice, once as it is and once with each client text
wrapped in private-use markers (inside its leading and trailing whitespace, which templates often trim): when
removing the markers gives the first text, they mark the client's spans exactly. When it does not (a template that
transforms the contents), a content that holds the text of a control token is located in the prompt, where it must
occur exactly once, and refused (``BAD_REQUEST``, ``details.param = "messages"``) otherwise. Client text the template
renders as its own (tool definitions, names, ids) is refused when it holds a control token's text.

Tools (:mod:`appliance.engine.toolcalls`): a template with a tool format of its own gets the tools as Hugging Face
passes them (``tools``: the OpenAI tool objects), assistant messages with ``tool_calls`` (OpenAI's shape; arguments
that are JSON parsed, as the templates read them) and ``role: tool`` messages (``tool_call_id``, ``name``,
``content``). A template without one (the generic format) gets a system message that describes the tools, past calls
as the assistant's JSON answers and each run of tool results as one user message (:func:`~appliance.engine.
toolcalls.calls_text`, :func:`~appliance.engine.toolcalls.results_text`). ``tool_choice: none`` renders no tools.

The runtime adds the BOS token itself, so a rendered prompt that starts with the BOS token's text loses it.
"""

from __future__ import annotations

import datetime
import functools
import json
import mmap
import os
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from appliance.engine import gguf_meta, toolcalls
from appliance.engine.interface import Prompt
from appliance.engine.toolcalls import Choice, Tool, ToolCall, ToolResult
from appliance.errors import ApplianceError

if TYPE_CHECKING:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_KEY = "tokenizer.chat_template"
BOS_KEY = "tokenizer.ggml.bos_token_id"
EOS_KEY = "tokenizer.ggml.eos_token_id"
TOKENS_KEY = "tokenizer.ggml.tokens"
TOKEN_TYPE_KEY = "tokenizer.ggml.token_type"
CONTROL_TYPES = frozenset({2, 3})  # llama.cpp's UNKNOWN and CONTROL: what only special=True tokenization matches
INT32_TYPE = 5  # a GGUF value type
MAX_RENDERED_CHARS = 16 * 1024 * 1024
"""A rendered prompt longer than this is refused while it renders (a template that loops would fill memory)."""


class ChatTurn(Protocol):
    role: str
    content: str


@dataclass(frozen=True)
class Turn:
    role: str
    content: str


@dataclass(frozen=True)
class Message:
    """A chat message as the request gave it: ``content`` is its text (a list of text parts: their texts, joined);
    an assistant message may hold ``tool_calls``, a ``tool`` message answers ``tool_call_id``."""

    role: str
    content: str | tuple[str, ...] | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    @property
    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(self.content)


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template (``source`` None: it has none), its BOS / EOS token texts and the texts of its control
    tokens (read with the template; empty without one: the plain format has no control tokens)."""

    source: str | None
    bos_token: str = ""
    eos_token: str = ""
    control_tokens: frozenset[str] = field(default_factory=frozenset)


PLAIN = ChatTemplate(None)
GENERATION_PROMPT = "assistant: "


def render_chat(messages: Iterable[ChatTurn]) -> str:
    """The plain fallback: ``<role>: <content>`` lines, then ``assistant: ``."""
    lines = [f"{message.role}: {message.content}" for message in messages]
    return "\n".join([*lines, GENERATION_PROMPT])


# -- the model's template ------------------------------------------------------------------------------------------


class _TemplateSkim(gguf_meta._Skim):
    """The bounded header skim of :mod:`~appliance.engine.gguf_meta` (same limits, same refusals), which also keeps
    the chat template, the BOS / EOS ids and where the token list starts."""

    def __init__(self, path: Path, view: mmap.mmap) -> None:
        super().__init__(path, view)
        self.template: str | None = None
        self.token_ids: dict[str, int] = {}
        self.tokens_at: tuple[int, int] | None = None  # (offset of the token list's first string, its count)
        self.types_at: tuple[int, int] | None = None  # (offset of the token types' first int32, their count)

    def value(self, key: str, *, keep: bool) -> Any:
        if key not in (TEMPLATE_KEY, BOS_KEY, EOS_KEY, TOKENS_KEY, TOKEN_TYPE_KEY):
            return super().value(key, keep=keep)
        start = self.pos
        value_type = self.scalar("<I", f"the type of {key}")
        if key == TEMPLATE_KEY and value_type == gguf_meta._STRING:
            raw = self.string(gguf_meta.MAX_STRING_BYTES, f"the string {key}")
            self.template = raw.decode("utf-8", errors="replace")
            return None
        if key == TOKENS_KEY and value_type == gguf_meta._ARRAY:
            item_type = self.scalar("<I", f"the item type of {key}")
            count = self.scalar("<Q", f"the length of {key}")
            if item_type == gguf_meta._STRING:
                self.tokens_at = (self.pos, count)
        if key == TOKEN_TYPE_KEY and value_type == gguf_meta._ARRAY:
            item_type = self.scalar("<I", f"the item type of {key}")
            count = self.scalar("<Q", f"the length of {key}")
            if item_type == INT32_TYPE:
                self.types_at = (self.pos, count)
        self.pos = start
        value = super().value(key, keep=key in (BOS_KEY, EOS_KEY))
        if key in (BOS_KEY, EOS_KEY) and gguf_meta._is_int(value):
            self.token_ids[key] = value
        return None

    def token_text(self, token_id: int | None) -> str:
        """The text of token ``token_id`` in the token list ("" when there is none); after :meth:`header`."""
        if token_id is None or self.tokens_at is None:
            return ""
        pos, count = self.tokens_at
        if not 0 <= token_id < count:
            return ""
        for _ in range(token_id):  # header() checked every length of the list
            (length,) = gguf_meta._LENGTH.unpack_from(self.view, pos)
            pos += gguf_meta._LENGTH.size + length
        (length,) = gguf_meta._LENGTH.unpack_from(self.view, pos)
        start = pos + gguf_meta._LENGTH.size
        return bytes(self.view[start:start + length]).decode("utf-8", errors="replace")


    def control_texts(self) -> frozenset[str]:
        """The texts of the control (and unknown) tokens; after :meth:`header`, which checked both arrays."""
        if self.tokens_at is None or self.types_at is None or self.tokens_at[1] != self.types_at[1]:
            return frozenset()
        pos, count = self.tokens_at
        types = struct.unpack_from(f"<{count}i", self.view, self.types_at[0])
        unpack = gguf_meta._LENGTH.unpack_from
        texts = []
        for token_type in types:
            (length,) = unpack(self.view, pos)
            start = pos + gguf_meta._LENGTH.size
            if token_type in CONTROL_TYPES and length:
                texts.append(bytes(self.view[start:start + length]).decode("utf-8", errors="replace"))
            pos = start + length
        return frozenset(texts)


def read_chat_template(path: str | os.PathLike[str]) -> ChatTemplate:
    """The chat template of the GGUF at ``path``, its BOS / EOS texts and (with a template) its control tokens'
    texts, read with the bounds of :func:`appliance.engine.gguf_meta.read_header`; raises its ``MODEL_LOAD_FAILED``
    for a bad file."""
    path = Path(path)
    if not gguf_meta.is_gguf(path):
        raise ApplianceError("MODEL_LOAD_FAILED", f"{path} is not a readable GGUF file", {"path": str(path)})
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            skim = _TemplateSkim(path, view)
            skim.header()
            control = skim.control_texts() if skim.template is not None else frozenset()
            return ChatTemplate(skim.template, skim.token_text(skim.token_ids.get(BOS_KEY)),
                                skim.token_text(skim.token_ids.get(EOS_KEY)), control)
    except (OSError, ValueError) as exc:  # the file changed or vanished meanwhile
        raise ApplianceError("MODEL_LOAD_FAILED", f"cannot read model file {path}: {exc}",
                             {"path": str(path)}) from exc


# -- rendering -----------------------------------------------------------------------------------------------------


class TemplateRaised(Exception):
    """``raise_exception(message)`` in a template: its message is meant for the client."""


def raise_exception(message: str) -> NoReturn:
    raise TemplateRaised(str(message))


def strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(str(fmt))


def to_json(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    """Hugging Face's ``tojson``: plain JSON (Jinja2's own escapes HTML characters)."""
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@functools.cache
def environment() -> ImmutableSandboxedEnvironment:
    """The sandbox templates render in, set up as Hugging Face's ``apply_chat_template`` does (built on the first
    template that renders: a process whose models have none never imports Jinja2)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = to_json
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def template_error(message: str, **details: Any) -> ApplianceError:
    return ApplianceError("BAD_REQUEST", message, {"param": "messages", **details})


@functools.lru_cache(maxsize=32)
def compiled(source: str) -> jinja2.Template:
    """``source`` compiled in the sandbox (cached: a model's template is compiled once)."""
    import jinja2

    try:
        return environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise template_error("the model's chat template does not compile",
                             reason=f"{type(exc).__name__} at line {getattr(exc, 'lineno', None)}") from None


def render_text(template: ChatTemplate, context: dict[str, Any]) -> str:
    """``template`` rendered with ``context`` (its source must not be None), bounded and with P4 errors."""
    assert template.source is not None
    program = compiled(template.source)
    pieces: list[str] = []
    size = 0
    try:
        for piece in program.generate({**context, "add_generation_prompt": True, "bos_token": template.bos_token,
                                       "eos_token": template.eos_token}):
            size += len(piece)
            if size > MAX_RENDERED_CHARS:
                raise template_error(f"the chat template renders over {MAX_RENDERED_CHARS} characters",
                                     max_rendered_chars=MAX_RENDERED_CHARS)
            pieces.append(piece)
    except TemplateRaised as exc:
        raise template_error(f"the model's chat template refused the messages: {exc}") from None
    except ApplianceError:
        raise
    except Exception as exc:  # a template is code: whatever it raises is its failure, not ours
        raise template_error("the model's chat template failed to render", reason=type(exc).__name__) from None
    return "".join(pieces)


# -- client text and its spans -------------------------------------------------------------------------------------

OPEN = "\ue000"
SEP = "\ue001"
CLOSE = "\ue002"
DIGIT_ZERO = 0xE010
MARKER_CHARS = re.compile("[\ue000-\ue01f]")
MARKED = re.compile("\ue000([\ue010-\ue019]+)\ue001(.*?)\ue002", re.DOTALL)
LOOKS_CONTROL = re.compile(r"<\|[^<>|\s]{1,64}\|>|\[/?[A-Z][A-Z_]{1,31}\]|</?s>|<unk>")
"""What a control token's text looks like, for a template whose tokens are not known (ChatTemplate built without
them): ``<|...|>``, ``[INST]``-like, ``<s>``, ``</s>``, ``<unk>``."""


@functools.lru_cache(maxsize=32)
def control_pattern(tokens: frozenset[str]) -> re.Pattern[str]:
    """What finds a control token's text: the model's own tokens, or :data:`LOOKS_CONTROL` without them."""
    if not tokens:
        return LOOKS_CONTROL
    return re.compile("|".join(re.escape(text) for text in sorted(tokens, key=len, reverse=True)))


class ClientText:
    """Wraps each client text given to the template in numbered markers (inside its leading and trailing
    whitespace), or leaves it as it is (``marked`` False); it remembers the texts either way."""

    def __init__(self, marked: bool) -> None:
        self.marked = marked
        self.texts: list[str] = []

    def __call__(self, text: str) -> str:
        self.texts.append(text)
        core = text.strip()
        if not self.marked or not core:
            return text
        lead = text[:len(text) - len(text.lstrip())]
        trail = text[len(text.rstrip()):]
        number = "".join(chr(DIGIT_ZERO + int(d)) for d in str(len(self.texts)))
        return f"{lead}{OPEN}{number}{SEP}{core}{CLOSE}{trail}"

    def value(self, value: Any) -> Any:
        """A parsed JSON value with every string (keys too) wrapped."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, dict):
            return {self(key): self.value(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.value(item) for item in value]
        return value


def as_message(message: Message | ChatTurn) -> Message:
    if isinstance(message, Message):
        return message
    return Message(message.role, message.content)


def template_message(message: Message, wrap: ClientText) -> dict[str, Any]:
    """A message as Hugging Face templates read one (only the keys it has)."""
    text = message.text
    item: dict[str, Any] = {"role": message.role}
    if text is None:
        item["content"] = None if message.tool_calls else ""
    else:
        item["content"] = wrap(text)
    if message.tool_calls:
        item["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": wrap.value(toolcalls.arguments_value(call.arguments))}}
            for call in message.tool_calls]
    if message.tool_call_id is not None:
        item["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        item["name"] = message.name
    return item


def template_context(messages: Sequence[Message], tools: Sequence[Tool], wrap: ClientText) -> dict[str, Any]:
    context: dict[str, Any] = {"messages": [template_message(m, wrap) for m in messages]}
    if tools:
        context["tools"] = [tool.openai() for tool in tools]
    return context


def exact_spans(marked: str, plain: str) -> list[tuple[str, bool]] | None:
    """The pieces the markers of ``marked`` show, when removing them gives ``plain``; None when they do not."""
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for match in MARKED.finditer(marked):
        pieces.append((marked[pos:match.start()], True))
        pieces.append((match.group(2), False))
        pos = match.end()
    pieces.append((marked[pos:], True))
    if any(MARKER_CHARS.search(text) for text, _ in pieces):
        return None  # a marker cut, moved or nested by the template
    if "".join(text for text, _ in pieces) != plain:
        return None
    return pieces


def located_spans(plain: str, texts: Iterable[str], control: re.Pattern[str]) -> list[tuple[str, bool]]:
    """The pieces of ``plain`` where each client text that holds a control token's text is found, exactly once
    (itself or without its edge whitespace); ``BAD_REQUEST`` when one is not."""
    spans: set[tuple[int, int]] = set()
    for text in texts:
        found = control.search(text)
        if found is None:
            continue
        for candidate in (text, text.strip()):
            if plain.count(candidate) == 1:
                at = plain.index(candidate)
                spans.add((at, at + len(candidate)))
                break
        else:
            raise template_error(f"a message holds the control token text {found.group(0)!r} where the chat template "
                                 "changes it: it cannot be told apart from the template's own", token=found.group(0))
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for start, end in sorted(spans):
        if start < pos:
            raise template_error("two messages holding control token texts overlap in the rendered prompt")
        pieces.append((plain[pos:start], True))
        pieces.append((plain[start:end], False))
        pos = end
    pieces.append((plain[pos:], True))
    return pieces


def check_own_text(messages: Sequence[Message], tools: Sequence[Tool], control: re.Pattern[str]) -> None:
    """Client text the template renders as its own text must hold no control token's text."""
    def check(text: str, param: str) -> None:
        found = control.search(text)
        if found is not None:
            raise ApplianceError("BAD_REQUEST", f"{param} holds the control token text {found.group(0)!r}",
                                 {"param": param, "token": found.group(0)})

    for index, tool in enumerate(tools):
        for text in strings(tool.openai()):
            check(text, f"tools[{index}]")
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        for position, call in enumerate(message.tool_calls):
            check(call.id, f"{where}.tool_calls[{position}].id")
            check(call.name, f"{where}.tool_calls[{position}].function.name")
        if message.tool_call_id is not None:
            check(message.tool_call_id, f"{where}.tool_call_id")
        if message.name is not None:
            check(message.name, f"{where}.name")


def strings(value: Any) -> Iterable[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def joined(pieces: Iterable[tuple[str, bool]]) -> tuple[tuple[str, bool], ...]:
    """Adjacent pieces of one kind merged, empty ones dropped."""
    out: list[tuple[str, bool]] = []
    for text, special in pieces:
        if not text:
            continue
        if out and out[-1][1] == special:
            out[-1] = (out[-1][0] + text, special)
        else:
            out.append((text, special))
    return tuple(out)


def without_bos(pieces: tuple[tuple[str, bool], ...], bos: str) -> tuple[tuple[str, bool], ...]:
    if bos and pieces and pieces[0][1] and pieces[0][0].startswith(bos):
        return joined([(pieces[0][0][len(bos):], True), *pieces[1:]])
    return pieces


# -- the generic tool format's messages ------------------------------------------------------------------------------

SYSTEM_PROBE = "appliance-system-probe"


@functools.lru_cache(maxsize=32)
def takes_system(template: ChatTemplate) -> bool:
    """The template renders a system message (some refuse one, or drop it)."""
    if template.source is None:
        return True
    probe = [Message("system", SYSTEM_PROBE), Message("user", "hi")]
    try:
        return SYSTEM_PROBE in render_text(template, template_context(probe, (), ClientText(False)))
    except ApplianceError:
        return False


def generic_messages(template: ChatTemplate, messages: Sequence[Message], tools: Sequence[Tool]) -> list[Message]:
    """``messages`` for a template without a tool format: calls and results as JSON texts, and the tools
    described in the system message (the first user message when the template takes none)."""
    out: list[Message] = []
    results: list[ToolResult] = []

    def flush() -> None:
        if results:
            out.append(Message("user", toolcalls.results_text(results)))
            results.clear()

    for message in messages:
        if message.role == "tool":
            results.append(ToolResult(message.tool_call_id, message.name, message.text or ""))
            continue
        flush()
        if message.tool_calls:
            out.append(Message(message.role, toolcalls.calls_text(message.tool_calls, message.text)))
        else:
            out.append(message)
    flush()
    if not tools:
        return out
    described = toolcalls.system_text(tools)
    if out and out[0].role == "system":
        out[0] = Message("system", f"{out[0].text or ''}\n\n{described}", name=out[0].name)
    elif takes_system(template):
        out.insert(0, Message("system", described))
    else:
        first = next((i for i, m in enumerate(out) if m.role == "user"), None)
        if first is None:
            out.insert(0, Message("user", described))
        else:
            out[first] = Message("user", f"{described}\n\n{out[first].text or ''}", name=out[first].name)
    return out


# -- rendering -----------------------------------------------------------------------------------------------------


def plain_pieces(messages: Sequence[Message]) -> list[tuple[str, bool]]:
    """The plain fallback (:func:`render_chat`) as pieces: the contents are the client's."""
    pieces: list[tuple[str, bool]] = []
    for message in messages:
        pieces.append((f"{message.role}: ", True))
        pieces.append((message.text or "", False))
        pieces.append(("\n", True))
    pieces.append((GENERATION_PROMPT, True))
    return pieces


def render_prompt(template: ChatTemplate, messages: Sequence[Message | ChatTurn], tools: Sequence[Tool] = (), *,
                  choice: Choice = "auto", history: bool = False) -> Prompt:
    """The prompt for ``messages`` (and ``tools``, unless ``choice`` is ``none``) under ``template`` (the plain
    fallback when it has no source), without a leading BOS token text, as pieces that mark the client's text (see
    the module docstring). Raises ``BAD_REQUEST`` (``param: messages``) when the template refuses or fails, and for
    client text that would become control tokens."""
    fmt = toolcalls.detect(template.source)
    shown = tuple(tools) if choice != "none" else ()
    prepared = [as_message(m) for m in messages]
    if not fmt.native:
        prepared = generic_messages(template, prepared, shown)
    if template.source is None:
        return Prompt(joined(plain_pieces(prepared)), history)
    native_tools = shown if fmt.native else ()
    control = control_pattern(template.control_tokens)
    check_own_text(prepared, native_tools, control)
    plain_texts = ClientText(marked=False)
    plain = render_text(template, template_context(prepared, native_tools, plain_texts))
    pieces: list[tuple[str, bool]] | None = None
    if not any(MARKER_CHARS.search(text) for text in plain_texts.texts):
        marked = render_text(template, template_context(prepared, native_tools, ClientText(marked=True)))
        pieces = exact_spans(marked, plain)
    if pieces is None:
        pieces = located_spans(plain, plain_texts.texts, control)
    return Prompt(without_bos(joined(pieces), template.bos_token), history)


def render_template(template: ChatTemplate, messages: Sequence[Message | ChatTurn]) -> str:
    """The text of :func:`render_prompt` (``messages`` without tools)."""
    return render_prompt(template, messages).text
