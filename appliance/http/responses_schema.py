"""The OpenAI Responses API's requests, documents and stream events, as pure functions (the route and the store of
responses are :mod:`appliance.http.responses`; docs/openai-api.md says what a client sees).

* Requests: :func:`responses_request` checks every field of ``POST /v1/responses`` into a :class:`ResponsesRequest`:
  the chat request path's :class:`~appliance.http.openai_schema.Options` (its sampling), the new ``input`` as chat
  :class:`~appliance.engine.chat.Message` s (so the model's own chat template renders it, as a chat's messages),
  the function ``tools`` (a ``namespace`` tool's functions flattened, :func:`spelled`; built-in tools, which only
  OpenAI's side runs, left out: :data:`BUILT_IN_TOOLS`), ``tool_choice`` and ``text.format`` (a grammar). A bad
  field is a P4 ``BAD_REQUEST`` naming it (``details.param``); an unsupported one is refused saying why, unless it
  is one of :data:`IGNORED`, has its no-op value or is a setting nothing here changes (``reasoning``, ``include``'s
  encrypted reasoning, ``client_metadata``).
* Output: :class:`Output` turns a generation's text (its reasoning split out by :mod:`appliance.engine.reasoning`,
  the rest through the call format's :class:`~appliance.engine.toolcalls.StreamParser`) into output items
  (``reasoning``, ``message``, ``function_call``, named back into its namespace) and the stream events that
  announce them, numbered by ``sequence_number``; :func:`response` is the whole document.
* History: a response's output items, read back as input items (:func:`input_messages`), are the messages the next
  turn renders (``previous_response_id``); ``reasoning`` items are checked and not rendered (the chat templates that
  write reasoning leave a past turn's out).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.engine import reasoning, structured, toolcalls
from appliance.engine.chat import Message
from appliance.engine.interface import Grammar, StopReason
from appliance.errors import ApplianceError
from appliance.http import openai_schema as chat
from appliance.http.openai_schema import bad
from appliance.protocol import jsoncodec
from appliance.protocol.messages import MAX_CHAT_MESSAGES, MAX_TOKENS_LIMIT

MAX_INPUT_ITEMS = MAX_CHAT_MESSAGES
"""Input items one request may hold (and messages one stored conversation may reach)."""
MAX_METADATA_KEYS = 16  # OpenAI's bounds of ``metadata``
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_RESPONSE_ID_CHARS = 64
IGNORED = frozenset({"service_tier", "prompt_cache_key", "safety_identifier", "user"})
"""Fields accepted and ignored: they change nothing here (``prompt_cache_key``: a prompt's prefix is shared with any
request that has it anyway; ``user`` is OpenAI's end-user tag; the conversation a response continues is named by
``previous_response_id``)."""
REASONING_SETTINGS: dict[str, tuple[str, ...]] = {
    "effort": ("none", "minimal", "low", "medium", "high", "xhigh", "max"),
    "summary": ("auto", "concise", "detailed"),
    "generate_summary": ("auto", "concise", "detailed"),
    "context": ("auto", "current_turn", "all_turns"),
}
"""``reasoning``'s settings and their values: checked, then changing nothing (the model's chat template decides
whether it reasons; what it writes is a ``reasoning`` item, its text whole, never summarized)."""
INCLUDABLE = frozenset({"reasoning.encrypted_content"})
"""``include`` values accepted: nothing is encrypted or kept elsewhere here, so a reasoning item simply carries its
text (no ``encrypted_content``) and a client resending it gets the same."""
BUILT_IN_TOOLS = frozenset({"web_search", "web_search_2025_08_26", "web_search_preview",
                            "web_search_preview_2025_03_11", "file_search", "code_interpreter", "image_generation",
                            "mcp", "computer", "computer_use_preview", "local_shell", "shell", "apply_patch",
                            "tool_search", "programmatic_tool_calling"})
"""Tools of OpenAI's own kinds: OpenAI's side runs them, or the model answers them with call items of their own
(``computer_call``, ``local_shell_call``, ...). No model here writes those, so they are left out of what the model is
shown (the document repeats them, as sent) rather than refused: a client that always offers one (Codex offers
``web_search``) keeps working, with the function tools it also sent."""
NAMESPACE_SEPARATOR = "__"
"""Between a ``namespace`` tool's name and one of its functions' in the name the model is shown (Codex's own spelling
of an MCP server's tools, ``mcp__server__tool``)."""
NO_OP_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "truncation": (("disabled",), 'truncation must be "disabled" (a prompt over the context is refused, never cut)'),
    "background": ((False,), "background must be false (a response is answered on its request)"),
    "top_logprobs": ((0,), "top_logprobs must be 0 (log-probabilities are on /v1/chat/completions)"),
    "conversation": ((), "conversation is not supported: continue one with previous_response_id"),
    "prompt": ((), "prompt (a stored prompt template) is not supported: send instructions and input"),
    "max_tool_calls": ((), "max_tool_calls is not supported: parallel_tool_calls false allows one call"),
}
"""Fields accepted only with their no-op values (or null), and why."""
FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                    "max_output_tokens", "temperature", "top_p", "metadata", "store", "previous_response_id",
                    "stream", "stream_options", "reasoning", "include", "client_metadata"}
                   ) | IGNORED | set(NO_OP_FIELDS)
