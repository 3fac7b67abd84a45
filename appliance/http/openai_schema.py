"""The OpenAI-compatible API's requests and responses, as pure functions (SPEC W2; the routes are
:mod:`appliance.http.openai`).

* Requests: :func:`parse_body`, then :func:`chat_request` / :func:`completion_request` check every field and give a
  :class:`ChatRequest` / :class:`CompletionRequest`. A bad field is a P4 ``BAD_REQUEST`` whose ``details.param``
  names it (OpenAI's ``error.param``); a field the appliance does not support is refused the same way, saying why,
  unless it is one of :data:`IGNORED` (accepted, no effect) or has its no-op value (``n: 1``, ``echo: false``, ...).
  Tools and ``tool_choice`` are checked by :mod:`appliance.engine.toolcalls`, ``response_format`` by
  :mod:`appliance.engine.structured` (into a grammar).
* Responses: the JSON documents and server-sent-event chunks in OpenAI's shapes, with tool calls and
  log-probabilities.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.engine import structured, toolcalls
from appliance.engine.chat import Message
from appliance.engine.interface import Grammar, Sampling, StopReason, TokenLogprob, TokenLogprobs
from appliance.errors import ApplianceError
from appliance.protocol import jsoncodec
from appliance.protocol.identifiers import AGENT_ID_RULE, MAX_AGENT_ID_CHARS, agent_id_problem
from appliance.protocol.messages import MAX_CHAT_MESSAGES, MAX_ID_CHARS, MAX_STOP_STRINGS, MAX_TOKENS_LIMIT

MAX_BODY_BYTES = 4 * 1024 * 1024
"""The largest request body read (a P4 ``BAD_REQUEST`` naming the limit above it)."""
MAX_JSON_DEPTH = 64
MAX_STOP_CHARS = 256
MAX_SEED = 2**63
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_call_id", "refusal", "tool_calls"})
EMPTY_MESSAGE_KEYS = {"function_call": "deprecated: use tool_calls", "audio": "this API takes text only"}
"""Message fields accepted only empty, and why."""
MAX_TOOL_CALLS = 128
"""Tool calls one assistant message of the history may hold."""
IGNORED = frozenset({"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
"""Fields accepted and ignored (they change nothing here)."""
DEFAULT_TEMPERATURE = 1.0  # OpenAI's defaults
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = Sampling().top_k
MAX_PENALTY = 2.0  # OpenAI's bound of frequency_penalty and presence_penalty, either sign
MAX_REPEAT_PENALTY = 10.0
MAX_BIAS = 100.0  # OpenAI's bound of a logit_bias value, either sign
MAX_BIASED_TOKENS = 1024
MAX_TOKEN_ID = 2**31 - 1
MAX_TOP_LOGPROBS = 20  # chat: OpenAI's bound
MAX_COMPLETION_LOGPROBS = 5  # completions: OpenAI's bound
UNLIKELY_LOGPROB = -9999.0
"""What a log-probability of minus infinity is written as (JSON has no infinity; OpenAI writes the same)."""
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
        value = jsoncodec.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
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
    """A field this API accepts with its no-op values only (``n: 1``, ``echo: false``, ...)."""
    if value is None:
        return
    if not any(type(value) is type(a) and value == a for a in allowed):
        raise bad(param, message)


def content_text(value: Any, param: str, role: str) -> str | None:
    """A message's content: a string, a list of text parts (joined), or null (None) for an assistant message."""
    if isinstance(value, str):
        return text_field(value, param)
    if value is None and role == "assistant":
        return None
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


