"""The OpenAI-compatible API's requests and responses, as pure functions (SPEC W2; the routes are
:mod:`appliance.http.openai`).

* Requests: :func:`parse_body`, then :func:`chat_request` / :func:`completion_request` check every field and give a
  :class:`ChatRequest` / :class:`CompletionRequest`. A bad field is a P4 ``BAD_REQUEST`` whose ``details.param``
  names it (OpenAI's ``error.param``); a field the appliance does not support is refused the same way unless it is
  one of :data:`IGNORED` (accepted, no effect) or has its no-op value (``n: 1``, ``tools: []``, ...).
* Responses: the JSON documents and server-sent-event chunks in OpenAI's shapes.
* Conversations: :func:`continuation`, the part of a new prompt an agent's conversation does not hold yet.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from appliance.engine.chat import Turn
from appliance.engine.interface import Sampling, StopReason
from appliance.errors import ApplianceError
from appliance.protocol.identifiers import AGENT_ID_RULE, MAX_AGENT_ID_CHARS, agent_id_problem
from appliance.protocol.messages import MAX_CHAT_MESSAGES, MAX_ID_CHARS, MAX_STOP_STRINGS, MAX_TOKENS_LIMIT

MAX_BODY_BYTES = 4 * 1024 * 1024
"""The largest request body read (a P4 ``BAD_REQUEST`` naming the limit above it)."""
MAX_JSON_DEPTH = 64
MAX_STOP_CHARS = 256
MAX_SEED = 2**63
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_call_id", "refusal"})
EMPTY_MESSAGE_KEYS = frozenset({"tool_calls", "function_call", "audio"})  # accepted only empty (no tool calls)
IGNORED = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                     "safety_identifier"})
"""Fields accepted and ignored (they change nothing here)."""
DEFAULT_TEMPERATURE = 1.0  # OpenAI's defaults
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = Sampling().top_k
STOP_REASONS: dict[StopReason, str] = {"eos": "stop", "stop": "stop", "length": "length"}


def bad(param: str | None, message: str, **details: Any) -> ApplianceError:
    return ApplianceError("BAD_REQUEST", message, {"param": param, **details})


# -- the body ------------------------------------------------------------------------------------------------------


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def json_depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (iterative: a hostile body cannot exhaust the stack)."""
    deepest = 0
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                todo.extend((child, depth + 1) for child in item)
    return deepest


