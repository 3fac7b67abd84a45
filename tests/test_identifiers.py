"""The agents' one identifier rule (appliance/identifiers.py) on every surface, and the ``max_agents`` bound in the
daemon's ``register`` (on a fake engine: no model, no sleeping)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_daemon_core import Env, error_of, run

from appliance.errors import ApplianceError
from appliance.http import openai_schema
from appliance.http.admin.registry import agent_field
from appliance.protocol import lines
from appliance.protocol import messages as m
from appliance.protocol.frames import LocalProtocolError
from appliance.protocol.identifiers import (
    AGENT_ID,
    AGENT_ID_RULE,
    MAX_AGENT_ID_CHARS,
    agent_id_problem,
    user_agent_id,
)

ACCEPTED = ["user-123", "550e8400-e29b-41d4-a716-446655440000", "alice@example.com", "bob+agents@mail.example.org",
            "org:team.agent_7", "A", "9", "x" * MAX_AGENT_ID_CHARS]
"""Common OpenAI ``user`` values (a name, a UUID, e-mail addresses) and the rule's edges."""
REFUSED = ["", "John Smith", " lead", "-dash-first", "@first", "x" * (MAX_AGENT_ID_CHARS + 1), "zoë", "a/b", "a\nb",
           "tab\there", 'quo"te', "eq=ual", "back\\slash", "\u2028", "a" + "\U0001f600"]
"""What one surface used to accept and another could not name again: spaces, non-ASCII, 65 characters, ..."""


def line_accepts(agent_id: str) -> bool:
    """The line protocol names exactly this id (it splits at blanks, so ``" x"`` would name ``x``)."""
    try:
        return lines.parse_line(f"UNREGISTER {agent_id}").agent == agent_id
    except ApplianceError:
        return False


def magn_accepts(agent_id: str) -> bool:
    try:
        m.TaskStart("t1", agent_id, "demo")
        m.InferRequest("t2", session_id=agent_id, prompt="hi")
    except LocalProtocolError:
        return False
    return True


def openai_accepts(agent_id: str) -> bool:
    """``user`` and ``X-Agent-Id`` (read stripped, so it must name exactly this id) both take it."""
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "user": agent_id}
    try:
        user = openai_schema.chat_request(body).user
        header = openai_schema.agent_name(None, agent_id)
    except ApplianceError:
        return False
    return user == header == agent_id


def admin_accepts(agent_id: str) -> bool:
    try:
        agent_field({"agent": agent_id})
    except ApplianceError:
        return False
    return True


SURFACES = {"rule": lambda agent_id: agent_id_problem(agent_id) is None, "line": line_accepts, "magn": magn_accepts,
            "openai": openai_accepts, "admin": admin_accepts}


@pytest.mark.parametrize("agent_id", ACCEPTED)
def test_common_ids_are_accepted_on_every_surface(agent_id: str) -> None:
    assert {name: accepts(agent_id) for name, accepts in SURFACES.items()} == dict.fromkeys(SURFACES, True)


@pytest.mark.parametrize("agent_id", REFUSED)
def test_an_id_outside_the_rule_is_refused_on_every_surface(agent_id: str) -> None:
    assert {name: accepts(agent_id) for name, accepts in SURFACES.items()} == dict.fromkeys(SURFACES, False)


@settings(max_examples=200, deadline=None)
@given(agent_id=st.text(min_size=0, max_size=70) | st.from_regex(AGENT_ID, fullmatch=True))
def test_every_surface_agrees_with_the_rule(agent_id: str) -> None:
    """An id one surface can register, every surface can name again; one it refuses, every surface refuses."""
    verdicts = {name: accepts(agent_id) for name, accepts in SURFACES.items()}
    assert len(set(verdicts.values())) == 1, verdicts


def test_the_refusals_name_the_rule_and_the_field() -> None:
    with pytest.raises(ApplianceError) as line:
        lines.parse_line("REGISTER zoë demo")
    assert line.value.code == "BAD_REQUEST" and AGENT_ID_RULE in line.value.message
    assert line.value.details == {"agent": "zoë", "max_agent_chars": MAX_AGENT_ID_CHARS}
    with pytest.raises(LocalProtocolError) as magn:
        m.TaskStart("t1", "John Smith", "demo")
    assert magn.value.error.details == {"field": "session_id", "reason": f"must be {AGENT_ID_RULE}"}
    with pytest.raises(ApplianceError) as user:
        openai_schema.agent_id("John Smith", "user")
    assert user.value.code == "BAD_REQUEST" and user.value.details["param"] == "user"
    assert user.value.message == f"user must be {AGENT_ID_RULE}" and user.value.details["rule"] == AGENT_ID_RULE
    with pytest.raises(ApplianceError) as header:
        openai_schema.agent_name(None, "a b")
    assert header.value.details["param"] == "X-Agent-Id"
    with pytest.raises(ApplianceError) as form:
        agent_field({"agent": "a b"})
    assert form.value.details["field"] == "agent" and AGENT_ID_RULE in form.value.message


def test_task_ids_are_not_agent_ids_and_keep_their_own_limit() -> None:
    start = m.TaskStart("task with spaces ü", "agent-1", "demo")
    assert start.task_id == "task with spaces ü"


# -- the daemon's register: the last line of defence and max_agents ------------------------------------------------


@pytest.mark.parametrize("agent_id", ["John Smith", "zoë", "x" * 65, ""])
def test_the_daemon_refuses_an_id_outside_the_rule(tmp_path: Path, agent_id: str) -> None:
    async def body(env: Env) -> None:
        error = await error_of(env.daemon.register(agent_id, "m"))
        assert error.code == "BAD_REQUEST" and error.details["rule"] == AGENT_ID_RULE
        assert not env.daemon.agents and "m" not in env.daemon.models  # refused before anything was resolved

    run(tmp_path, body)