def history_call(value: Any, where: str) -> toolcalls.ToolCall:
    """One call of an assistant message's ``tool_calls``: ``{"id", "type": "function", "function": {"name",
    "arguments"}}`` with ``arguments`` the JSON text of an object (as OpenAI returned it)."""
    if not isinstance(value, dict) or value.get("type", "function") != "function" or set(value) - {
            "id", "type", "function"}:
        raise bad(where, f'{where} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                         '"arguments": ...}}}}')
    ident = identifier(value.get("id"), f"{where}.id")
    function = value.get("function")
    if not isinstance(function, dict) or set(function) - {"name", "arguments"}:
        raise bad(f"{where}.function", f'{where}.function must be {{"name": ..., "arguments": ...}}')
    name = function.get("name")
    if not isinstance(name, str) or not toolcalls.TOOL_NAME.fullmatch(name):
        raise bad(f"{where}.function.name", f"{where}.function.name must be 1 to 64 letters, digits, _ or -")
    arguments = text_field(function.get("arguments"), f"{where}.function.arguments")
    try:
        parsed = json.loads(arguments, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict):
        raise bad(f"{where}.function.arguments", f"{where}.function.arguments must be the JSON text of an object")
    return toolcalls.ToolCall(ident, name, arguments)


def chat_message(message: Any, where: str) -> Message:
    if not isinstance(message, dict):
        raise bad(where, f"{where} must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role", f"{where}.role must be one of {', '.join(sorted(ROLES))}")
    for key in message:
        if key in EMPTY_MESSAGE_KEYS:
            if message[key]:
                raise bad(f"{where}.{key}", f"{where}.{key} is not supported ({EMPTY_MESSAGE_KEYS[key]})")
        elif key not in MESSAGE_KEYS:
            raise bad(f"{where}.{key}", f"unknown field {where}.{key}")
    calls: tuple[toolcalls.ToolCall, ...] = ()
    if message.get("tool_calls"):
        value = message["tool_calls"]
        if role != "assistant":
            raise bad(f"{where}.tool_calls", f"{where}.tool_calls is only allowed in an assistant message")
        if not isinstance(value, list) or len(value) > MAX_TOOL_CALLS:
            raise bad(f"{where}.tool_calls", f"{where}.tool_calls must be a list of at most {MAX_TOOL_CALLS} calls",
                      max_items=MAX_TOOL_CALLS)
        calls = tuple(history_call(call, f"{where}.tool_calls[{index}]") for index, call in enumerate(value))
    elif message.get("tool_calls") is not None and message["tool_calls"] != []:
        raise bad(f"{where}.tool_calls", f"{where}.tool_calls must be a list of calls")
    if "content" not in message and not calls:
        raise bad(f"{where}.content", f"{where}.content is required")
    content = content_text(message.get("content"), f"{where}.content", role)
    name = None if message.get("name") is None else identifier(message["name"], f"{where}.name")
    call_id = None
    if role == "tool":
        call_id = identifier(message.get("tool_call_id"), f"{where}.tool_call_id")
    elif message.get("tool_call_id") is not None:
        raise bad(f"{where}.tool_call_id", f"{where}.tool_call_id is only allowed in a tool message")
    if message.get("refusal") is not None:
        text_field(message["refusal"], f"{where}.refusal")
    return Message(role, content, calls, call_id, name)


def chat_messages(value: Any) -> tuple[Message, ...]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_CHAT_MESSAGES:
        raise bad("messages", f"messages must be a list of 1 to {MAX_CHAT_MESSAGES} messages",
                  max_items=MAX_CHAT_MESSAGES)
    return tuple(chat_message(message, f"messages[{index}]") for index, message in enumerate(value))


