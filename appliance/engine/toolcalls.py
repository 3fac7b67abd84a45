"""Tool calls (pure): how each chat template's model writes a call, as one table of :class:`Format` s.

A format says how it is detected from the template source, which texts the output must show (control tokens such as
``[TOOL_CALLS]`` the runtime renders as text), how its grammar is built, where a lazy grammar starts, and how its
output is parsed, whole or as it streams. The formats, in detection order:

* ``hermes`` (Hermes 2/3, Qwen 2.5, QwQ, Qwen 3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one
  block per call, after optional text;
* ``mistral-args-id`` (Mistral Small 3.2) and ``mistral-args`` (Devstral, Ministral 3):
  ``[TOOL_CALLS]name[CALL_ID]<9 characters>[ARGS]{...}`` per call, without ``[CALL_ID]`` and its id for the second;
* ``mistral`` (Mistral Nemo, 7B v0.3): ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "<9 characters>"}]``;
* ``llama3`` (Llama 3.1 to 3.3): the answer is ``{"name": ..., "parameters": {...}}``, or ``<|python_tag|>`` then
  that JSON; one call per answer (its template refuses a history with several);
* ``generic`` (every other template, and models without one): the tools are described in a system message
  (:func:`system_text`) and the whole answer is one JSON object, ``{"tool_calls": [{"name": ..., "arguments":
  {...}}]}`` or ``{"response": "..."}``; past calls and results are written into the conversation as JSON texts
  (:func:`calls_text`, :func:`results_text`).

:func:`grammar` builds, for ``tool_choice`` ``required`` or a named function, a grammar that only spells valid calls
(one, or one or more with ``parallel``) whose arguments follow each tool's JSON Schema (:mod:`appliance.engine.
structured`); for ``auto`` the same grammar made lazy: free text until the format's marker, then only calls (the
generic format, whose answer is all JSON, is never lazy: ``auto`` lets it answer ``{"response": ...}``); ``none``
has no grammar. A lazy grammar's trigger patterns (searched in what the model wrote so far) end with ``$`` and match
only a prefix the grammar accepts (the marker, then at most the fixed text that follows it up to the arguments):
llama.cpp feeds the text from the match on to the grammar, and a text the grammar refuses there aborts the process.

:func:`parse` reads a finished output, :class:`StreamParser` the same text as it arrives; both are the one parser,
so a streamed answer ends as the whole one does. Text outside calls is content; whitespace at the start and end of
the content and next to a call is dropped (text that resumes after a call follows a newline); a marker not followed
by a call stays content. A call is a call once its
name is read: its arguments are the JSON text the model wrote (cut short if the output was). Call ids are new
(``call_`` and 24 letters or digits; the Mistral formats' templates want 9 letters or digits): the model's own ids
are not kept.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from appliance.engine import structured
from appliance.engine.interface import Grammar
from appliance.errors import ApplianceError

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
MAX_DESCRIPTION_CHARS = 64 * 1024  # agent CLIs describe a tool in up to ~19k characters (Claude Code's Workflow)
ID_ALPHABET = string.ascii_letters + string.digits
WS_RULE = r"[ \t\n]{0,3}"
"""Whitespace between the parts of a call, in the grammar and, the same, in the trigger patterns."""
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def bad(param: str, message: str, **details: Any) -> ApplianceError:
    return ApplianceError("BAD_REQUEST", message, {"param": param, **details})


# -- tools, calls, choices -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A function the model may call: OpenAI's ``{"type": "function", "function": {...}}``."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))  # JSON Schema (an object)

    def openai(self) -> dict[str, Any]:
        """The tool as Hugging Face templates read ``tools`` (a description always, parameters always)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made (or an assistant message of the history holds): ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Named:
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: that function must be called."""

    name: str


Choice = Literal["auto", "none", "required"] | Named


def parse_tools(value: Any, param: str = "tools") -> tuple[Tool, ...]:
    """OpenAI's ``tools`` (None or a list of function tools), each checked (its parameters with
    :func:`appliance.engine.structured.schema_rules`, relaxed as :func:`~appliance.engine.structured.relax` says;
    what a grammar cannot enforce beyond that is refused). ``strict`` is
    accepted and changes nothing: the arguments of a call under a grammar always follow the schema."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad(param, f"{param} must be a list of at most {MAX_TOOLS} tools", max_items=MAX_TOOLS)
    tools: list[Tool] = []
    for index, item in enumerate(value):
        where = f"{param}[{index}]"
        if not isinstance(item, dict) or item.get("type") != "function" or set(item) - {"type", "function"}:
            raise bad(where, f'{where} must be {{"type": "function", "function": {{...}}}}')
        function = item.get("function")
        if not isinstance(function, dict):
            raise bad(f"{where}.function", f"{where}.function must be an object")
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise bad(f"{where}.function.{unknown[0]}", f"unknown field {where}.function.{unknown[0]}")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"{where}.function.name", f"{where}.function.name must be 1 to 64 letters, digits, _ or -")
        if any(tool.name == name for tool in tools):
            raise bad(f"{where}.function.name", f"two tools are named {name!r}")
        description = function.get("description", "")
        if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS:
            raise bad(f"{where}.function.description",
                      f"{where}.function.description must be a string of at most {MAX_DESCRIPTION_CHARS} characters")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise bad(f"{where}.function.strict", f"{where}.function.strict must be a boolean")
        parameters = function.get("parameters", dict(EMPTY_PARAMETERS))
        check_parameters(parameters, f"{where}.function.parameters")
        tools.append(Tool(name, description, parameters))
    return tuple(tools)


