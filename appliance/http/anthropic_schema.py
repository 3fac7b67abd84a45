"""The Anthropic Messages API's requests and responses, as pure functions (the routes are
:mod:`appliance.http.anthropic`; docs/anthropic-api.md says what a client sees).

* Requests: :func:`messages_request` checks a ``POST /v1/messages`` (or ``/v1/messages/count_tokens``) body and
  translates it into the one chat request of the OpenAI surface (:class:`~appliance.http.openai_schema.ChatRequest`):
  ``system`` becomes a system message, a user message's ``tool_result`` blocks become ``tool`` messages, an assistant
  message's ``tool_use`` blocks its ``tool_calls``, ``tools`` the engine's :class:`~appliance.engine.toolcalls.Tool`
  s, ``tool_choice`` ``any`` / ``tool`` the grammar's ``required`` / named choice, ``metadata.user_id`` the agent
  (as OpenAI's ``user``) when it is a valid agent id; ``thinking`` only says whether the reasoning a model's template
  makes it write is shown as ``thinking`` blocks (:func:`thinking`; no extended thinking is run on request, earlier
  thinking blocks are dropped from the history). A ``system`` message inside ``messages`` is folded into the turn
  beside it (:func:`fold_system`). What Claude Code sends beside and changes nothing here is accepted and ignored,
  each for its reason: ``output_config.effort``, ``context_management``, a ``user_id`` that is not an agent id. A bad
  field is a P4 ``BAD_REQUEST`` whose ``details.param`` names it; what the appliance cannot do (images, documents,
  server tools, ``output_config.format``) is refused the same way, saying why.
* Responses: the ``message`` document, its ``usage``, its ``stop_reason``; a stream's events in Anthropic's order
  (:class:`StreamBlocks` turns a reply's reasoning and tool-call events into content blocks); errors in Anthropic's
  envelope with the P4 error kept beside (:func:`error_document`).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from appliance.engine import reasoning, toolcalls
from appliance.engine.chat import Message
from appliance.engine.interface import StopReason
from appliance.engine.reply import ReplyEvent
from appliance.errors import ApplianceError
from appliance.http.openai_schema import (
    DEFAULT_TOP_K,
    MAX_STOP_CHARS,
    ChatRequest,
    bad,
    boolean,
    has_surrogate,
    identifier,
    integer,
    number,
    text_field,
)
from appliance.protocol import jsoncodec
from appliance.protocol.identifiers import agent_id_problem
from appliance.protocol.messages import MAX_CHAT_MESSAGES, MAX_STOP_STRINGS, MAX_TOKENS_LIMIT

DEFAULT_TEMPERATURE = 1.0  # Anthropic's default and upper bound
DEFAULT_TOP_P = 1.0
ROLES = frozenset({"user", "assistant", "system"})
IGNORED = frozenset({"service_tier", "cache_control"})
"""Fields accepted and ignored (they change nothing here: one tier; prompt reuse is automatic)."""
FIELDS = frozenset({"model", "max_tokens", "system", "messages", "tools", "tool_choice", "stop_sequences",
                    "temperature", "top_p", "top_k", "metadata", "stream", "thinking", "output_config",
                    "context_management"}) | IGNORED
COUNT_FIELDS = frozenset({"model", "system", "messages", "tools", "tool_choice", "thinking", "output_config",
                          "context_management"})
"""``count_tokens`` takes what shapes the prompt only."""
REFUSED_BLOCKS = {
    "image": "images are not supported (the appliance serves text-only models)",
    "document": "documents are not supported (send their text as a text block)",
    "search_result": "search results are not supported (send their text as a text block)",
    "server_tool_use": "server tools are not supported (the appliance runs no tools itself)",
    "web_search_tool_result": "server tools are not supported (the appliance runs no tools itself)",
}
"""Content block types refused, and why."""
THINKING_BLOCKS = frozenset({"thinking", "redacted_thinking"})
"""An assistant message's earlier thinking: dropped from the history (Anthropic leaves earlier turns' thinking out
of the context too, as the reasoning templates do)."""
THINKING_TYPES = frozenset({"adaptive", "enabled", "disabled"})
THINKING_DISPLAYS = frozenset({"summarized", "omitted"})
ThinkingDisplay = Literal["shown", "omitted", "dropped"]
"""How a reply's reasoning is answered: ``thinking`` blocks with its text, ``thinking`` blocks with an empty text
(``display: omitted``), or no blocks (``type: disabled``)."""
EFFORTS = frozenset({"low", "medium", "high", "xhigh", "max"})
"""``output_config.effort`` s: accepted and ignored (a local model has no effort setting)."""
BLOCK_EXTRAS = frozenset({"cache_control", "citations"})
"""Block fields accepted and ignored: prompt caching is automatic here (shared prefixes, agents), citations need
documents."""
DIRECT_CALLER = {"type": "direct"}
"""A ``tool_use`` block's one ``caller``: the model itself."""
ERROR_PREFIX = "Error: "
"""How a ``tool_result`` with ``is_error: true`` reaches the model: its content after this prefix."""
ID_ALPHABET = toolcalls.ID_ALPHABET
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "invalid_request_error",
    503: "overloaded_error",
    504: "timeout_error",
    507: "overloaded_error",
}
"""Anthropic's ``error.type`` for an HTTP status (anything else: ``api_error``)."""


