"""Agents: a flood of distinct ids, ids one surface took and another could not name, agents that never leave.

What was seen before the fix (issue 9): each distinct OpenAI ``user`` made an agent with no cap (4,000 agents:
+41 MiB RSS, the dashboard fragment 51 KB -> 657 KB, STATUS 25 KB -> 340 KB) and ``agent_idle_ttl_s`` defaulted to 0,
so they never left; ``user`` took any 1-256 characters while UNREGISTER and the admin form took only
``[A-Za-z0-9_.:-]{1,64}``, so some agents could never be removed. Here ``max_agents`` is small (20) and the flood
goes over the line protocol, pipelined, so the case runs in seconds.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import RawPeer
from hostile_checks import HUNG_S

from appliance.protocol import lines, paging
from appliance.protocol import messages as m
from appliance.protocol.identifiers import AGENT_ID_RULE, agent_id_problem, user_agent_id

MAX_AGENTS = 20


def pipelined(path: Path, commands: list[str]) -> list[lines.Reply]:
    """Send ``commands`` in one write on one connection and read one reply each."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(HUNG_S)
        sock.connect(str(path))
        sock.sendall("".join(f"{command}\n" for command in commands).encode())
        reader = lines.ReplyReader()
        replies: list[lines.Reply] = []
        while len(replies) < len(commands):
            event = reader.next_event()
            if isinstance(event, lines.Reply):
                replies.append(event)
                continue
            assert event is lines.NEED_DATA, "the daemon closed the connection"
            chunk = sock.recv(65536)
            reader.receive_data(chunk)
        return replies


def chat(hostile: Any, *, user: str | None = None, headers: dict[str, str] | None = None) -> httpx.Response:
    body: dict[str, Any] = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                            "temperature": 0}
    if user is not None:
        body["user"] = user
    return httpx.post(f"{hostile.http}/v1/chat/completions", json=body, headers=headers or {}, timeout=HUNG_S)


def admin_post(hostile: Any, action: str, agent: str, model: str = "demo") -> httpx.Response:
    """A same-origin admin form POST with the page's CSRF header, as htmx sends it."""
    url = hostile.http
    headers = {"Origin": url, "X-CSRF-Token": hostile.app.appliance.csrf_token, "HX-Request": "true"}
    return httpx.post(f"{url}/admin/registry/{action}", data={"agent": agent, "model": model}, headers=headers,
                      timeout=HUNG_S)


def magn_start(peer: RawPeer, task_id: str, agent: str) -> m.Message:
    peer.send({"type": "TASK_START", "task_id": task_id, "session_id": agent, "model": "demo"})
    return peer.read_token()


def unregister_all(hostile: Any, agents: list[str]) -> None:
    replies = pipelined(hostile.socket, [f"UNREGISTER {agent}" for agent in agents])
    assert [reply.error for reply in replies] == [None] * len(agents)


@pytest.mark.hostile_config(max_agents=MAX_AGENTS)
def test_agents_beyond_max_agents_are_refused_on_every_surface(hostile):
    """300 pipelined REGISTERs of distinct ids: at most max_agents agents exist (the neighbour's counts), every
    other REGISTER is TOO_MANY_AGENTS with the limit, and so are a MAGN session, an OpenAI ``user`` and the admin
    form while it is full; the agents already registered keep decoding; once some leave, a register works."""
    daemon = hostile.app.daemon
    replies = pipelined(hostile.socket, [f"REGISTER flood-{index} demo" for index in range(300)])
    registered = [f"flood-{index}" for index, reply in enumerate(replies) if reply.error is None]
    refusals = [reply.error for reply in replies if reply.error is not None]
    try:
        assert len(daemon.agents) <= MAX_AGENTS and MAX_AGENTS - 1 <= len(registered) <= MAX_AGENTS
        assert {(error.code, error.retryable) for error in refusals} == {("TOO_MANY_AGENTS", True)}
        assert {tuple(error.details.items()) for error in refusals} == {(("max_agents", str(MAX_AGENTS)),)}

        peer = RawPeer(hostile.socket)
        try:
            refused = magn_start(peer, "t1", "magn-agent")
            assert isinstance(refused, m.ErrorMessage) and refused.task_id == "t1"
            assert (refused.error.code, refused.error.details) == ("TOO_MANY_AGENTS", {"max_agents": MAX_AGENTS})
            peer.send({"type": "PROTOCOL_INFO"})
            assert isinstance(peer.read(), m.ProtocolInfo)  # the connection goes on
        finally:
            peer.close()
        answer = chat(hostile, user="http-agent")
        assert answer.status_code == 429 and answer.headers["retry-after"]
        error = answer.json()["error"]
        assert (error["code"], error["details"], error["retryable"]) == ("TOO_MANY_AGENTS",
                                                                         {"max_agents": MAX_AGENTS}, True)
        form = admin_post(hostile, "register", "admin-agent")
        assert form.headers["x-appliance-outcome"] == "TOO_MANY_AGENTS" and "max_agents" in form.text
        assert not {"magn-agent", "http-agent@demo", "admin-agent"} & set(daemon.agents)

        decoded = pipelined(hostile.socket, [f"DECODE {registered[0]} 2 hello"])[0]
        assert decoded.error is None and decoded.fields["generated_tokens"] == "2"  # already registered: works
        assert chat(hostile).status_code == 200  # stateless requests need no agent
    finally:
        unregister_all(hostile, registered)
    again = pipelined(hostile.socket, ["REGISTER flood-again demo", "UNREGISTER flood-again"])
    assert [reply.error for reply in again] == [None, None]