def completion_prompt(value: Any) -> str:
    """``prompt``: a non-empty string, or a list of exactly one (token arrays are not supported)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str) or not value:
        raise bad("prompt", "prompt must be a non-empty string (one prompt per request; no token arrays)")
    return text_field(value, "prompt")


def penalty(body: dict[str, Any], key: str) -> float:
    """``frequency_penalty`` / ``presence_penalty``: -2 to 2, default 0 (off)."""
    if body.get(key) is None:
        return 0.0
    return number(body[key], key, -MAX_PENALTY, MAX_PENALTY)


def repeat_penalty(value: Any) -> float:
    """``repeat_penalty`` (llama.cpp's): above 0 and at most 10; 1 (the default) is off."""
    if value is None:
        return 1.0
    chosen = number(value, "repeat_penalty", 0.0, MAX_REPEAT_PENALTY)
    if chosen <= 0.0:
        raise bad("repeat_penalty", f"repeat_penalty must be above 0 and at most {MAX_REPEAT_PENALTY:g} (1 is off)",
                  minimum=0.0, maximum=MAX_REPEAT_PENALTY)
    return chosen


def token_id(key: str) -> int | None:
    """A ``logit_bias`` key: a token id in decimal ("0", "15339"), else None."""
    if not key.isascii() or not key.isdigit() or len(key) > 10 or (len(key) > 1 and key[0] == "0"):
        return None
    value = int(key)
    return value if value <= MAX_TOKEN_ID else None


def logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: an object of token ids (decimal strings) to biases from -100 to 100, added to the token's
    logit before sampling (-100 all but bans it, 100 all but forces it); at most :data:`MAX_BIASED_TOKENS`. An id
    outside the model's vocabulary is refused by the engine (``details.n_vocab``)."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_BIASED_TOKENS:
        raise bad("logit_bias", f"logit_bias must be an object of at most {MAX_BIASED_TOKENS} token ids (decimal "
                                "strings) to numbers from -100 to 100", max_items=MAX_BIASED_TOKENS)
    biases = []
    for key, bias in value.items():
        token = token_id(key)
        if token is None:
            raise bad("logit_bias", f"logit_bias key {key[:40]!r} is not a token id (a decimal integer)")
        biases.append((token, number(bias, "logit_bias", -MAX_BIAS, MAX_BIAS)))
    return tuple(sorted(biases))


def chat_logprobs(body: dict[str, Any]) -> int | None:
    """``logprobs`` (true or false) and ``top_logprobs`` (0 to 20, only with ``logprobs: true``): how many
    alternatives each token lists, or None for no log-probabilities."""
    wanted = False if body.get("logprobs") is None else boolean(body["logprobs"], "logprobs")
    if body.get("top_logprobs") is None:
        return 0 if wanted else None
    top = integer(body["top_logprobs"], "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if not wanted:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    return top


def completion_logprobs(body: dict[str, Any]) -> int | None:
    """``logprobs`` of /v1/completions: null (none) or the number of alternatives, 0 to 5, each token lists."""
    if body.get("logprobs") is None:
        return None
    return integer(body["logprobs"], "logprobs", 0, MAX_COMPLETION_LOGPROBS)


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
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities
    response_grammar: Grammar | None = None  # response_format's

    def sampling(self, seed: int, grammar: Grammar | None = None) -> Sampling:
        """The engine's sampling settings, with ``seed`` when the request gave none and ``grammar`` (its tools')
        when it has no ``response_format`` grammar."""
        chosen = seed if self.seed is None else self.seed
        return Sampling(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                        seed=chosen % (2**32 - 1), stop=self.stop, min_p=self.min_p,
                        repeat_penalty=self.repeat_penalty, frequency_penalty=self.frequency_penalty,
                        presence_penalty=self.presence_penalty, logit_bias=self.logit_bias,
                        grammar=self.response_grammar or grammar, logprobs=self.logprobs)


@dataclass(frozen=True)
class ChatRequest(Options):
    messages: tuple[Message, ...] = ()
    tools: tuple[toolcalls.Tool, ...] = ()
    tool_choice: toolcalls.Choice = "auto"
    parallel_tool_calls: bool = True

    @property
    def calls_tools(self) -> bool:
        """The model may (or must) call tools: the output is parsed for calls."""
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(frozen=True)
class CompletionRequest(Options):
    prompt: str = ""


Check = Callable[[dict[str, Any]], dict[str, Any]]
"""An endpoint's own fields, checked, as keyword arguments of its request."""


def _no_n(body: dict[str, Any]) -> None:
    only(body.get("n"), "n", (1,), "n must be 1 (one choice per request)")


def _chat_extras(body: dict[str, Any]) -> dict[str, Any]:
    only(body.get("functions"), "functions", ([],), "functions is deprecated and not supported: use tools")
    only(body.get("function_call"), "function_call", ("none",),
         "function_call is deprecated and not supported: use tool_choice")
    only(body.get("modalities"), "modalities", (["text"],), "modalities must be [\"text\"] (this API takes text only)")
    only(body.get("audio"), "audio", (), "audio is not supported (this API takes text only)")
    if "messages" not in body:
        raise bad("messages", "messages is required")
    tools = toolcalls.parse_tools(body.get("tools"))
    choice = toolcalls.parse_choice(body.get("tool_choice"), tools)
    parallel = True if body.get("parallel_tool_calls") is None else boolean(body["parallel_tool_calls"],
                                                                             "parallel_tool_calls")
    grammar = structured.response_grammar(body.get("response_format"))
    if grammar is not None and tools and choice != "none":
        raise bad("response_format", "response_format cannot constrain an answer that may call tools: give one of "
                                     "response_format and tools, or tool_choice \"none\"")
    return {"messages": chat_messages(body["messages"]), "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": parallel, "logprobs": chat_logprobs(body), "response_grammar": grammar}


def _completion_extras(body: dict[str, Any]) -> dict[str, Any]:
    only(body.get("echo"), "echo", (False,), "echo is not supported (the prompt is not returned)")
    only(body.get("best_of"), "best_of", (1,), "best_of must be 1 (one choice per request)")
    only(body.get("suffix"), "suffix", ("",), "suffix is not supported (no fill-in-the-middle)")
    if "prompt" not in body:
        raise bad("prompt", "prompt is required")
    return {"prompt": completion_prompt(body["prompt"]), "logprobs": completion_logprobs(body),
            "response_grammar": structured.response_grammar(body.get("response_format"))}


COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                           "stream", "stream_options", "n", "user", "presence_penalty", "frequency_penalty",
                           "repeat_penalty", "logit_bias", "logprobs", "response_format"}) | IGNORED
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls", "functions", "function_call", "modalities", "audio"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}