def parse_body(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object; ``BAD_REQUEST`` (``param: None``) for anything else."""
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad(None, "the request body is not valid UTF-8 JSON") from None
    if not isinstance(value, dict):
        raise bad(None, "the request body must be a JSON object")
    if json_depth(value) > MAX_JSON_DEPTH:
        raise bad(None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", max_depth=MAX_JSON_DEPTH)
    return value


# -- fields --------------------------------------------------------------------------------------------------------


def has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def text_field(value: Any, param: str) -> str:
    if not isinstance(value, str) or has_surrogate(value):
        raise bad(param, f"{param} must be a string of valid Unicode")
    return value


def identifier(value: Any, param: str) -> str:
    """A name (a model, a message's ``name``): 1 to :data:`MAX_ID_CHARS` characters of valid Unicode."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS or has_surrogate(value):
        raise bad(param, f"{param} must be a string of 1 to {MAX_ID_CHARS} characters", max_chars=MAX_ID_CHARS)
    return value


def agent_id(value: Any, param: str) -> str:
    """An agent's name (``user``, ``X-Agent-Id``): the agents' one rule (protocol.identifiers), so the agent
    it registers can be named again on every surface."""
    problem = agent_id_problem(value)
    if problem is not None:
        raise bad(param, f"{param} {problem}", rule=AGENT_ID_RULE, max_chars=MAX_AGENT_ID_CHARS)
    return value


def number(value: Any, param: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise bad(param, f"{param} must be a number from {low:g} to {high:g}", minimum=low, maximum=high)
    return float(value)


def integer(value: Any, param: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(param, f"{param} must be an integer from {low} to {high}", minimum=low, maximum=high)
    return value


def boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise bad(param, f"{param} must be true or false")
    return value


def stop_strings(value: Any) -> tuple[str, ...]:
    """``stop``: null, a string or a list of at most :data:`MAX_STOP_STRINGS` non-empty strings."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP_STRINGS:
        raise bad("stop", f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings",
                  max_items=MAX_STOP_STRINGS)
    for item in items:
        if not isinstance(item, str) or not 0 < len(item) <= MAX_STOP_CHARS or has_surrogate(item):
            raise bad("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters",
                      max_chars=MAX_STOP_CHARS)
    return tuple(items)


def only(value: Any, param: str, allowed: tuple[Any, ...], message: str) -> None:
    """A field this API accepts with its no-op values only (``n: 1``, ``tools: []``, ...)."""
    if value is None:
        return
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise bad(param, message)


def content_text(value: Any, param: str, role: str) -> str:
    """A message's content: a string, a list of text parts (joined), or null for an assistant message."""
    if isinstance(value, str):
        return text_field(value, param)
    if value is None and role == "assistant":
        return ""
    if not isinstance(value, list):
        raise bad(param, f"{param} must be a string or a list of text parts")
    texts = []
    for index, part in enumerate(value):
        where = f"{param}[{index}]"
        if not isinstance(part, dict) or part.get("type") != "text" or set(part) - {"type", "text"}:
            raise bad(where, f"{where} must be a text part ({{\"type\": \"text\", \"text\": ...}}): this API takes "
                             "text only")
        texts.append(text_field(part.get("text"), f"{where}.text"))
    return "".join(texts)


def chat_messages(value: Any) -> tuple[Turn, ...]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_CHAT_MESSAGES:
        raise bad("messages", f"messages must be a list of 1 to {MAX_CHAT_MESSAGES} messages",
                  max_items=MAX_CHAT_MESSAGES)
    turns = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad(where, f"{where} must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(sorted(ROLES))}")
        for key in message:
            if key in EMPTY_MESSAGE_KEYS:
                if message[key]:
                    raise bad(f"{where}.{key}", f"{where}.{key} is not supported (no tool calls)")
            elif key not in MESSAGE_KEYS:
                raise bad(f"{where}.{key}", f"unknown field {where}.{key}")
        if "content" not in message:
            raise bad(f"{where}.content", f"{where}.content is required")
        if message.get("name") is not None:
            identifier(message["name"], f"{where}.name")
        turns.append(Turn(role, content_text(message["content"], f"{where}.content", role)))
    return tuple(turns)


def completion_prompt(value: Any) -> str:
    """``prompt``: a non-empty string, or a list of exactly one (token arrays are not supported)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str) or not value:
        raise bad("prompt", "prompt must be a non-empty string (one prompt per request; no token arrays)")
    return text_field(value, "prompt")


# -- requests ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """What both endpoints take."""

    model: str
    max_tokens: int | None  # None: as many as the context leaves room for
    temperature: float
    top_p: float
    top_k: int
    seed: int | None  # None: a fresh one per request
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    user: str | None

    def sampling(self, seed: int) -> Sampling:
        """The engine's sampling settings, with ``seed`` when the request gave none."""
        chosen = seed if self.seed is None else self.seed
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        seed=chosen % (2**32 - 1), stop=self.stop)


@dataclass(frozen=True)
class ChatRequest(Options):
    messages: tuple[Turn, ...] = ()


@dataclass(frozen=True)
class CompletionRequest(Options):
    prompt: str = ""


Check = Callable[[dict[str, Any]], None]


def _no_n(body: dict[str, Any]) -> None:
    only(body.get("n"), "n", (1,), "n must be 1 (one choice per request)")


def _penalties(body: dict[str, Any]) -> None:
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) is not None:
            number(body[key], key, -2.0, 2.0)
            only(body[key], key, (0, 0.0), f"{key} is not supported (only 0)")
    only(body.get("logit_bias"), "logit_bias", ({},), "logit_bias is not supported (only {})")


def _chat_extras(body: dict[str, Any]) -> None:
    only(body.get("logprobs"), "logprobs", (False,), "logprobs is not supported")
    only(body.get("top_logprobs"), "top_logprobs", (0,), "top_logprobs is not supported")
    only(body.get("tools"), "tools", ([],), "tools are not supported")
    only(body.get("functions"), "functions", ([],), "functions are not supported")
    only(body.get("tool_choice"), "tool_choice", ("none",), "tool_choice must be \"none\" (no tools)")
    only(body.get("function_call"), "function_call", ("none",), "function_call must be \"none\" (no tools)")
    only(body.get("response_format"), "response_format", ({"type": "text"},),
         "response_format must be {\"type\": \"text\"}")
    only(body.get("modalities"), "modalities", (["text"],), "modalities must be [\"text\"]")
    only(body.get("audio"), "audio", (), "audio is not supported")


def _completion_extras(body: dict[str, Any]) -> None:
    only(body.get("logprobs"), "logprobs", (0,), "logprobs is not supported")
    only(body.get("echo"), "echo", (False,), "echo is not supported")
    only(body.get("best_of"), "best_of", (1,), "best_of must be 1")
    only(body.get("suffix"), "suffix", (), "suffix is not supported")


COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                           "stream_options", "n", "user", "presence_penalty", "frequency_penalty", "logit_bias",
                           "logprobs"}) | IGNORED
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "functions", "function_call", "response_format", "modalities", "audio"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}