def test_one_agent_beyond_max_agents_is_refused_and_the_others_keep_working(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon = env.daemon
        owner = object()
        await daemon.register("a0", "m")
        await daemon.register("a1", "m", owner=owner)  # every owner counts: a MAGN connection's agent too
        await daemon.register("a2", "other")
        error = await error_of(daemon.register("a3", "m"))
        assert (error.code, error.details, error.retryable) == ("TOO_MANY_AGENTS", {"max_agents": 3}, True)
        assert error.http_status == 429 and sorted(daemon.agents) == ["a0", "a1", "a2"]
        assert daemon.models["m"].refcount == 2  # the refusal held nothing
        assert (await error_of(daemon.register("a0", "m"))).code == "AGENT_EXISTS"  # still said precisely
        result = await daemon.decode("a0", 2, "Hi")
        assert result.generation.generated_tokens == 2
        await daemon.unregister("a2")
        await daemon.register("a3", "m")  # room again
        assert sorted(daemon.agents) == ["a0", "a1", "a3"]

    run(tmp_path, body, models={"m": {}, "other": {}}, max_agents=3)


def test_registrations_in_progress_count_towards_max_agents(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, load_gate = env.daemon, env.engine.load_gate
        load_gate.close()
        first = asyncio.create_task(daemon.register("a0", "m"))
        second = asyncio.create_task(daemon.register("a1", "m"))
        await load_gate.arrival(1)  # both wait for the model's load
        error = await error_of(daemon.register("a2", "m"))
        assert error.code == "TOO_MANY_AGENTS"
        load_gate.open()
        await asyncio.gather(first, second)
        assert sorted(daemon.agents) == ["a0", "a1"]

    run(tmp_path, body, max_agents=2)


def test_the_registry_table_and_the_models_holders_are_bounded(tmp_path: Path) -> None:
    from appliance.http.admin.registry import listing
    from appliance.protocol import paging

    async def body(env: Env) -> None:
        daemon = env.daemon
        for index in range(paging.ADMIN_AGENTS + 7):
            await daemon.register(f"agent-{index}", "m")
        first: dict[str, Any] = listing(daemon, 0)
        assert [a["id"] for a in first["agents"]] == [f"agent-{i}" for i in range(paging.ADMIN_AGENTS)]
        [model] = first["models"]
        assert len(model["agents"]) == paging.HOLDERS_SHOWN
        assert model["more_agents"] == paging.ADMIN_AGENTS + 7 - paging.HOLDERS_SHOWN
        last = listing(daemon, paging.ADMIN_AGENTS)
        assert [a["id"] for a in last["agents"]] == [f"agent-{paging.ADMIN_AGENTS + i}" for i in range(7)]
        assert last["agents_page"].next_offset is None and last["agents_page"].previous_offset == 0

    run(tmp_path, body)


# -- an end user's agent on a model (issue #26: the OpenAI ``user`` names a user, not a conversation) --------------


@pytest.mark.parametrize(
    ("user", "model", "expected"),
    [
        ("alice", "demo", "alice@demo"),
        ("alice@example.com", "demo-wide", "alice@example.com@demo-wide"),  # an e-mail address: the last @ splits
        ("u", "m" * 62, "u@" + "m" * 62),  # exactly 64 characters
    ],
    ids=["name", "e-mail", "at-the-limit"],
)
def test_a_users_agent_on_a_model_is_user_at_model(user: str, model: str, expected: str) -> None:
    assert user_agent_id(user, model) == expected
    assert agent_id_problem(expected) is None


@pytest.mark.parametrize(
    ("user", "model"),
    [("x" * MAX_AGENT_ID_CHARS, "demo"), ("u", "m" * 63), ("bob", "/models/qwen 7b.gguf"), ("a" * 40, "b" * 40)],
    ids=["long-user", "long-model", "a-path", "both-long"],
)
def test_a_users_agent_too_long_or_not_allowed_as_user_at_model_is_hashed(user: str, model: str) -> None:
    agent = user_agent_id(user, model)
    assert agent_id_problem(agent) is None and len(agent) <= MAX_AGENT_ID_CHARS
    head, _, tail = agent.rpartition("@")
    assert user.startswith(head) and "+" in tail  # readable start of each, then the hash after the model's part
    assert user_agent_id(user, model) == agent  # the same in every call


def test_a_users_agent_is_the_same_in_every_process() -> None:
    """Agents outlive a restart: the hashed id is a pure function of the user and the model (SHA-256, not Python's
    per-process ``hash``), pinned here."""
    assert user_agent_id("x" * 64, "demo") == "x" * 46 + "@demo+13dddbf274b3"


@given(st.from_regex(AGENT_ID, fullmatch=True), st.from_regex(r"[A-Za-z0-9_.:-]{1,64}", fullmatch=True),
       st.from_regex(AGENT_ID, fullmatch=True), st.from_regex(r"[A-Za-z0-9_.:-]{1,64}", fullmatch=True))
@settings(max_examples=300, deadline=None)
def test_different_users_or_models_are_different_agents(user: str, model: str, other_user: str,
                                                        other_model: str) -> None:
    first, second = user_agent_id(user, model), user_agent_id(other_user, other_model)
    assert agent_id_problem(first) is None and agent_id_problem(second) is None
    assert (first == second) == ((user, model) == (other_user, other_model))