def check_parameters(parameters: Any, param: str) -> None:
    """A tool's ``parameters``: a JSON Schema of an object that a grammar can enforce."""
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise bad(param, f'{param} must be a JSON Schema of an object ("type": "object")')
    structured.schema_rules(parameters, param, relaxed=True)


def parse_choice(value: Any, tools: Sequence[Tool], param: str = "tool_choice") -> Choice:
    """OpenAI's ``tool_choice``: ``auto`` (the default), ``none``, ``required`` or a named function among
    ``tools``; ``required`` and a named function need tools."""
    if value is None:
        return "auto"
    if value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise bad(param, "tool_choice 'required' needs tools")
        return value  # type: ignore[return-value]
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "function"}:
        function = value["function"]
        if isinstance(function, dict) and set(function) == {"name"} and isinstance(function["name"], str):
            name = function["name"]
            if not any(tool.name == name for tool in tools):
                raise bad(f"{param}.function.name", f"tool_choice names {name!r}, which is not among the tools")
            return Named(name)
    raise bad(param, 'tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                     '{"name": ...}}')


def call_id() -> str:
    return "call_" + "".join(secrets.choice(ID_ALPHABET) for _ in range(24))


def short_id() -> str:
    """The 9 letters or digits the Mistral templates require of a call id."""
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(9))


# -- events --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    """A call begins: its index in the answer (0, 1, ...), its new id and the function's name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """The next piece of call ``index``'s arguments (JSON text)."""

    index: int
    text: str


Event = Content | CallStart | CallArguments


class _Events:
    """The events a parser emits, with the content's whitespace rule (dropped at the start and end, and next to a
    call): trailing whitespace is held back until text follows it."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self.new_id = new_id
        self.items: list[Event] = []
        self.held = ""  # trailing whitespace of the content, not sent yet
        self.leading = True  # at the start, or right after a call: leading whitespace is dropped
        self.sent_content = False
        self.calls = 0
        self.has_arguments: set[int] = set()

    def content(self, text: str) -> None:
        """Content text; text that resumes after a call is set apart from the content before it by a newline."""
        if not text:
            return
        joined = self.held + text
        body = joined.rstrip()
        self.held = joined[len(body):]
        if self.leading:
            body = body.lstrip()
            if body and self.sent_content:
                body = "\n" + body
        if body:
            self.leading = False
            self.sent_content = True
            self.items.append(Content(body))

    def start(self, name: str) -> int:
        self.held = ""
        self.leading = True
        index = self.calls
        self.calls += 1
        self.items.append(CallStart(index, self.new_id(), name))
        return index

    def arguments(self, index: int, text: str) -> None:
        if text:
            self.has_arguments.add(index)
            self.items.append(CallArguments(index, text))

    def end_call(self, index: int) -> None:
        if index not in self.has_arguments:
            self.arguments(index, "{}")


# -- reading text as it comes ----------------------------------------------------------------------------------------


class _Input:
    """The text so far (all of it: a failed call goes back to content) and the reading position."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.done = False


Reader = Generator[None, None, Any]
"""A parsing step: it yields (nothing) when it needs more text, and returns its result."""
Sink = Callable[[str], None]