INPUT_TEXT_ROLES = frozenset({"user", "system", "developer"})
MESSAGE_ITEM_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
CALL_ITEM_KEYS = frozenset({"type", "call_id", "name", "namespace", "arguments", "id", "status"})
NAMESPACE_KEYS = frozenset({"type", "name", "description", "tools"})
OUTPUT_ITEM_KEYS = frozenset({"type", "call_id", "output", "id", "status"})
TEXT_PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
REASONING_ITEM_KEYS = frozenset({"type", "id", "summary", "content", "encrypted_content", "status"})


@dataclass(frozen=True)
class ResponsesRequest:
    """``POST /v1/responses``'s body, checked: the chat path's options, the new turn as messages (``instructions``
    apart: they are not carried over to a follow-up, as OpenAI), and what the response document repeats."""

    options: chat.Options
    input: tuple[Message, ...]
    instructions: str | None = None
    tools: tuple[toolcalls.Tool, ...] = ()
    tool_choice: toolcalls.Choice = "auto"
    parallel_tool_calls: bool = True
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # a spelled name -> (namespace, name)
    echo: dict[str, Any] = field(default_factory=dict)  # the document's request fields: tools, tool_choice, text, ...

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def messages(self, history: Sequence[Message] = ()) -> tuple[Message, ...]:
        """What the model is shown: ``instructions`` (a system message), the conversation so far, the new input."""
        system = () if self.instructions is None else (Message("system", self.instructions),)
        return (*system, *history, *self.input)

    def chat_request(self, history: Sequence[Message] = ()) -> chat.ChatRequest:
        """The chat request this one is, after the conversation ``history`` (so the chat path renders it)."""
        messages = self.messages(history)
        if len(messages) > MAX_CHAT_MESSAGES:
            raise bad("input", f"the conversation would hold {len(messages)} messages, over {MAX_CHAT_MESSAGES}: "
                               "start a new one", max_items=MAX_CHAT_MESSAGES)
        common = {item.name: getattr(self.options, item.name) for item in dataclasses.fields(chat.Options)}
        return chat.ChatRequest(**common, messages=messages, tools=self.tools, tool_choice=self.tool_choice,
                                parallel_tool_calls=self.parallel_tool_calls)


# -- input ---------------------------------------------------------------------------------------------------------


def part_text(part: Any, where: str, kinds: frozenset[str]) -> str:
    if not isinstance(part, dict) or part.get("type") not in kinds:
        raise bad(where, f"{where} must be a text part ({' or '.join(sorted(kinds))}): this API takes text only")
    unknown = sorted(set(part) - TEXT_PART_KEYS)
    if unknown:
        raise bad(f"{where}.{unknown[0]}", f"unknown field {where}.{unknown[0]}")
    return chat.text_field(part.get("text"), f"{where}.text")


def content_of(value: Any, where: str, kinds: frozenset[str]) -> str:
    """A message's ``content``: a string, or a list of text parts (joined)."""
    if isinstance(value, str):
        return chat.text_field(value, where)
    if not isinstance(value, list):
        raise bad(where, f"{where} must be a string or a list of text parts")
    return "".join(part_text(part, f"{where}[{index}]", kinds) for index, part in enumerate(value))