def options(body: dict[str, Any], fields: frozenset[str], extras: Check) -> dict[str, Any]:
    """The checked fields both endpoints share, as keyword arguments of :class:`Options`."""
    for key in body:
        if key not in fields:
            raise bad(key, f"unknown or unsupported field {key!r}")
    if "model" not in body:
        raise bad("model", "model is required")
    model = identifier(body["model"], "model")
    max_tokens = None
    for key in ("max_tokens", "max_completion_tokens"):  # the newer name wins when both are given
        if body.get(key) is not None:
            max_tokens = integer(body[key], key, 1, MAX_TOKENS_LIMIT)
    temperature = DEFAULT_TEMPERATURE if body.get("temperature") is None else number(
        body["temperature"], "temperature", 0.0, 2.0)
    top_p = DEFAULT_TOP_P if body.get("top_p") is None else number(body["top_p"], "top_p", 0.0, 1.0)
    top_k = DEFAULT_TOP_K if body.get("top_k") is None else integer(body["top_k"], "top_k", 0, 1 << 20)
    seed = None if body.get("seed") is None else integer(body["seed"], "seed", -MAX_SEED, MAX_SEED - 1)
    stream = False if body.get("stream") is None else boolean(body["stream"], "stream")
    include_usage = False
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise bad("stream_options", "stream_options is only allowed with stream: true")
        if not isinstance(stream_options, dict):
            raise bad("stream_options", "stream_options must be an object")
        for key, value in stream_options.items():
            if key not in ("include_usage", "include_obfuscation"):
                raise bad(f"stream_options.{key}", f"unknown field stream_options.{key}")
            if value is not None:
                boolean(value, f"stream_options.{key}")
        include_usage = stream_options.get("include_usage") is True
    user = None if body.get("user") is None else agent_id(body["user"], "user")
    _no_n(body)
    _penalties(body)
    extras(body)
    return {"model": model, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "seed": seed, "stop": stop_strings(body.get("stop")), "stream": stream, "include_usage": include_usage,
            "user": user}


def chat_request(body: dict[str, Any]) -> ChatRequest:
    """``POST /v1/chat/completions``'s body, checked."""
    common = options(body, CHAT_FIELDS, _chat_extras)
    if "messages" not in body:
        raise bad("messages", "messages is required")
    return ChatRequest(**common, messages=chat_messages(body["messages"]))


def completion_request(body: dict[str, Any]) -> CompletionRequest:
    """``POST /v1/completions``'s body, checked."""
    common = options(body, COMPLETION_FIELDS, _completion_extras)
    if "prompt" not in body:
        raise bad("prompt", "prompt is required")
    return CompletionRequest(**common, prompt=completion_prompt(body["prompt"]))


def agent_name(user: str | None, header: str | None) -> str | None:
    """The agent a request names: its ``X-Agent-Id`` header, else its ``user`` field, else none (stateless)."""
    if header is not None:
        return agent_id(header.strip(), "X-Agent-Id")
    return user


# -- conversations -------------------------------------------------------------------------------------------------


def continuation(held: str | None, prompt: str) -> str | None:
    """What ``prompt`` adds to the text a conversation already ``held`` (its prompts and completions so far), or
    None when it does not start with that text (the client changed the history: the conversation starts over).
    ``held`` None: what the conversation holds is not known (it starts over too)."""
    if held is None or not prompt.startswith(held):
        return None
    return prompt[len(held):]


# -- responses -----------------------------------------------------------------------------------------------------


def finish_reason(stop_reason: StopReason) -> str:
    return STOP_REASONS.get(stop_reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage``: ``prompt_tokens`` is the whole prompt the model saw (with what the conversation already
    held), ``prompt_tokens_details.cached_tokens`` the part of it that was not evaluated again."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_completion(ident: str, created: int, model: str, text: str, finish: str,
                    counts: dict[str, Any]) -> dict[str, Any]:
    return {"id": ident, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                         "logprobs": None, "finish_reason": finish}],
            "usage": counts, "system_fingerprint": None}


def chat_chunk(ident: str, created: int, model: str, delta: dict[str, Any], finish: str | None,
               with_usage: bool) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                             "system_fingerprint": None}
    if with_usage:
        chunk["usage"] = None
    return chunk


def text_completion(ident: str, created: int, model: str, text: str, finish: str | None,
                    counts: dict[str, Any] | None, with_usage: bool = True) -> dict[str, Any]:
    """A completion, or one chunk of a streamed one (``counts`` None)."""
    document: dict[str, Any] = {"id": ident, "object": "text_completion", "created": created, "model": model,
                                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                                "system_fingerprint": None}
    if with_usage:
        document["usage"] = counts
    return document


def usage_chunk(ident: str, created: int, model: str, counts: dict[str, Any], obj: str) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": ident, "object": obj, "created": created, "model": model, "choices": [], "usage": counts,
            "system_fingerprint": None}


def model_list(models: list[tuple[str, int]]) -> dict[str, Any]:
    """``GET /v1/models`` for (name, created) pairs."""
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "appliance"}
                     for name, created in models]}


def event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or the literal ``[DONE]``) and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()