def peek(inp: _Input) -> Generator[None, None, str]:
    """The next character ("" at the end of the output), not consumed."""
    while inp.pos >= len(inp.text):
        if inp.done:
            return ""
        yield
    return inp.text[inp.pos]


def skip_ws(inp: _Input) -> Reader:
    while (yield from peek(inp)) in (" ", "\t", "\n", "\r"):
        inp.pos += 1


def literal(inp: _Input, text: str) -> Generator[None, None, bool]:
    """Consume ``text`` if it comes next; else leave the position as it was."""
    start = inp.pos
    for expected in text:
        if (yield from peek(inp)) != expected:
            inp.pos = start
            return False
        inp.pos += 1
    return True


def json_string(inp: _Input) -> Generator[None, None, str | None]:
    """A JSON string (at its ``"``), decoded; None when it is not one."""
    start = inp.pos
    inp.pos += 1
    escaped = False
    while True:
        c = yield from peek(inp)
        if not c:
            return None
        inp.pos += 1
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            break
    try:
        value = json.loads(inp.text[start:inp.pos])
    except ValueError:
        return None
    return value if isinstance(value, str) else None


SCALAR = frozenset("0123456789+-.eEtruefalsn")


def json_value(inp: _Input, sink: Sink | None) -> Generator[None, None, bool]:
    """Scan one JSON value's text, passing it to ``sink`` in pieces as it arrives (before each wait for more);
    True when it ended, False when it is not one or the output ended inside it."""
    first = yield from peek(inp)
    if not first or first not in '{["-0123456789tfn':
        return False
    scalar = first not in '{["'
    depth = 0
    in_string = False
    escaped = False
    sent = inp.pos

    def flush() -> None:
        nonlocal sent
        if sink is not None and inp.pos > sent:
            sink(inp.text[sent:inp.pos])
        sent = inp.pos

    while True:
        if inp.pos >= len(inp.text):
            flush()
            if inp.done:
                return scalar  # a number or a literal ends with the output; nothing else does
            yield
            continue
        c = inp.text[inp.pos]
        if scalar:
            if c not in SCALAR:
                flush()
                return True
        elif in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    inp.pos += 1
                    flush()
                    return True
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                inp.pos += 1
                flush()
                return depth == 0
        inp.pos += 1


ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def json_string_decoded(inp: _Input, sink: Sink) -> Generator[None, None, bool]:
    """A JSON string (at its ``"``) passed decoded to ``sink`` as it arrives; True when it closed."""
    inp.pos += 1
    pending: list[str] = []
    while True:
        if inp.pos >= len(inp.text) and pending:  # about to wait: send what is decoded
            sink("".join(pending))
            pending.clear()
        c = yield from peek(inp)
        if not c:
            sink("".join(pending))
            return False
        if c == '"':
            inp.pos += 1
            sink("".join(pending))
            return True
        if c != "\\":
            pending.append(c)
            inp.pos += 1
            continue
        start = inp.pos
        kind = yield from peek_at(inp, 1)
        if kind in ESCAPES:
            pending.append(ESCAPES[kind])
            inp.pos += 2
            continue
        if kind != "u":
            return False
        unit = yield from hex_unit(inp, start)
        if unit is None:
            return False
        if 0xD800 <= unit < 0xDC00:  # a high surrogate: its low half follows as another \uXXXX
            low = yield from hex_unit(inp, inp.pos)
            if low is None or not 0xDC00 <= low < 0xE000:
                return False
            unit = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
        pending.append(chr(unit))


def peek_at(inp: _Input, offset: int) -> Generator[None, None, str]:
    while inp.pos + offset >= len(inp.text):
        if inp.done:
            return ""
        yield
    return inp.text[inp.pos + offset]


def hex_unit(inp: _Input, start: int) -> Generator[None, None, int | None]:
    """The ``\\uXXXX`` at ``start``: its value, the position after it; None when it is not one."""
    inp.pos = start
    while len(inp.text) < start + 6:
        if inp.done:
            return None
        yield
    text = inp.text[start:start + 6]
    if text[:2] != "\\u" or not all(d in string.hexdigits for d in text[2:]):
        return None
    inp.pos = start + 6
    return int(text[2:], 16)