def check_keys(item: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise bad(f"{where}.{unknown[0]}", f"unknown field {where}.{unknown[0]}")


def message_item(item: dict[str, Any], where: str) -> Message:
    """``{"type": "message", "role", "content"}`` (``type`` optional): user, system and developer content is
    ``input_text``, an assistant's is ``output_text`` (a previous response's output, sent back)."""
    check_keys(item, MESSAGE_ITEM_KEYS, where)
    role = item.get("role")
    if role not in INPUT_TEXT_ROLES and role != "assistant":
        raise bad(f"{where}.role", f"{where}.role must be one of assistant, developer, system, user")
    if "content" not in item:
        raise bad(f"{where}.content", f"{where}.content is required")
    kinds = frozenset({"output_text"}) if role == "assistant" else frozenset({"input_text"})
    return Message(role, content_of(item["content"], f"{where}.content", kinds))


def call_item(item: dict[str, Any], where: str) -> toolcalls.ToolCall:
    """``{"type": "function_call", "call_id", "name", "namespace", "arguments"}``: a call the model made (as it
    returned it: a namespaced one is the call of the name it was shown, :func:`spelled`)."""
    check_keys(item, CALL_ITEM_KEYS, where)
    name = item.get("name")
    if item.get("namespace") is not None:
        namespace = namespace_name(item["namespace"], f"{where}.namespace")
        if isinstance(name, str):
            name = spelled(namespace, name)
    shaped = {"id": item.get("call_id"), "type": "function",
              "function": {"name": name, "arguments": item.get("arguments")}}
    try:
        return chat.history_call(shaped, where)
    except ApplianceError as exc:
        raise renamed(renamed(exc, f"{where}.id", f"{where}.call_id"), ".function", "") from None


def output_item(item: dict[str, Any], where: str) -> Message:
    """``{"type": "function_call_output", "call_id", "output"}``: a tool's result."""
    check_keys(item, OUTPUT_ITEM_KEYS, where)
    call = chat.identifier(item.get("call_id"), f"{where}.call_id")
    output = content_of(item.get("output"), f"{where}.output", frozenset({"input_text"}))
    return Message("tool", output, tool_call_id=call)


def reasoning_item(item: dict[str, Any], where: str) -> None:
    """``{"type": "reasoning", "summary", "content"}``: a previous response's reasoning, sent back. Checked (its
    parts are text), never rendered: the templates that write reasoning drop a past turn's."""
    check_keys(item, REASONING_ITEM_KEYS, where)
    if item.get("encrypted_content") is not None:
        raise bad(f"{where}.encrypted_content", f"{where}.encrypted_content is not supported (this appliance never "
                                                "writes it: its reasoning is in content)")
    for key, kind in (("summary", "summary_text"), ("content", "reasoning_text")):
        parts = item.get(key)
        if parts is None and key == "content":
            continue
        if not isinstance(parts, list):
            raise bad(f"{where}.{key}", f"{where}.{key} must be a list of {kind} parts")
        for index, part in enumerate(parts):
            part_text(part, f"{where}.{key}[{index}]", frozenset({kind}))


def called(messages: list[Message], call: toolcalls.ToolCall) -> None:
    """Add ``call`` to the assistant message it follows (an answer's text and its calls are one chat message), or
    make one."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        messages[-1] = Message("assistant", last.content, (*last.tool_calls, call))
    else:
        messages.append(Message("assistant", None, (call,)))


def input_messages(value: Any, param: str = "input") -> tuple[Message, ...]:
    """``input``: a string (one user message) or a list of items (messages, function calls, their outputs) as chat
    messages; a call joins the assistant message before it."""
    if isinstance(value, str):
        return (Message("user", chat.text_field(value, param)),)
    if not isinstance(value, list) or not 0 < len(value) <= MAX_INPUT_ITEMS:
        raise bad(param, f"{param} must be a string or a list of 1 to {MAX_INPUT_ITEMS} items",
                  max_items=MAX_INPUT_ITEMS)
    messages: list[Message] = []
    for index, item in enumerate(value):
        where = f"{param}[{index}]"
        if not isinstance(item, dict):
            raise bad(where, f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(message_item(item, where))
        elif kind == "function_call":
            called(messages, call_item(item, where))
        elif kind == "function_call_output":
            messages.append(output_item(item, where))
        elif kind == "reasoning":
            reasoning_item(item, where)
        else:
            raise bad(f"{where}.type", f"{where}.type must be message, reasoning, function_call or "
                                       f"function_call_output (not {str(kind)[:40]!r}): this API takes text and "
                                       "function tools only")
    return tuple(messages)


# -- tools, text ---------------------------------------------------------------------------------------------------


def spelled(namespace: str, name: str) -> str:
    """The name the model is shown for function ``name`` of ``namespace`` (and calls by, and is named back from)."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def namespace_name(value: Any, param: str) -> str:
    if not isinstance(value, str) or not toolcalls.TOOL_NAME.fullmatch(value):
        raise bad(param, f"{param} must be 1 to 64 letters, digits, underscores or dashes")
    return value


@dataclass
class Offered:
    """The function tools a request's ``tools`` offer the model, in the chat API's shape, each with the param it was
    given at; :meth:`tools` reads them."""

    nested: list[dict[str, Any]] = field(default_factory=list)  # the chat API's {"type": "function", "function"}
    where: list[str] = field(default_factory=list)  # each one's param, ``tools[i]`` or ``tools[i].tools[j]``
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # a spelled name -> (namespace, name)

    def function(self, item: Any, where: str, namespace: str | None = None) -> None:
        if not isinstance(item, dict) or item.get("type") != "function":
            raise bad(where, f'{where} must be a function tool ({{"type": "function", "name": ...}})')
        function = {key: value for key, value in item.items() if key != "type"}
        name = function.get("name")
        if namespace is not None and isinstance(name, str):
            function["name"] = spelled(namespace, name)
            if not toolcalls.TOOL_NAME.fullmatch(function["name"]):
                raise bad(f"{where}.name", f"{where}.name is shown to the model as {function['name'][:80]!r}, "
                                           "which must be 1 to 64 letters, digits, _ or -")
            self.namespaced[function["name"]] = (namespace, name)
        self.nested.append({"type": "function", "function": function})
        self.where.append(where)

    def namespace(self, item: dict[str, Any], where: str) -> None:
        check_keys(item, NAMESPACE_KEYS, where)
        namespace = namespace_name(item.get("name"), f"{where}.name")
        if item.get("description") is not None:
            chat.text_field(item["description"], f"{where}.description")
        functions = item.get("tools")
        if not isinstance(functions, list):
            raise bad(f"{where}.tools", f"{where}.tools must be a list of function tools")
        for index, function in enumerate(functions):
            self.function(function, f"{where}.tools[{index}]", namespace)

    def tools(self) -> tuple[toolcalls.Tool, ...]:
        """The tools, checked by :func:`appliance.engine.toolcalls.parse_tools`; an error names where the tool was
        given."""
        try:
            return toolcalls.parse_tools(self.nested)
        except ApplianceError as exc:
            param = exc.details.get("param")
            if not isinstance(param, str) or not param.startswith("tools["):
                raise
            chat_where = param[:param.index("]") + 1]
            given = self.where[int(chat_where[len("tools["):-1])]
            old = f"{chat_where}.function" if param.startswith(f"{chat_where}.function") else chat_where
            raise renamed(exc, old, given) from None


def tool_kind(item: Any, where: str) -> str:
    kind = item.get("type") if isinstance(item, dict) else None
    if not isinstance(kind, str):
        raise bad(where, f'{where} must be a tool ({{"type": "function", "name": ...}})')
    if kind not in ("function", "namespace") and kind not in BUILT_IN_TOOLS:
        raise bad(f"{where}.type", f"{where}.type {kind[:40]!r} is not supported: give a function tool (a custom "
                                   "tool's free-form input is not)")
    return kind


def responses_tools(value: Any) -> Offered:
    """Responses' function tools, ``{"type": "function", "name", "description", "parameters", "strict"}``, and
    ``{"type": "namespace", "name", "description", "tools": [function tools]}``, whose functions the model is shown
    by their :func:`spelled` names (the namespace's description is not shown); built-in tools
    (:data:`BUILT_IN_TOOLS`) are left out."""
    offered = Offered()
    if value is None:
        return offered
    if not isinstance(value, list) or len(value) > toolcalls.MAX_TOOLS:
        limit = toolcalls.MAX_TOOLS
        raise bad("tools", f"tools must be a list of at most {limit} tools", max_items=limit)
    for index, item in enumerate(value):
        where = f"tools[{index}]"
        kind = tool_kind(item, where)
        if kind == "function":
            offered.function(item, where)
        elif kind == "namespace":
            offered.namespace(item, where)
    return offered


def responses_choice(value: Any, tools: Sequence[toolcalls.Tool]) -> toolcalls.Choice:
    """``tool_choice``: ``auto``, ``none``, ``required`` or ``{"type": "function", "name"}``."""
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "name"}:
        value = {"type": "function", "function": {"name": value["name"]}}
    try:
        return toolcalls.parse_choice(value, tools)
    except ApplianceError as exc:
        raise renamed(exc, ".function", "") from None


