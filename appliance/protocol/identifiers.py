"""The one rule for an agent's id, on every surface: the line protocol, MAGN ``session_id``, the OpenAI ``user``
and ``X-Agent-Id``, the admin page's forms, and :meth:`~appliance.daemon.core.Daemon.register` itself. So an agent
that one surface can register, every surface can name again (UNREGISTER, the admin form). Pure.

An id is 1 to :data:`MAX_AGENT_ID_CHARS` characters: a letter or digit, then letters, digits and ``_ . : @ + -``
(``user-123``, a UUID, an e-mail address); nothing a reply line, a page or a log line has to quote or escape.
"""

from __future__ import annotations

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