def content_until(inp: _Input, out: _Events, markers: Sequence[str]) -> Generator[None, None, str | None]:
    """Send content up to the first of ``markers`` and consume it: the marker, or None at the end of the output. A
    tail that may be the start of a marker waits for the text after it."""
    while True:
        found = [(inp.text.find(m, inp.pos), m) for m in markers]
        hits = [(at, m) for at, m in found if at >= 0]
        if hits:
            at, marker = min(hits)
            out.content(inp.text[inp.pos:at])
            inp.pos = at + len(marker)
            return marker
        if inp.done:
            out.content(inp.text[inp.pos:])
            inp.pos = len(inp.text)
            return None
        hold = max((n for m in markers for n in range(1, len(m)) if inp.text.endswith(m[:n])), default=0)
        hold = min(hold, len(inp.text) - inp.pos)
        out.content(inp.text[inp.pos:len(inp.text) - hold])
        inp.pos = len(inp.text) - hold
        yield


NAME_KEY = "name"
LEADING_KEYS = ("type", "id")
"""Keys a call's object may hold before its name (Llama 3's ``"type": "function"``)."""


def call_object(inp: _Input, out: _Events, argument_keys: tuple[str, ...]) -> Generator[None, None, bool]:
    """A call written as a JSON object (at its ``{``): ``name``, then the arguments under one of ``argument_keys``
    (streamed once the name is known), other keys skipped. False, at the position it started, when no call was
    read; True once a call started (it then ends where the object does, or where the text stops making sense)."""
    begin = inp.pos
    inp.pos += 1
    name: str | None = None
    index: int | None = None
    early: list[str] = []  # arguments written before the name
    first = True

    def failed() -> bool:
        if index is None:
            inp.pos = begin
            return False
        out.end_call(index)
        return True

    def send(text: str) -> None:
        assert index is not None
        out.arguments(index, text)

    while True:
        yield from skip_ws(inp)
        c = yield from peek(inp)
        if c == "}":
            inp.pos += 1
            break
        if not first:
            if c != ",":
                return failed()
            inp.pos += 1
            yield from skip_ws(inp)
            c = yield from peek(inp)
        first = False
        if c != '"':
            return failed()
        key = yield from json_string(inp)
        if index is None and key not in (NAME_KEY, *argument_keys, *LEADING_KEYS):
            return failed()  # not a call: the text goes back to content at once
        yield from skip_ws(inp)
        if key is None or not (yield from literal(inp, ":")):
            return failed()
        yield from skip_ws(inp)
        if key == NAME_KEY and name is None:
            if (yield from peek(inp)) != '"':
                return failed()
            name = yield from json_string(inp)
            if name is None:
                return failed()
            index = out.start(name)
            for piece in early:
                out.arguments(index, piece)
        elif key in argument_keys and index is not None:
            if not (yield from json_value(inp, send)):
                return failed()
        elif key in argument_keys:
            if not (yield from json_value(inp, early.append)):
                return failed()
        elif not (yield from json_value(inp, None)):
            return failed()
    if index is None:
        inp.pos = begin
        return False
    out.end_call(index)
    return True


# -- the formats' parsers ------------------------------------------------------------------------------------------

Parser = Callable[[_Input, _Events], Reader]


def parse_hermes(inp: _Input, out: _Events) -> Reader:
    while True:
        marker = yield from content_until(inp, out, ("<tool_call>",))
        if marker is None:
            return
        mark = inp.pos - len(marker)
        yield from skip_ws(inp)
        if (yield from peek(inp)) == "{" and (yield from call_object(inp, out, ("arguments", "parameters"))):
            yield from skip_ws(inp)
            yield from literal(inp, "</tool_call>")
        else:
            out.content(inp.text[mark:inp.pos])


def parse_mistral(inp: _Input, out: _Events) -> Reader:
    while True:
        marker = yield from content_until(inp, out, ("[TOOL_CALLS]",))
        if marker is None:
            return
        mark = inp.pos - len(marker)
        yield from skip_ws(inp)
        if not (yield from literal(inp, "[")):
            out.content(inp.text[mark:inp.pos])
            continue
        calls = 0
        while True:
            yield from skip_ws(inp)
            if (yield from peek(inp)) != "{" or not (yield from call_object(inp, out, ("arguments",))):
                break
            calls += 1
            yield from skip_ws(inp)
            if not (yield from literal(inp, ",")):
                break
        if calls == 0:
            out.content(inp.text[mark:inp.pos])
            continue
        yield from skip_ws(inp)
        yield from literal(inp, "]")


MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def parse_mistral_args(inp: _Input, out: _Events) -> Reader:
    while True:
        marker = yield from content_until(inp, out, ("[TOOL_CALLS]",))
        if marker is None:
            return
        mark = inp.pos - len(marker)
        name = yield from read_until(inp, "[", 64)
        ok = name is not None and MISTRAL_NAME.fullmatch(name) is not None
        if ok and (yield from literal(inp, "[CALL_ID]")):
            ident = yield from read_until(inp, "[", 64)
            ok = ident is not None
        if not ok or not (yield from literal(inp, "[ARGS]")):
            out.content(inp.text[mark:inp.pos])
            continue
        assert name is not None
        index = out.start(name)

        def send(text: str, index: int = index) -> None:
            out.arguments(index, text)

        yield from skip_ws(inp)
        yield from json_value(inp, send)
        out.end_call(index)


def read_until(inp: _Input, stop: str, limit: int) -> Generator[None, None, str | None]:
    """The text up to ``stop`` (not consumed), at most ``limit`` characters; None when there is none."""
    start = inp.pos
    while True:
        c = yield from peek(inp)
        if c == stop:
            return inp.text[start:inp.pos]
        if not c or inp.pos - start >= limit:
            return None
        inp.pos += 1


def parse_llama3(inp: _Input, out: _Events) -> Reader:
    yield from skip_ws(inp)
    yield from llama3_calls(inp, out)
    while True:
        marker = yield from content_until(inp, out, ("<|python_tag|>",))
        if marker is None:
            return
        mark = inp.pos - len(marker)
        yield from skip_ws(inp)
        if not (yield from llama3_calls(inp, out)):
            out.content(inp.text[mark:inp.pos])


def llama3_calls(inp: _Input, out: _Events) -> Generator[None, None, bool]:
    """Calls at this point (JSON objects, ``;`` or whitespace between them); False when there is none."""
    calls = 0
    while (yield from peek(inp)) == "{" and (yield from call_object(inp, out, ("parameters", "arguments"))):
        calls += 1
        yield from skip_ws(inp)
        if (yield from literal(inp, ";")):
            yield from skip_ws(inp)
    return calls > 0


def parse_generic(inp: _Input, out: _Events) -> Reader:
    yield from skip_ws(inp)
    begin = inp.pos
    if (yield from peek(inp)) == "{" and (yield from generic_answer(inp, out)):
        yield from content_until(inp, out, ())
        return
    inp.pos = begin
    yield from content_until(inp, out, ())


def generic_answer(inp: _Input, out: _Events) -> Generator[None, None, bool]:
    """``{"tool_calls": [...]}`` and / or ``{"response": "..."}`` (at its ``{``); False, at its start, when the
    answer is not one (nothing was sent)."""
    begin = inp.pos
    inp.pos += 1
    sent = len(out.items)
    first = True
    while True:
        yield from skip_ws(inp)
        c = yield from peek(inp)
        if c == "}":
            inp.pos += 1
            break
        if not first:
            if c != ",":
                break
            inp.pos += 1
            yield from skip_ws(inp)
            c = yield from peek(inp)
        first = False
        if c != '"':
            break
        key = yield from json_string(inp)
        yield from skip_ws(inp)
        if key is None or not (yield from literal(inp, ":")):
            break
        yield from skip_ws(inp)
        value = yield from peek(inp)
        if key == "tool_calls" and value == "[":
            inp.pos += 1
            while True:
                yield from skip_ws(inp)
                if (yield from peek(inp)) != "{" or not (yield from call_object(inp, out, ("arguments",))):
                    break
                yield from skip_ws(inp)
                if not (yield from literal(inp, ",")):
                    break
            yield from skip_ws(inp)
            if not (yield from literal(inp, "]")):
                break
        elif key == "tool_call" and value == "{":
            if not (yield from call_object(inp, out, ("arguments",))):
                break
        elif key == "response" and value == '"':
            if not (yield from json_string_decoded(inp, out.content)):
                break
        elif not (yield from json_value(inp, None)):
            break
    if len(out.items) == sent:
        inp.pos = begin
        return False
    return True


# -- grammars and their triggers -----------------------------------------------------------------------------------