def renamed(exc: ApplianceError, old: str, new: str) -> ApplianceError:
    """``exc`` with ``old`` replaced by ``new`` in its message and ``param`` (a field named as Responses names it)."""
    param = exc.details.get("param")
    details = {**exc.details, "param": param.replace(old, new) if isinstance(param, str) else param}
    return ApplianceError(exc.code, exc.message.replace(old, new), details)


def text_format(value: Any) -> tuple[Grammar | None, dict[str, Any]]:
    """``text``: ``{"format": {"type": "text" | "json_object" | "json_schema", ...}, "verbosity"}``; a JSON format
    is a grammar (:func:`appliance.engine.structured.response_grammar`). Also the ``text`` the document repeats."""
    if value is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(value, dict):
        raise bad("text", "text must be an object")
    check_keys(value, frozenset({"format", "verbosity"}), "text")
    if value.get("verbosity") not in (None, "low", "medium", "high"):
        raise bad("text.verbosity", "text.verbosity must be low, medium or high")
    fmt = value.get("format")
    if fmt is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(fmt, dict):
        raise bad("text.format", "text.format must be an object")
    chat_shape: Any = fmt
    if fmt.get("type") == "json_schema":
        chat_shape = {"type": "json_schema", "json_schema": {key: item for key, item in fmt.items() if key != "type"}}
    try:
        grammar = structured.response_grammar(chat_shape, "text.format")
    except ApplianceError as exc:
        raise renamed(exc, "text.format.json_schema", "text.format") from None
    return grammar, {"format": fmt}


