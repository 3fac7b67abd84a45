"""Pages of agents (appliance/protocol/paging.py) and STATUS's bounded agent list with ``STATUS agents <offset>``."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from test_daemon_core import Env, run

from appliance.errors import ApplianceError
from appliance.protocol import lines, paging
from appliance.server.lines import execute


@pytest.mark.parametrize(("total", "offset", "shown", "previous", "next_"), [
    (0, 0, 0, None, None),
    (3, 0, 3, None, None),
    (10, 0, 4, None, 4),
    (10, 4, 4, 0, 8),
    (10, 8, 2, 4, None),
    (10, 2, 4, 0, 6),
    (10, 50, 0, 6, None),  # past the end: empty, and the way back is the last page
])
def test_a_page_knows_its_neighbours(total: int, offset: int, shown: int, previous: int | None,
                                     next_: int | None) -> None:
    page = paging.page_of(list(range(total)), offset, 4)
    assert page.items == list(range(total))[offset:offset + 4] and page.shown == shown and page.total == total
    assert (page.previous_offset, page.next_offset) == (previous, next_)


@pytest.mark.parametrize("text", ["-1", "1.5", "x", "٣", "1" * 8, " 1"])
def test_a_bad_offset_is_bad_request(text: str) -> None:
    with pytest.raises(ApplianceError) as caught:
        paging.parse_offset(text)
    assert caught.value.code == "BAD_REQUEST" and caught.value.details["field"] == "offset"


def test_no_offset_is_the_first_page() -> None:
    assert paging.parse_offset(None) == 0 and paging.parse_offset("") == 0 and paging.parse_offset("120") == 120


@pytest.mark.parametrize("line", ["STATUS agent 1", "STATUS agents", "STATUS agents -1", "STATUS agents 12345678",
                                  "STATUS everything"])
def test_status_takes_only_agents_and_an_offset(line: str) -> None:
    with pytest.raises(ApplianceError) as caught:
        lines.parse_line(line)
    assert caught.value.code == "BAD_REQUEST" and caught.value.message == "usage: STATUS [agents <offset>]"


def test_status_lists_a_bounded_page_of_agents_and_says_how_to_see_the_rest(tmp_path: Path) -> None:
    total = paging.STATUS_AGENTS + 30

    async def body(env: Env) -> None:
        for index in range(total):
            await env.daemon.register(f"agent-{index}", "m")

        async def status(line: str) -> lines.Reply:
            return lines.parse_reply(await execute(env.daemon, lines.parse_line(line), threading.Event()))

        first = await status("STATUS")
        records = [line for line in (first.body or "").split("\n") if line.startswith("agent ")]
        assert len(records) == paging.STATUS_AGENTS and records[0].startswith("agent id=agent-0 ")
        assert "device " in (first.body or "") and "counters " in (first.body or "")
        assert (first.fields["agents_total"], first.fields["agents_shown"]) == (str(total), str(paging.STATUS_AGENTS))
        assert first.fields["agents_next_offset"] == str(paging.STATUS_AGENTS)
        rest = await status(f"STATUS agents {first.fields['agents_next_offset']}")
        body = (rest.body or "").split("\n")
        assert [lines.parse_fields(line[len("agent "):])["id"] for line in body] == \
            [f"agent-{index}" for index in range(paging.STATUS_AGENTS, total)]
        assert rest.fields["agents_shown"] == "30" and rest.fields["agents_next_offset"] == "none"

    run(tmp_path, body, max_agents=total)