def gbnf_text(text: str) -> str:
    """``text`` as a grammar literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def json_key(key: str, value_rule: str) -> str:
    """A JSON member ``"key": value`` in the grammar (whitespace as :data:`WS_RULE`)."""
    return f'{gbnf_text(json.dumps(key))} ws ":" ws {value_rule}'


def json_call(name: str, argument_key: str, arguments: str, extra: str = "") -> str:
    members = [json_key("name", gbnf_text(json.dumps(name))), json_key(argument_key, arguments)]
    if extra:
        members.append(extra)
    return '"{" ws ' + ' ws "," ws '.join(members) + ' ws "}"'


Atom = str
"""One step of a trigger pattern: a regex that matches one character, or :data:`WS_RULE`."""


REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}")


def atoms(text: str) -> list[Atom]:
    return ["\\" + c if c in REGEX_SPECIAL else c for c in text]


def json_atoms(*parts: str | None) -> list[Atom]:
    """The fixed JSON text of a call as pattern atoms: ``None`` is whitespace, a string is literal text."""
    out: list[Atom] = []
    for part in parts:
        out.extend([WS_RULE] if part is None else atoms(part))
    return out


def prefix_closed(sequences: Sequence[Sequence[Atom]]) -> str:
    """A regex matching every prefix of every one of ``sequences`` (a trie of optional groups)."""
    trie: dict[Atom, Any] = {}
    for sequence in sequences:
        node = trie
        for atom in sequence:
            node = node.setdefault(atom, {})

    def emit(node: dict[Atom, Any]) -> str:
        if not node:
            return ""
        options = [atom + emit(child) for atom, child in node.items()]
        return "(?:" + "|".join(options) + ")?"

    return emit(trie)


@dataclass(frozen=True)
class Format:
    """One way of writing tool calls (see the module docstring)."""

    name: str
    detect: Callable[[str], bool]  # from the template source
    markers: tuple[str, ...]  # texts of the output a runtime must render as text, control tokens included
    parallel: bool  # several calls in one answer
    native: bool  # the template itself renders tools, calls and results
    call: Callable[[str, str], str]  # a call of the tool (name, its arguments rule) as a grammar body
    rules: Callable[[bool, bool], dict[str, str]]  # (parallel, auto) -> the rules above ``call``, root included
    triggers: Callable[[Sequence[str]], tuple[str, ...]]  # tool names -> the lazy grammar's trigger patterns
    parser: Parser
    new_id: Callable[[], str] = call_id


def hermes_rules(parallel: bool, auto: bool) -> dict[str, str]:
    return {"root": "tool-call (ws tool-call)*" if parallel else "tool-call",
            "tool-call": '"<tool_call>" ws call ws "</tool_call>"'}


def hermes_triggers(names: Sequence[str]) -> tuple[str, ...]:
    tails = [json_atoms(None, "{", None, '"name"', None, ":", None, f'"{name}"', None, ",", None, '"arguments"',
                        None, ":", None) for name in names]
    return ("(<tool_call>" + prefix_closed(tails) + ")$",)


def mistral_rules(parallel: bool, auto: bool) -> dict[str, str]:
    more = ' (ws "," ws call)*' if parallel else ""
    return {"root": f'"[TOOL_CALLS]" ws "[" ws call{more} ws "]"', "call-id": '"\\"" [a-zA-Z0-9]{9} "\\""'}


def mistral_triggers(names: Sequence[str]) -> tuple[str, ...]:
    tails = [json_atoms(None, "[", None, "{", None, '"name"', None, ":", None, f'"{name}"', None, ",", None,
                        '"arguments"', None, ":", None) for name in names]
    return (r"(\[TOOL_CALLS\]" + prefix_closed(tails) + ")$",)


def mistral_args_rules(parallel: bool, auto: bool) -> dict[str, str]:
    return {"root": "tool-call+" if parallel else "tool-call", "tool-call": '"[TOOL_CALLS]" call',
            "call-id": "[a-zA-Z0-9]{9}"}


def mistral_args_call(with_id: bool) -> Callable[[str, str], str]:
    def call(name: str, arguments: str) -> str:
        ident = ' "[CALL_ID]" call-id' if with_id else ""
        return f'{gbnf_text(name)}{ident} "[ARGS]" {arguments}'

    return call


def mistral_args_triggers(with_id: bool) -> Callable[[Sequence[str]], tuple[str, ...]]:
    def triggers(names: Sequence[str]) -> tuple[str, ...]:
        ident = [*atoms("[CALL_ID]"), *["[a-zA-Z0-9]"] * 9] if with_id else []
        tails = [[*atoms(name), *ident, *atoms("[ARGS]")] for name in names]
        return (r"(\[TOOL_CALLS\]" + prefix_closed(tails) + ")$",)

    return triggers


def llama3_rules(parallel: bool, auto: bool) -> dict[str, str]:
    return {"root": '"<|python_tag|>" ws call | call'}


def llama3_triggers(names: Sequence[str]) -> tuple[str, ...]:
    rest = [json_atoms(f'{name}"', None, ",", None, '"parameters"', None, ":", None) for name in names]
    start = "".join(json_atoms("{", None, '"name"', None, ":", None, '"'))
    tagged = [json_atoms(None, "{", None, '"name"', None, ":", None, f'"{name}"', None, ",", None, '"parameters"',
                         None, ":", None) for name in names]
    return ("^[ \\t\\n]*(" + start + prefix_closed(rest) + ")$", r"(<\|python_tag\|>" + prefix_closed(tagged) + ")$")


def generic_rules(parallel: bool, auto: bool) -> dict[str, str]:
    more = ' (ws "," ws call)*' if parallel else ""
    calls = f'"{{" ws {gbnf_text(json.dumps("tool_calls"))} ws ":" ws "[" ws call{more} ws "]" ws "}}"'
    rules = {"root": calls}
    if auto:
        rules["root"] = f'{calls} | "{{" ws {gbnf_text(json.dumps("response"))} ws ":" ws response ws "}}"'
        rules["response"] = '"\\"" response-char* "\\""'
        rules["response-char"] = structured.CHAR_RULE
    return rules


def no_triggers(names: Sequence[str]) -> tuple[str, ...]:
    return ()


def detect_hermes(source: str) -> bool:
    return "<tool_call>" in source and "<function=" not in source and "<arg_key>" not in source


def detect_mistral_args(source: str) -> bool:
    return "[TOOL_CALLS]" in source and "[ARGS]" in source


def detect_mistral_args_id(source: str) -> bool:
    return detect_mistral_args(source) and "[CALL_ID]" in source


def detect_mistral(source: str) -> bool:
    return "[TOOL_CALLS]" in source


def detect_llama3(source: str) -> bool:
    return "<|start_header_id|>" in source and "ipython" in source


def detect_any(source: str) -> bool:
    return True


def json_call_of(argument_key: str, extra: str = "") -> Callable[[str, str], str]:
    def call(name: str, arguments: str) -> str:
        return json_call(name, argument_key, arguments, extra)

    return call


HERMES = Format("hermes", detect_hermes, ("<tool_call>", "</tool_call>"), True, True, json_call_of("arguments"),
                hermes_rules, hermes_triggers, parse_hermes)
MISTRAL_ARGS_ID = Format("mistral-args-id", detect_mistral_args_id, ("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"), True,
                         True, mistral_args_call(True), mistral_args_rules, mistral_args_triggers(True),
                         parse_mistral_args, short_id)
MISTRAL_ARGS = Format("mistral-args", detect_mistral_args, ("[TOOL_CALLS]", "[ARGS]"), True, True,
                      mistral_args_call(False), mistral_args_rules, mistral_args_triggers(False), parse_mistral_args,
                      short_id)
MISTRAL = Format("mistral", detect_mistral, ("[TOOL_CALLS]",), True, True,
                 json_call_of("arguments", json_key("id", "call-id")), mistral_rules, mistral_triggers,
                 parse_mistral, short_id)
LLAMA3 = Format("llama3", detect_llama3, ("<|python_tag|>",), False, True, json_call_of("parameters"), llama3_rules,
                llama3_triggers, parse_llama3)
GENERIC = Format("generic", detect_any, (), True, False, json_call_of("arguments"), generic_rules, no_triggers,
                 parse_generic)
FORMATS = (HERMES, MISTRAL_ARGS_ID, MISTRAL_ARGS, MISTRAL, LLAMA3, GENERIC)
"""The table, in detection order: the first whose ``detect`` accepts the template source is its format."""


def detect(template_source: str | None) -> Format:
    """The call format of a chat template (:data:`GENERIC` without one)."""
    if template_source is None:
        return GENERIC
    return next(fmt for fmt in FORMATS if fmt.detect(template_source))


def grammar(fmt: Format, tools: Sequence[Tool], choice: Choice, parallel: bool) -> Grammar | None:
    """The grammar of ``fmt``'s calls for ``choice`` (see the module docstring); None for ``none`` or no tools."""
    if choice == "none" or not tools:
        return None
    if isinstance(choice, Named):
        chosen = [tool for tool in tools if tool.name == choice.name]
        if not chosen:
            raise bad("tool_choice.function.name", f"tool_choice names {choice.name!r}, which is not among the tools")
        parallel = False
    else:
        chosen = list(tools)
    parallel = parallel and fmt.parallel
    auto = choice == "auto"
    rules = fmt.rules(parallel, auto)
    rules["ws"] = WS_RULE
    calls = []
    for position, tool in enumerate(tools):
        if tool not in chosen:
            continue
        args = structured.schema_rules(tool.parameters, f"tools[{position}].function.parameters",
                                       prefix=f"tool{position}", relaxed=True)
        rules[f"tool{position}-call"] = fmt.call(tool.name, args.root)
        rules.update(args.rules)
        calls.append(f"tool{position}-call")
    rules["call"] = " | ".join(calls)
    gbnf = "\n".join(f"{name} ::= {body}" for name, body in rules.items())
    if not auto:
        return Grammar(gbnf)
    return Grammar(gbnf, trigger_patterns=fmt.triggers([tool.name for tool in chosen]))