def metadata_of(value: Any) -> dict[str, str]:
    """``metadata``: at most 16 string keys (64 characters) to strings (512 characters), kept with the response."""
    if value is None:
        return {}
    message = (f"metadata must be an object of at most {MAX_METADATA_KEYS} keys of at most {MAX_METADATA_KEY_CHARS} "
               f"characters to strings of at most {MAX_METADATA_VALUE_CHARS}")
    if not isinstance(value, dict) or len(value) > MAX_METADATA_KEYS:
        raise bad("metadata", message)
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(item, str) or len(item) > MAX_METADATA_VALUE_CHARS:
            raise bad("metadata", message)
        chat.text_field(key, "metadata")
        chat.text_field(item, "metadata")
    return dict(value)


def reasoning_of(value: Any) -> None:
    """``reasoning``: its settings checked (:data:`REASONING_SETTINGS`); none changes what the model does."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad("reasoning", "reasoning must be an object")
    check_keys(value, frozenset(REASONING_SETTINGS), "reasoning")
    for key, allowed in REASONING_SETTINGS.items():
        if value.get(key) is not None and value[key] not in allowed:
            raise bad(f"reasoning.{key}", f"reasoning.{key} must be one of {', '.join(allowed)}")


def include_of(value: Any) -> None:
    """``include``: a list of :data:`INCLUDABLE` values (the others name outputs this appliance never has)."""
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise bad("include", "include must be a list of strings")
    for item in value:
        if item not in INCLUDABLE:
            raise bad("include", f"include {item[:60]!r} is not supported: only reasoning.encrypted_content is "
                                 "accepted (and nothing is encrypted here); log-probabilities are on "
                                 "/v1/chat/completions")


def client_metadata_of(value: Any) -> None:
    """``client_metadata``: an object of strings a client tags its request with (Codex: its session and turn);
    checked, and kept nowhere."""
    if value is None:
        return
    if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
        raise bad("client_metadata", "client_metadata must be an object of strings")


def response_id(value: Any, param: str) -> str:
    """A response's id as a client names it (``previous_response_id``, a path): ``resp_`` and letters or digits."""
    if not isinstance(value, str) or not value.startswith("resp_") or len(value) > MAX_RESPONSE_ID_CHARS or not (
            value[5:].isascii() and value[5:].isalnum()):
        raise bad(param, f"{param} must be a response id (resp_ and letters or digits)")
    return value