def new_id(prefix: str) -> str:
    return prefix + "".join(secrets.choice(ID_ALPHABET) for _ in range(24))


def message_id() -> str:
    return new_id("msg_")


def tool_use_id() -> str:
    return new_id("toolu_")


# -- requests ------------------------------------------------------------------------------------------------------


def block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad(where, f'{where} must be a content block ({{"type": ..., ...}})')
    kind = block["type"]
    if kind in REFUSED_BLOCKS:
        raise bad(f"{where}.type", f"{where}: {REFUSED_BLOCKS[kind]}", block_type=kind)
    return kind


def known_keys(block: dict[str, Any], keys: frozenset[str], where: str) -> None:
    """A block holds only ``keys`` (and :data:`BLOCK_EXTRAS`); a null field is an absent one (a client that echoes
    a response's blocks back sends their empty fields)."""
    unknown = sorted(key for key in set(block) - keys - BLOCK_EXTRAS - {"type"} if block[key] is not None)
    if unknown:
        raise bad(f"{where}.{unknown[0]}", f"unknown field {where}.{unknown[0]}")


def text_block(block: Any, where: str) -> str:
    """A ``{"type": "text", "text": ...}`` block's text."""
    if block_type(block, where) != "text":
        raise bad(f"{where}.type", f"{where} must be a text block")
    known_keys(block, frozenset({"text"}), where)
    return text_field(block.get("text"), f"{where}.text")


def text_content(value: Any, param: str) -> str:
    """A string, or a list of text blocks (their texts, joined)."""
    if isinstance(value, str):
        return text_field(value, param)
    if not isinstance(value, list):
        raise bad(param, f"{param} must be a string or a list of text blocks")
    return "".join(text_block(block, f"{param}[{index}]") for index, block in enumerate(value))


def system_message(value: Any) -> list[Message]:
    """``system``: a string or a list of text blocks; none, or an empty one, adds no message."""
    if value is None:
        return []
    text = text_content(value, "system")
    return [Message("system", text)] if text else []


def tool_use_block(block: dict[str, Any], where: str) -> toolcalls.ToolCall:
    """A ``tool_use`` block of the history: its id, its tool's name, its ``input`` (an object)."""
    known_keys(block, frozenset({"id", "name", "input", "caller"}), where)
    if block.get("caller") not in (None, DIRECT_CALLER):
        raise bad(f"{where}.caller", f"{where}.caller must be {{\"type\": \"direct\"}} (the appliance runs no tools "
                                     "itself)")
    ident = identifier(block.get("id"), f"{where}.id")
    name = block.get("name")
    if not isinstance(name, str) or not toolcalls.TOOL_NAME.fullmatch(name):
        raise bad(f"{where}.name", f"{where}.name must be 1 to 64 letters, digits, _ or -")
    arguments = block.get("input")
    if not isinstance(arguments, dict):
        raise bad(f"{where}.input", f"{where}.input must be an object")
    return toolcalls.ToolCall(ident, name, json.dumps(arguments, ensure_ascii=False))