# -- parsing -------------------------------------------------------------------------------------------------------


class StreamParser:
    """``fmt``'s parser fed the output as it comes: :meth:`feed` each new piece of text, :meth:`finish` at the end;
    both return the events the text so far settles. Markers are never sent as content, and a tail that may begin
    one waits for what follows it."""

    def __init__(self, fmt: Format, new_id: Callable[[], str] | None = None) -> None:
        self.input = _Input()
        self.events = _Events(new_id or fmt.new_id)
        self.sent = 0
        self.reader: Reader | None = fmt.parser(self.input, self.events)
        self._step()

    def _step(self) -> list[Event]:
        if self.reader is not None:
            try:
                next(self.reader)
            except StopIteration:
                self.reader = None
        new = self.events.items[self.sent:]
        self.sent = len(self.events.items)
        return new

    def feed(self, text: str) -> list[Event]:
        if self.input.done:
            raise ValueError("the parser has finished")
        self.input.text += text
        return self._step()

    def finish(self) -> list[Event]:
        self.input.done = True
        return self._step()


def parse(fmt: Format, text: str, new_id: Callable[[], str] | None = None) -> tuple[str, list[ToolCall]]:
    """A finished output: its content and its calls (see the module docstring)."""
    parser = StreamParser(fmt, new_id)
    events = parser.feed(text) + parser.finish()
    return collect(events)


