"""The one rule for an agent's id, on every surface: the line protocol, MAGN ``session_id``, the OpenAI ``user``
and ``X-Agent-Id``, the admin page's forms, and :meth:`~appliance.daemon.core.Daemon.register` itself. So an agent
that one surface can register, every surface can name again (UNREGISTER, the admin form). Pure.

An id is 1 to :data:`MAX_AGENT_ID_CHARS` characters: a letter or digit, then letters, digits and ``_ . : @ + -``
(``user-123``, a UUID, an e-mail address); nothing a reply line, a page or a log line has to quote or escape.

An end user's conversation over HTTP is an agent per user and model (:func:`user_agent_id`): the OpenAI ``user``
names the person, not the conversation, so the same ``user`` on two models is two conversations.
"""

from __future__ import annotations

import hashlib
import re

MAX_AGENT_ID_CHARS = 64
AGENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@+-]{0,63}")
AGENT_ID_RULE = "1 to 64 characters of [A-Za-z0-9_.:@+-], starting with a letter or digit"
""":data:`AGENT_ID` in words, for error messages."""


def agent_id_problem(value: object) -> str | None:
    """Why ``value`` is not an agent id, as the end of a sentence about it (``"must be …"``); None when it is one."""
    if not isinstance(value, str):
        return f"must be a string of {AGENT_ID_RULE}"
    if not AGENT_ID.fullmatch(value):
        return f"must be {AGENT_ID_RULE}"
    return None


USER_HASH_CHARS = 12
"""Hex digits of the hash that ends a :func:`user_agent_id` too long (or not allowed) as ``<user>@<model>``."""
USER_MODEL_HEAD_CHARS = 16
"""At most this much of the model's name stays readable in a hashed :func:`user_agent_id`."""
NOT_IN_ID = re.compile(r"[^A-Za-z0-9_.:-]")


def user_agent_id(user: str, model: str) -> str:
    """The agent of an end user (an OpenAI ``user``, an Anthropic ``metadata.user_id``: each a valid agent id) on
    one model (its configured name): ``<user>@<model>`` when that is an agent id (at most 64 characters; a model
    name has no ``@``, so the last ``@`` splits it back). Otherwise, the beginning of each with a hash of both,
    ``<user…>@<model…>+<12 hex digits>``: a model name has no ``+``, so no hashed id is ever a plain one. The same
    user and model give the same id in every process (the agent outlives a restart)."""
    plain = f"{user}@{model}"
    if AGENT_ID.fullmatch(plain):
        return plain
    digest = hashlib.sha256(f"{user}\0{model}".encode()).hexdigest()[:USER_HASH_CHARS]
    model_head = NOT_IN_ID.sub("-", model)[:USER_MODEL_HEAD_CHARS]
    user_head = user[:MAX_AGENT_ID_CHARS - len(model_head) - USER_HASH_CHARS - 2]
    return f"{user_head}@{model_head}+{digest}"