# -- the request ---------------------------------------------------------------------------------------------------


def no_ops(body: dict[str, Any]) -> None:
    for key, (allowed, message) in NO_OP_FIELDS.items():
        chat.only(body.get(key), key, allowed, message)


def stream_of(body: dict[str, Any]) -> bool:
    stream = False if body.get("stream") is None else chat.boolean(body["stream"], "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad("stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(options, dict):
            raise bad("stream_options", "stream_options must be an object")
        check_keys(options, frozenset({"include_obfuscation"}), "stream_options")
        if options.get("include_obfuscation") is not None:
            chat.boolean(options["include_obfuscation"], "stream_options.include_obfuscation")
    return stream


def responses_request(body: dict[str, Any]) -> ResponsesRequest:
    """``POST /v1/responses``'s body (and ``/v1/responses/input_tokens``'s), checked."""
    for key in body:
        if key not in FIELDS:
            raise bad(key, f"unknown or unsupported field {key!r}")
    no_ops(body)
    if "model" not in body:
        raise bad("model", "model is required")
    if "input" not in body:
        raise bad("input", "input is required")
    model = chat.identifier(body["model"], "model")
    max_tokens = None if body.get("max_output_tokens") is None else chat.integer(
        body["max_output_tokens"], "max_output_tokens", 1, MAX_TOKENS_LIMIT)
    temperature = chat.DEFAULT_TEMPERATURE if body.get("temperature") is None else chat.number(
        body["temperature"], "temperature", 0.0, 2.0)
    top_p = chat.DEFAULT_TOP_P if body.get("top_p") is None else chat.number(body["top_p"], "top_p", 0.0, 1.0)
    offered = responses_tools(body.get("tools"))
    tools = offered.tools()
    choice = responses_choice(body.get("tool_choice"), tools)
    parallel = True if body.get("parallel_tool_calls") is None else chat.boolean(body["parallel_tool_calls"],
                                                                                  "parallel_tool_calls")
    grammar, text = text_format(body.get("text"))
    if grammar is not None and tools and choice != "none":
        raise bad("text.format", "text.format cannot constrain an answer that may call tools: give one of "
                                 "text.format and tools, or tool_choice \"none\"")
    instructions = None if body.get("instructions") is None else chat.text_field(body["instructions"],
                                                                                "instructions")
    store = True if body.get("store") is None else chat.boolean(body["store"], "store")
    previous = None if body.get("previous_response_id") is None else response_id(body["previous_response_id"],
                                                                                 "previous_response_id")
    options = chat.Options(model=model, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                           top_k=chat.DEFAULT_TOP_K, seed=None, stop=(), stream=stream_of(body), include_usage=False,
                           user=None, response_grammar=grammar)
    echo = {"tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto", "text": text,
            "max_output_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
            "user": body.get("user"), "parallel_tool_calls": parallel}
    reasoning_of(body.get("reasoning"))
    include_of(body.get("include"))
    client_metadata_of(body.get("client_metadata"))
    return ResponsesRequest(options, input_messages(body["input"]), instructions, tools, choice, parallel, store,
                            previous, metadata_of(body.get("metadata")), offered.namespaced, echo)


# -- output --------------------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


OutputEvent = toolcalls.Event | reasoning.Reasoning
"""What :class:`Output` is fed: the call parser's events (the answer) and the reasoning splitter's reasoning."""


class Output:
    """A response's output items, built from a parser's events, and the stream events that announce them (each
    numbered by ``sequence_number`` from ``first_sequence``). Reasoning is a ``reasoning`` item (no ``summary``,
    one ``reasoning_text`` content part, streamed as ``response.reasoning_text.delta``); content a ``message``
    item (one ``output_text`` part); each call a ``function_call`` item (the call of a name in ``namespaced``, the
    request's :attr:`ResponsesRequest.namespaced`, named as its namespace's function); an item is done when the next
    begins or the output ends."""

    def __init__(self, first_sequence: int = 0, namespaced: dict[str, tuple[str, str]] | None = None) -> None:
        self.namespaced = namespaced or {}
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> its item
        self.sequence = first_sequence

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        numbered = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return numbered

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=snapshot(item))]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item = self.open
        if item is None:
            return []
        self.open = None
        index = len(self.items) - 1
        item["status"] = status
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"], logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=snapshot(part)))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=snapshot(part)))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=index, item=snapshot(item)))
        return events

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close("completed")
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            events += self._add(item)
            item["content"].append(text_part(""))
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0, part=text_part("")))
        item = self.open
        assert item is not None
        if text:
            item["content"][0]["text"] += text
            events.append(self.event("response.output_text.delta", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0, delta=text, logprobs=[]))
        return events

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self._close("completed")
            item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            events += self._add(item)
            item["content"].append(reasoning_part(""))
            events.append(self.event("response.content_part.added", item_id=item["id"],
                                     output_index=len(self.items) - 1, content_index=0, part=reasoning_part("")))
        item = self.open
        assert item is not None
        item["content"][0]["text"] += text
        events.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                                 output_index=len(self.items) - 1, content_index=0, delta=text))
        return events

    def function_name(self, name: str) -> dict[str, str]:
        """A call's ``name``, and ``namespace`` for a namespace's function."""
        if name not in self.namespaced:
            return {"name": name}
        namespace, function = self.namespaced[name]
        return {"namespace": namespace, "name": function}

    def feed(self, events: Sequence[OutputEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, reasoning.Reasoning):
                out += self._reasoning(event.text)
            elif isinstance(event, toolcalls.Content):
                out += self._text(event.text)
            elif isinstance(event, toolcalls.CallStart):
                out += self._close("completed")
                item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": event.id,
                        **self.function_name(event.name), "arguments": ""}
                self.calls[event.index] = item
                out += self._add(item)
            else:
                item = self.calls[event.index]
                item["arguments"] += event.text
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.items.index(item), delta=event.text))
        return out

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """Close the last item; ``incomplete``: it was cut short. An output without an answer (nothing, or only
        reasoning that ended) gets one empty message; reasoning cut short stays the last item."""
        answered = any(item["type"] != "reasoning" for item in self.items)
        cut_in_reasoning = incomplete and self.open is not None and self.open["type"] == "reasoning"
        events = [] if answered or cut_in_reasoning else self._text("")
        return events + self._close("incomplete" if incomplete else "completed")