@pytest.mark.hostile_config(max_agents=400)
def test_listings_stay_bounded_however_many_agents_register(hostile):
    """STATUS, the dashboard fragment and the registry's tables are about as long with 300 agents as with 150:
    each lists one page (STATUS 100 agents, the admin tables 50) and says how many there are; ``STATUS agents
    <offset>`` pages through them all."""
    url = hostile.http

    def sizes() -> dict[str, int]:
        dashboard = httpx.get(f"{url}/admin/_dashboard", timeout=HUNG_S).text
        agents = dashboard[dashboard.index('<section aria-labelledby="agents-heading">'):]
        return {"status": len(pipelined(hostile.socket, ["STATUS"])[0].body or ""),
                "dashboard agents": len(agents[:agents.index("</section>")]),  # the rest shows recent requests
                "registry": len(httpx.get(f"{url}/admin/registry/_tables", timeout=HUNG_S).text)}

    flood = [f"flood-{index}" for index in range(300)]
    first = pipelined(hostile.socket, [f"REGISTER {agent} demo" for agent in flood[:150]])
    try:
        assert [reply.error for reply in first] == [None] * 150
        fewer = sizes()
        rest = pipelined(hostile.socket, [f"REGISTER {agent} demo" for agent in flood[150:]])
        assert [reply.error for reply in rest] == [None] * 150
        more = sizes()
        grown = {name: more[name] - fewer[name] for name in more}
        print(f"sizes with 150 agents {fewer}, with 300 {more}")
        assert all(growth < 1000 for growth in grown.values()), grown  # one record or row is 70-200 bytes

        status = pipelined(hostile.socket, ["STATUS"])[0]
        assert int(status.fields["agents_total"]) >= 300 and status.fields["agents_shown"] == str(paging.STATUS_AGENTS)
        seen: list[str] = []
        offset = status.fields["agents_next_offset"]
        while offset != "none":
            page = pipelined(hostile.socket, [f"STATUS agents {offset}"])[0]
            seen += [lines.parse_fields(line[len("agent "):])["id"] for line in (page.body or "").split("\n")]
            offset = page.fields["agents_next_offset"]
        first_page = [lines.parse_fields(line[len("agent "):])["id"] for line in (status.body or "").split("\n")
                      if line.startswith("agent ")]
        assert set(flood) <= set(first_page + seen)

        dashboard = httpx.get(f"{url}/admin/_dashboard", params={"offset": "250"}, timeout=HUNG_S).text
        assert dashboard.count("<tr data-agent=") <= paging.ADMIN_AGENTS and '<tr data-agent="flood-260">' in dashboard
        assert 'hx-get="/admin/_dashboard?offset=250"' in dashboard  # the poll keeps the page
        bad = httpx.get(f"{url}/admin/_dashboard", params={"offset": "-1"}, timeout=HUNG_S)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "BAD_REQUEST"
    finally:
        unregister_all(hostile, flood)


COMMON_IDS = ["alice@example.com", "550e8400-e29b-41d4-a716-446655440000", "user-123", "bob+bot@mail.example.org",
              "org:team.agent_7"]
"""OpenAI ``user`` values as clients send them: e-mail addresses, a UUID, a name with digits."""


def registered(surface: str, name: str) -> str:
    """The agent a surface registers for ``name``: an OpenAI ``user`` names an end user, whose agent is theirs on the
    model (``<user>@demo``, or its hashed form when that is too long)."""
    return user_agent_id(name, "demo") if surface == "openai" else name