def tool_result_block(block: dict[str, Any], where: str) -> Message:
    """A ``tool_result`` block: a ``tool`` message answering ``tool_use_id``; its content a string or text blocks
    (none: empty), after :data:`ERROR_PREFIX` when ``is_error``."""
    known_keys(block, frozenset({"tool_use_id", "content", "is_error"}), where)
    ident = identifier(block.get("tool_use_id"), f"{where}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else text_content(content, f"{where}.content")
    is_error = block.get("is_error")
    if is_error is not None and boolean(is_error, f"{where}.is_error"):
        text = ERROR_PREFIX + text
    return Message("tool", text, tool_call_id=ident)


def user_messages(content: list[Any], where: str) -> list[Message]:
    """A user message's blocks: its ``tool_result`` s as ``tool`` messages, then its text as a user message."""
    results: list[Message] = []
    texts: list[str] = []
    for index, block in enumerate(content):
        at = f"{where}[{index}]"
        kind = block_type(block, at)
        if kind == "tool_result":
            results.append(tool_result_block(block, at))
        elif kind == "text":
            texts.append(text_block(block, at))
        else:
            raise bad(f"{at}.type", f"{at}: a user message takes text and tool_result blocks, not {kind[:40]!r}")
    if texts or not results:
        return [*results, Message("user", "".join(texts))]
    return results


def assistant_message(content: list[Any], where: str) -> Message:
    """An assistant message's blocks: its text and its ``tool_use`` s as calls."""
    texts: list[str] = []
    calls: list[toolcalls.ToolCall] = []
    for index, block in enumerate(content):
        at = f"{where}[{index}]"
        kind = block_type(block, at)
        if kind == "tool_use":
            calls.append(tool_use_block(block, at))
        elif kind == "text":
            texts.append(text_block(block, at))
        elif kind not in THINKING_BLOCKS:
            raise bad(f"{at}.type", f"{at}: an assistant message takes text, tool_use and thinking blocks, not "
                                    f"{kind[:40]!r}")
    text = "".join(texts)
    return Message("assistant", text if text or not calls else None, tuple(calls))


def chat_messages(value: Any, system: Sequence[Message] = ()) -> list[Message]:
    """``messages`` after the ``system`` prompt's messages: user and assistant turns, each a string or a list of
    content blocks, and system text folded in (:func:`fold_system`)."""
    if not isinstance(value, list) or not 0 < len(value) <= MAX_CHAT_MESSAGES:
        raise bad("messages", f"messages must be a list of 1 to {MAX_CHAT_MESSAGES} messages",
                  max_items=MAX_CHAT_MESSAGES)
    messages = list(system)
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad(where, f"{where} must be an object")
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise bad(f"{where}.{unknown[0]}", f"unknown field {where}.{unknown[0]}")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"{where}.role must be user, assistant or system")
        content = message.get("content")
        if role == "system":
            messages = fold_system(messages, text_content(content, f"{where}.content"))
        elif isinstance(content, str):
            messages.append(Message(role, text_field(content, f"{where}.content")))
        elif not isinstance(content, list):
            raise bad(f"{where}.content", f"{where}.content must be a string or a list of content blocks")
        elif role == "user":
            messages.extend(user_messages(content, f"{where}.content"))
        else:
            messages.append(assistant_message(content, f"{where}.content"))
    return messages


def fold_system(messages: list[Message], text: str) -> list[Message]:
    """A ``system`` message inside ``messages`` (Claude Code's mid-conversation system text), folded in where every
    chat template takes it: into the system prompt when nothing came before it but that, else into the user turn it
    follows, else (after an assistant turn or tool results) as a user turn of its own; an empty one adds nothing."""
    if not text:
        return messages
    last = messages[-1] if messages else None
    if last is None:
        return [Message("system", text)]
    if last.role in ("system", "user"):
        return [*messages[:-1], Message(last.role, f"{last.text or ''}\n\n{text}", name=last.name)]
    return [*messages, Message("user", text)]