def collect(events: Sequence[Event]) -> tuple[str, list[ToolCall]]:
    """The content and the calls that ``events`` make."""
    content: list[str] = []
    starts: dict[int, CallStart] = {}
    arguments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, CallStart):
            starts[event.index] = event
            arguments[event.index] = []
        else:
            arguments[event.index].append(event.text)
    calls = [ToolCall(start.id, start.name, "".join(arguments[index])) for index, start in sorted(starts.items())]
    return "".join(content), calls


# -- the generic format's texts ------------------------------------------------------------------------------------


def system_text(tools: Sequence[Tool]) -> str:
    """The system message that describes ``tools`` and the answer's JSON to a model without a tool format."""
    listed = "\n".join(json.dumps(tool.openai()["function"], ensure_ascii=False) for tool in tools)
    return ("You can call these tools (JSON Schema of each one's arguments):\n" + listed + "\n\n"
            'Answer with one JSON object: {"tool_calls": [{"name": <tool name>, "arguments": <its arguments>}]} '
            'to call tools, or {"response": <your answer as a string>} to answer.')


def arguments_value(arguments: str) -> Any:
    """A call's arguments as Hugging Face templates read them: parsed when they are JSON, else the text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def calls_text(calls: Sequence[ToolCall], content: str | None) -> str:
    """An assistant message of the history that made ``calls``, as the generic format's answer."""
    answer: dict[str, Any] = {}
    if content:
        answer["response"] = content
    answer["tool_calls"] = [{"name": call.name, "arguments": arguments_value(call.arguments), "id": call.id}
                            for call in calls]
    return json.dumps(answer, ensure_ascii=False)


@dataclass(frozen=True)
class ToolResult:
    tool_call_id: str | None
    name: str | None
    content: str


def results_text(results: Sequence[ToolResult]) -> str:
    """Consecutive ``role: tool`` messages of the history, as one user message of the generic format."""
    listed = []
    for result in results:
        item: dict[str, Any] = {}
        if result.tool_call_id is not None:
            item["tool_call_id"] = result.tool_call_id
        if result.name is not None:
            item["name"] = result.name
        item["content"] = result.content
        listed.append(item)
    return json.dumps({"tool_results": listed}, ensure_ascii=False)