def test_every_agent_id_registered_anywhere_can_be_unregistered_everywhere(hostile):
    """An agent registered through the line protocol, an OpenAI ``user`` (the user's agent on the model,
    ``<user>@demo`` or its hashed form), a MAGN session or the admin form is named again by UNREGISTER and by the
    admin page's unregister form; an id outside the one rule is refused on every surface with a structured error,
    and nothing is registered."""
    daemon = hostile.app.daemon
    unregisters = ("line", "admin")
    pairs = [(register, unregisters[index % 2], f"{register[0]}{index}-{base}")  # each pair of surfaces, alternately
             for register in ("line", "openai", "magn", "admin") for index, base in enumerate(COMMON_IDS)]
    assert all(agent_id_problem(agent) is None for _, _, agent in pairs)
    peer = RawPeer(hostile.socket)
    try:
        for index, (register, _, agent) in enumerate(pairs):
            if register == "line":
                assert pipelined(hostile.socket, [f"REGISTER {agent} demo"])[0].error is None
            elif register == "openai":
                assert chat(hostile, user=agent).status_code == 200
            elif register == "magn":
                started = magn_start(peer, f"t{index}", agent)
                assert isinstance(started, m.TaskStart) and started.status == "started", started
            else:
                assert admin_post(hostile, "register", agent).headers["x-appliance-outcome"] == "ok"
            assert registered(register, agent) in daemon.agents
        for register, unregister, name in pairs:
            agent = registered(register, name)
            if unregister == "line":
                assert pipelined(hostile.socket, [f"UNREGISTER {agent}"])[0].error is None, agent
            else:
                assert admin_post(hostile, "unregister", agent).headers["x-appliance-outcome"] == "ok", agent
            assert agent not in daemon.agents
    finally:
        peer.close()

    before = set(daemon.agents)
    for bad in ("John Smith", "zoë", "x" * 65, "-leading-dash"):
        if " " not in bad:  # the line protocol splits at spaces: "John Smith" is not one word to it
            line = pipelined(hostile.socket, [f"REGISTER {bad} demo"])[0]
            assert line.error is not None and line.error.code == "BAD_REQUEST", bad
        answer = chat(hostile, user=bad)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "user", bad
        assert answer.json()["error"]["details"]["rule"] == AGENT_ID_RULE
        form = admin_post(hostile, "register", bad)
        assert form.headers["x-appliance-outcome"] == "BAD_REQUEST", bad
        peer = RawPeer(hostile.socket)
        try:
            refused = magn_start(peer, "t-bad", bad)
            assert isinstance(refused, m.ErrorMessage) and refused.error.code == "BAD_PAYLOAD", bad
            assert refused.error.details["field"] == "session_id"
        finally:
            peer.close()
    header = chat(hostile, headers={"X-Agent-Id": "John Smith"})
    assert header.status_code == 400 and header.json()["error"]["param"] == "X-Agent-Id"
    assert set(daemon.agents) <= before  # nothing registered (the neighbour may have moved on to its next agent)


@pytest.mark.hostile_config(agent_idle_ttl_s=1)
def test_idle_agents_expire_and_free_their_model(hostile):
    """With a short ``agent_idle_ttl_s``, agents that stop decoding (line, OpenAI ``user``) are unregistered by the
    sweep, a model only they held is unloaded, and an expired ``user`` comes back as a new agent; the neighbour,
    which keeps decoding, keeps its agent."""
    daemon = hostile.app.daemon
    replies = pipelined(hostile.socket, [f"REGISTER idle-{index} demo" for index in range(5)]
                        + ["REGISTER idle-b demo-b"])
    assert [reply.error for reply in replies] == [None] * 6
    assert chat(hostile, user="idle-user").status_code == 200
    idle = {f"idle-{index}" for index in range(5)} | {"idle-b", "idle-user@demo"}  # a user's agent on demo
    deadline = time.monotonic() + HUNG_S
    while idle & set(daemon.agents):
        assert time.monotonic() < deadline, f"still registered: {sorted(idle & set(daemon.agents))}"
        time.sleep(0.05)
    assert daemon.counters["agents_expired"] >= len(idle)
    assert daemon.model_state("demo-b") == "available"  # its only agent expired: unloaded (L4)
    assert chat(hostile, user="idle-user").status_code == 200  # registered anew
    assert "idle-user@demo" in daemon.agents
    assert hostile.neighbour_served_since(hostile.neighbour.served)