def tools_of(value: Any) -> tuple[toolcalls.Tool, ...]:
    """``tools``: client tools (``name``, ``description``, ``input_schema``: a JSON Schema of an object that a grammar
    can enforce). Anthropic's server tools (a ``type`` other than ``custom``) are refused."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > toolcalls.MAX_TOOLS:
        raise bad("tools", f"tools must be a list of at most {toolcalls.MAX_TOOLS} tools",
                  max_items=toolcalls.MAX_TOOLS)
    tools: list[toolcalls.Tool] = []
    for index, item in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(item, dict):
            raise bad(where, f"{where} must be an object")
        kind = item.get("type")
        if kind is not None and kind != "custom":
            raise bad(f"{where}.type", f"{where}.type {str(kind)[:40]!r} is a server tool: not supported (the "
                                       "appliance runs no tools itself; give client tools with an input_schema)")
        unknown = sorted(set(item) - {"type", "name", "description", "input_schema", "cache_control"})
        if unknown:
            raise bad(f"{where}.{unknown[0]}", f"unknown field {where}.{unknown[0]}")
        name = item.get("name")
        if not isinstance(name, str) or not toolcalls.TOOL_NAME.fullmatch(name):
            raise bad(f"{where}.name", f"{where}.name must be 1 to 64 letters, digits, _ or -")
        if any(tool.name == name for tool in tools):
            raise bad(f"{where}.name", f"two tools are named {name!r}")
        description = item.get("description", "")
        if not isinstance(description, str) or len(description) > toolcalls.MAX_DESCRIPTION_CHARS:
            raise bad(f"{where}.description", f"{where}.description must be a string of at most "
                                              f"{toolcalls.MAX_DESCRIPTION_CHARS} characters")
        if "input_schema" not in item:
            raise bad(f"{where}.input_schema", f"{where}.input_schema is required")
        toolcalls.check_parameters(item["input_schema"], f"{where}.input_schema")
        tools.append(toolcalls.Tool(name, description, item["input_schema"]))
    return tuple(tools)


CHOICES: dict[str, toolcalls.Choice] = {"auto": "auto", "any": "required", "none": "none"}
"""Anthropic's ``tool_choice.type`` s as the grammar's choices (``tool``: a :class:`~appliance.engine.toolcalls.
Named` one)."""


def tool_choice(value: Any, tools: Sequence[toolcalls.Tool]) -> tuple[toolcalls.Choice, bool]:
    """``tool_choice`` (``auto``, ``any``, ``tool`` with ``name``, ``none``; ``disable_parallel_tool_use``) as the
    grammar's choice and whether several calls may be made."""
    if value is None:
        return "auto", True
    if not isinstance(value, dict) or value.get("type") not in (*CHOICES, "tool"):
        raise bad("tool_choice", 'tool_choice must be {"type": "auto" | "any" | "tool" | "none", ...}')
    kind = value["type"]
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise bad(f"tool_choice.{unknown[0]}", f"unknown field tool_choice.{unknown[0]} for type {kind!r}")
    disable = value.get("disable_parallel_tool_use")
    parallel = True if disable is None else not boolean(disable, "tool_choice.disable_parallel_tool_use")
    if kind in ("any", "tool") and not tools:
        raise bad("tool_choice", f"tool_choice {kind!r} needs tools")
    if kind != "tool":
        return CHOICES[kind], parallel
    name = value.get("name")
    if not isinstance(name, str) or not any(tool.name == name for tool in tools):
        raise bad("tool_choice.name", f"tool_choice names {str(name)[:64]!r}, which is not among the tools")
    return toolcalls.Named(name), parallel


def stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_STOP_STRINGS:
        raise bad("stop_sequences", f"stop_sequences must be a list of at most {MAX_STOP_STRINGS} strings",
                  max_items=MAX_STOP_STRINGS)
    for item in value:
        if not isinstance(item, str) or not 0 < len(item) <= MAX_STOP_CHARS or has_surrogate(item):
            raise bad("stop_sequences", f"each stop sequence must have 1 to {MAX_STOP_CHARS} characters",
                      max_chars=MAX_STOP_CHARS)
    return tuple(value)