def options(body: dict[str, Any], fields: frozenset[str]) -> dict[str, Any]:
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
    min_p = 0.0 if body.get("min_p") is None else number(body["min_p"], "min_p", 0.0, 1.0)
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
    return {"model": model, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
            "seed": seed, "stop": stop_strings(body.get("stop")), "stream": stream, "include_usage": include_usage,
            "user": user, "min_p": min_p, "repeat_penalty": repeat_penalty(body.get("repeat_penalty")),
            "frequency_penalty": penalty(body, "frequency_penalty"),
            "presence_penalty": penalty(body, "presence_penalty"), "logit_bias": logit_bias(body.get("logit_bias"))}


def builds_grammar(body: dict[str, Any]) -> bool:
    """Whether checking ``body`` may build a grammar (it has a ``response_format`` or ``tools``): a JSON schema's
    grammar can take long to build, so a route checks such a body off the event loop, and any other on it."""
    return body.get("response_format") is not None or bool(body.get("tools"))


def chat_request(body: dict[str, Any]) -> ChatRequest:
    """``POST /v1/chat/completions``'s body, checked."""
    common = options(body, CHAT_FIELDS)
    return ChatRequest(**common, **_chat_extras(body))


def completion_request(body: dict[str, Any]) -> CompletionRequest:
    """``POST /v1/completions``'s body, checked."""
    common = options(body, COMPLETION_FIELDS)
    return CompletionRequest(**common, **_completion_extras(body))


def agent_name(user: str | None, header: str | None) -> str | None:
    """The agent a request names: its ``X-Agent-Id`` header, else its ``user`` field, else none (stateless)."""
    if header is not None:
        return agent_id(header.strip(), "X-Agent-Id")
    return user


# -- responses -----------------------------------------------------------------------------------------------------


def finish_reason(stop_reason: StopReason, called: bool = False) -> str:
    """OpenAI's ``finish_reason``: ``length`` at ``max_tokens`` or a full context, else ``tool_calls`` when the
    answer ``called`` tools, else ``stop``."""
    reason = STOP_REASONS.get(stop_reason, "stop")
    return "tool_calls" if called and reason == "stop" else reason


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage``: ``prompt_tokens`` is the whole prompt the model saw (with what the conversation already
    held), ``prompt_tokens_details.cached_tokens`` the part of it that was not evaluated again."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def tool_call(call: toolcalls.ToolCall) -> dict[str, Any]:
    """A call in ``message.tool_calls``."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def assistant_message(content: str | None, calls: Sequence[toolcalls.ToolCall] = ()) -> dict[str, Any]:
    """A choice's ``message``: ``content`` None (``null``) when the answer is only calls."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = [tool_call(call) for call in calls]
    return message


