"""Turning chat messages into one prompt (pure: file reads, no IO framework).

* The model's own template: a GGUF's ``tokenizer.chat_template`` (a Jinja2 template, as Hugging Face writes it),
  read within bounds by :func:`read_chat_template` (with the text of its BOS and EOS tokens) and rendered by
  :func:`render_template` in a sandboxed Jinja2 environment (``messages``, ``add_generation_prompt=True``,
  ``bos_token``, ``eos_token``, ``raise_exception``). A template that does not compile or fails to render is a
  P4 ``BAD_REQUEST`` (``details.param = "messages"``), never a 500.
* The plain fallback for a model without one (the tiny demo models): ``<role>: <content>`` lines, then
  ``assistant: ``. The generation prompt is a prefix of the assistant message the client sends back next turn
  (``assistant: <content>``), so a conversation's next prompt starts with the text it already holds.

The runtime adds the BOS token itself, so a rendered prompt that starts with the BOS token's text loses it.
"""

from __future__ import annotations

import datetime
import functools
import json
import mmap
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from appliance.engine import gguf_meta
from appliance.errors import ApplianceError

TEMPLATE_KEY = "tokenizer.chat_template"
BOS_KEY = "tokenizer.ggml.bos_token_id"
EOS_KEY = "tokenizer.ggml.eos_token_id"
TOKENS_KEY = "tokenizer.ggml.tokens"
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
class ChatTemplate:
    """A model's chat template (``source`` None: it has none) and its BOS / EOS token texts."""

    source: str | None
    bos_token: str = ""
    eos_token: str = ""


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

    def value(self, key: str, *, keep: bool) -> Any:
        if key not in (TEMPLATE_KEY, BOS_KEY, EOS_KEY, TOKENS_KEY):
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


def read_chat_template(path: str | os.PathLike[str]) -> ChatTemplate:
    """The chat template of the GGUF at ``path`` and its BOS / EOS texts, read with the bounds of
    :func:`appliance.engine.gguf_meta.read_header`; raises its ``MODEL_LOAD_FAILED`` for a bad file."""
    path = Path(path)
    if not gguf_meta.is_gguf(path):
        raise ApplianceError("MODEL_LOAD_FAILED", f"{path} is not a readable GGUF file", {"path": str(path)})
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            skim = _TemplateSkim(path, view)
            skim.header()
            return ChatTemplate(skim.template, skim.token_text(skim.token_ids.get(BOS_KEY)),
                                skim.token_text(skim.token_ids.get(EOS_KEY)))
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
    """The sandbox templates render in, set up as Hugging Face's ``apply_chat_template`` does."""
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
    try:
        return environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise template_error("the model's chat template does not compile",
                             reason=f"{type(exc).__name__} at line {getattr(exc, 'lineno', None)}") from None


def render_template(template: ChatTemplate, messages: Sequence[Turn]) -> str:
    """The prompt for ``messages`` under ``template`` (the plain fallback when it has no source), without a
    leading BOS token text. Raises ``BAD_REQUEST`` (``param: messages``) when the template refuses or fails."""
    if template.source is None:
        return render_chat(messages)
    program = compiled(template.source)
    context = {"messages": [{"role": m.role, "content": m.content} for m in messages],
               "add_generation_prompt": True, "bos_token": template.bos_token, "eos_token": template.eos_token}
    pieces: list[str] = []
    size = 0
    try:
        for piece in program.generate(context):
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
    prompt = "".join(pieces)
    if template.bos_token and prompt.startswith(template.bos_token):
        prompt = prompt[len(template.bos_token):]
    return prompt