def metadata_user(value: Any) -> str | None:
    """``metadata``: only ``user_id``, which names the agent whose conversation the request runs in when it is an
    agent id (the agents' one rule). Another string (Claude Code's JSON of its device and session) names no agent:
    the request runs without one (a shared prompt prefix is still reused), as with no ``user_id``."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("metadata", "metadata must be an object")
    unknown = sorted(set(value) - {"user_id"})
    if unknown:
        raise bad(f"metadata.{unknown[0]}", f"unknown field metadata.{unknown[0]}")
    user = value.get("user_id")
    if user is None:
        return None
    text = text_field(user, "metadata.user_id")
    return None if agent_id_problem(text) is not None else text


def fields_of(value: Any, param: str, keys: frozenset[str]) -> dict[str, Any]:
    """An object holding only ``keys``."""
    if not isinstance(value, dict):
        raise bad(param, f"{param} must be an object")
    unknown = sorted(set(value) - keys)
    if unknown:
        raise bad(f"{param}.{unknown[0]}", f"unknown field {param}.{unknown[0]}")
    return value


def thinking(value: Any) -> ThinkingDisplay:
    """``thinking`` (``adaptive``, ``enabled`` with ``budget_tokens``, ``disabled``; ``display``) as how the reasoning
    a model writes by its template is answered: ``disabled`` drops it, ``display: omitted`` empties its text, else
    (and when absent) it is shown. Nothing else changes: a local model thinks when its template says so, and
    ``budget_tokens`` is checked and ignored (``max_tokens`` bounds reasoning and answer together)."""
    if value is None:
        return "shown"
    fields = fields_of(value, "thinking", frozenset({"type", "budget_tokens", "display"}))
    if fields.get("type") not in THINKING_TYPES:
        raise bad("thinking.type", "thinking.type must be adaptive, enabled or disabled")
    if fields.get("budget_tokens") is not None:
        integer(fields["budget_tokens"], "thinking.budget_tokens", 0, MAX_TOKENS_LIMIT)
    if fields.get("display") is not None and fields["display"] not in THINKING_DISPLAYS:
        raise bad("thinking.display", "thinking.display must be summarized or omitted")
    if fields["type"] == "disabled":
        return "dropped"
    return "omitted" if fields.get("display") == "omitted" else "shown"


def output_config(value: Any) -> None:
    """``output_config``: its ``effort`` accepted and ignored; ``format`` (structured output) is refused."""
    if value is None:
        return
    fields = fields_of(value, "output_config", frozenset({"effort", "format"}))
    if fields.get("format") is not None:
        raise bad("output_config.format", "output_config.format is not supported here (structured output is "
                                          "/v1/chat/completions' response_format)")
    if fields.get("effort") is not None and fields["effort"] not in EFFORTS:
        raise bad("output_config.effort", f"output_config.effort must be one of {', '.join(sorted(EFFORTS))}")


def context_management(value: Any) -> None:
    """``context_management``: its ``edits`` (clearing earlier thinking or tool results on the server) accepted and
    ignored: there is no thinking to clear, and the client keeps its own history."""
    if value is None:
        return
    fields = fields_of(value, "context_management", frozenset({"edits"}))
    if fields.get("edits") is not None and not isinstance(fields["edits"], list):
        raise bad("context_management.edits", "context_management.edits must be a list")


def messages_request(body: dict[str, Any], *, counting: bool = False) -> ChatRequest:
    """A ``POST /v1/messages`` body (``counting``: a ``/v1/messages/count_tokens`` one), checked, as the chat
    request it runs."""
    fields = COUNT_FIELDS if counting else FIELDS
    for key in body:
        if key not in fields:
            raise bad(key, f"unknown or unsupported field {key!r}")
    for key in ("model", "messages") if counting else ("model", "max_tokens", "messages"):
        if key not in body:
            raise bad(key, f"{key} is required")
    model = identifier(body["model"], "model")
    max_tokens = None if counting else integer(body["max_tokens"], "max_tokens", 1, MAX_TOKENS_LIMIT)
    temperature = DEFAULT_TEMPERATURE if body.get("temperature") is None else number(
        body["temperature"], "temperature", 0.0, 1.0)
    top_p = DEFAULT_TOP_P if body.get("top_p") is None else number(body["top_p"], "top_p", 0.0, 1.0)
    top_k = DEFAULT_TOP_K if body.get("top_k") is None else integer(body["top_k"], "top_k", 0, 1 << 20)
    stream = False if body.get("stream") is None else boolean(body["stream"], "stream")
    thinking(body.get("thinking"))
    output_config(body.get("output_config"))
    context_management(body.get("context_management"))
    tools = tools_of(body.get("tools"))
    choice, parallel = tool_choice(body.get("tool_choice"), tools)
    messages = tuple(chat_messages(body["messages"], system_message(body.get("system"))))
    return ChatRequest(model=model, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                       seed=None, stop=stop_sequences(body.get("stop_sequences")), stream=stream, include_usage=False,
                       user=metadata_user(body.get("metadata")), messages=messages, tools=tools, tool_choice=choice,
                       parallel_tool_calls=parallel)


# -- responses -----------------------------------------------------------------------------------------------------


def stop_reason(reason: StopReason, called: bool, generated: int, max_tokens: int,
                sequence: str | None) -> str:
    """Anthropic's ``stop_reason``: ``max_tokens`` when ``max_tokens`` were generated, ``model_context_window_
    exceeded`` when the context filled up first, ``tool_use`` when the answer called tools, ``stop_sequence`` when
    a stop sequence ended it, else ``end_turn``."""
    if reason == "length":
        return "max_tokens" if generated >= max_tokens else "model_context_window_exceeded"
    if called:
        return "tool_use"
    if reason == "stop" and sequence is not None:
        return "stop_sequence"
    return "end_turn"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """Anthropic's ``usage``: ``input_tokens`` are the prompt's tokens evaluated, ``cache_read_input_tokens`` those
    not evaluated again (kept by the agent's conversation, or a shared prefix); their sum is the whole prompt."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as ``tool_use.input``; None when they are not a whole JSON object (cut short)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def thinking_block(text: str) -> dict[str, Any]:
    """A ``thinking`` block; its ``signature`` is empty (no thinking is verified when sent back: it is dropped)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def shown_thought(thought: str | None, display: ThinkingDisplay) -> str | None:
    """A reply's reasoning (None: it had none) as its thinking block's text (None: no block)."""
    if thought is None or display == "dropped":
        return None
    return "" if display == "omitted" else thought


def content_blocks(text: str, calls: Sequence[toolcalls.ToolCall], thought: str | None = None) -> list[dict[str, Any]]:
    """A message's ``content``: its thinking block (``thought`` is not None), its text (a text block, also when it is
    empty and nothing else is), then its ``tool_use`` blocks; a call whose arguments were cut short (``max_tokens``)
    is left out."""
    blocks = [] if thought is None else [thinking_block(thought)]
    if text or not calls and thought is None:
        blocks.append({"type": "text", "text": text})
    for call in calls:
        arguments = tool_input(call.arguments)
        if arguments is not None:
            blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": arguments})
    return blocks


def message(ident: str, model: str, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
            counts: dict[str, Any]) -> dict[str, Any]:
    return {"id": ident, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": counts}


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event: ``event: <name>``, ``data: <json>`` and a blank line."""
    return f"event: {name}\ndata: ".encode() + jsoncodec.dumps(data) + b"\n\n"