def call_start(index: int, ident: str, name: str) -> dict[str, Any]:
    """A stream's ``delta.tool_calls`` entry that opens call ``index``: its id, type and name (arguments follow)."""
    return {"index": index, "id": ident, "type": "function", "function": {"name": name, "arguments": ""}}


def call_arguments(index: int, text: str) -> dict[str, Any]:
    """A stream's ``delta.tool_calls`` entry with the next piece of call ``index``'s arguments."""
    return {"index": index, "function": {"arguments": text}}


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else UNLIKELY_LOGPROB


def token_text(piece: bytes) -> str:
    """A token's text as the log-probabilities show it (a piece that is part of a character shows U+FFFD; its
    ``bytes`` are exact)."""
    return piece.decode("utf-8", errors="replace")


def alternative(token: TokenLogprob) -> dict[str, Any]:
    return {"token": token_text(token.piece), "logprob": finite(token.logprob), "bytes": list(token.piece)}


def chat_logprob(entry: TokenLogprobs) -> dict[str, Any]:
    """One generated token in a chat choice's ``logprobs.content``: its text, log-probability and bytes, and its
    likeliest alternatives."""
    return {**alternative(entry.token), "top_logprobs": [alternative(token) for token in entry.top]}


def chat_logprobs_of(entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """A chat choice's ``logprobs``."""
    return {"content": [chat_logprob(entry) for entry in entries], "refusal": None}


def completion_logprobs_of(entries: Sequence[TokenLogprobs], offset: int = 0) -> dict[str, Any]:
    """A text completion choice's ``logprobs``: the tokens, their log-probabilities, their alternatives ({text:
    log-probability}) and where each token starts in the completion's text (characters, from ``offset``)."""
    tokens = [token_text(entry.token.piece) for entry in entries]
    offsets = []
    at = offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top = [{token_text(alt.piece): finite(alt.logprob) for alt in entry.top} for entry in entries]
    return {"tokens": tokens, "token_logprobs": [finite(entry.token.logprob) for entry in entries],
            "top_logprobs": top, "text_offset": offsets}


def chat_completion(ident: str, created: int, model: str, message: dict[str, Any], finish: str,
                    counts: dict[str, Any], logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": ident, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
            "usage": counts, "system_fingerprint": None}


def chat_chunk(ident: str, created: int, model: str, delta: dict[str, Any], finish: str | None,
               with_usage: bool, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model,
                             "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                             "system_fingerprint": None}
    if with_usage:
        chunk["usage"] = None
    return chunk


def text_completion(ident: str, created: int, model: str, text: str, finish: str | None,
                    counts: dict[str, Any] | None, with_usage: bool = True,
                    logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A completion, or one chunk of a streamed one (``counts`` None)."""
    document: dict[str, Any] = {"id": ident, "object": "text_completion", "created": created, "model": model,
                                "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                             "finish_reason": finish}],
                                "system_fingerprint": None}
    if with_usage:
        document["usage"] = counts
    return document


def usage_chunk(ident: str, created: int, model: str, counts: dict[str, Any], obj: str) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": ident, "object": obj, "created": created, "model": model, "choices": [], "usage": counts,
            "system_fingerprint": None}


def model_list(models: list[tuple[str, int, str]]) -> dict[str, Any]:
    """``GET /v1/models`` for (name, created, root) triples: an alias is listed as a model whose ``root`` is the
    model it names."""
    return {"object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "appliance", "root": root}
                     for name, created, root in models]}


def event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or the literal ``[DONE]``) and a blank line."""
    if isinstance(data, str):
        return f"data: {data}\n\n".encode()
    return b"data: " + jsoncodec.dumps(data) + b"\n\n"