def snapshot(value: Any) -> Any:
    """A copy of an item as it is now (an event carries the item at that moment, not as it goes on to grow)."""
    return json.loads(json.dumps(value))


def incomplete(stop_reason: StopReason) -> bool:
    """The output was cut short: at ``max_output_tokens`` or a full context."""
    return chat.STOP_REASONS.get(stop_reason) == "length"


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """Responses' ``usage``: ``input_tokens`` is every token of the prompt the model saw (the history included),
    ``input_tokens_details.cached_tokens`` the part of it not evaluated again."""
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def response(ident: str, created: int, request: ResponsesRequest, status: str, output: list[dict[str, Any]],
             counts: dict[str, Any] | None) -> dict[str, Any]:
    """The response document (``status`` in_progress, completed or incomplete)."""
    details = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": ident, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": details, "instructions": request.instructions, "model": request.options.model,
            "output": output, "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": request.store, "truncation": "disabled",
            "metadata": request.metadata, "usage": counts, **request.echo}


def error_event(body: dict[str, Any], sequence: int) -> dict[str, Any]:
    """The stream's ``error`` event for a P4 error body (``{"error": {...}}``): OpenAI's fields (``code`` is the P4
    code) and the P4 ``retryable`` and ``details``."""
    error = body["error"]
    return {"type": "error", "code": error["code"], "message": error["message"], "param": error.get("param"),
            "retryable": error["retryable"], "details": error["details"], "sequence_number": sequence}


def event(payload: dict[str, Any]) -> bytes:
    """One server-sent event, named by its ``type``."""
    return f"event: {payload['type']}\ndata: ".encode() + jsoncodec.dumps(payload) + b"\n\n"


def input_tokens(count: int) -> dict[str, Any]:
    return {"object": "response.input_tokens", "input_tokens": count}


def deleted(ident: str) -> dict[str, Any]:
    return {"id": ident, "object": "response", "deleted": True}