PING = event("ping", {"type": "ping"})


def error_document(error: ApplianceError) -> dict[str, Any]:
    """Anthropic's error envelope, with the P4 error's ``code``, ``retryable`` and ``details`` in ``error``."""
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.http_status, "api_error"),
                                       "message": error.message, "code": error.code,
                                       "retryable": error.retryable, "details": error.details}}


def message_start(ident: str, model: str) -> bytes:
    """The stream's first event: the message without content; its usage comes with ``message_delta``."""
    return event("message_start", {"type": "message_start",
                                   "message": message(ident, model, [], None, None, usage(0, 0, 0))})


def message_end(reason: str, sequence: str | None, counts: dict[str, Any]) -> list[bytes]:
    return [event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                       "stop_sequence": sequence},
                                    "usage": counts}),
            event("message_stop", {"type": "message_stop"})]


@dataclass
class StreamBlocks:
    """A stream's content blocks, from a reply's events (:class:`~appliance.engine.reply.ReplyStream`): reasoning
    becomes a ``thinking`` block and its ``thinking_delta`` s (as ``display`` says), text ``text`` blocks and their
    ``text_delta`` s, a call a ``tool_use`` block (its id and name at its start) and its arguments'
    ``input_json_delta`` s; a block is stopped when the next one starts or the message ends. The first block's
    start is followed by a ``ping``, as Anthropic sends it. A message without any block gets an empty text block."""

    index: int = -1
    kind: str | None = None  # the open block's type; None: none open
    called: bool = False
    display: ThinkingDisplay = "shown"

    def feed(self, events: Sequence[ReplyEvent]) -> list[bytes]:
        out: list[bytes] = []
        for item in events:
            if isinstance(item, reasoning.Reasoning):
                out += self.thought(item.text)
            elif isinstance(item, toolcalls.Content):
                if self.kind != "text":
                    out += self.start({"type": "text", "text": ""})
                out.append(self.delta({"type": "text_delta", "text": item.text}))
            elif isinstance(item, toolcalls.CallStart):
                self.called = True
                out += self.start({"type": "tool_use", "id": item.id, "name": item.name, "input": {}})
            elif self.kind == "tool_use":
                out.append(self.delta({"type": "input_json_delta", "partial_json": item.text}))
        return out

    def thought(self, text: str) -> list[bytes]:
        if self.display == "dropped":
            return []
        out = self.start(thinking_block("")) if self.kind != "thinking" else []
        if self.display == "shown":
            out.append(self.delta({"type": "thinking_delta", "thinking": text}))
        return out

    def start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.stop()
        self.index += 1
        self.kind = block["type"]
        out.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block}))
        if self.index == 0:
            out.append(PING)
        return out

    def delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def stop(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def finish(self) -> list[bytes]:
        out = self.start({"type": "text", "text": ""}) if self.index < 0 else []
        return out + self.stop()
