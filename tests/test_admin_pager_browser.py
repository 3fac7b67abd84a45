"""The admin page's agent pages in a real headless Chromium (the ``browser`` fixture of conftest.py): the dashboard
and the registry list 50 agents a page; "next" brings the next page in through htmx, and the dashboard's polling
keeps that page instead of jumping back to the first."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from harness import running
from test_admin_browser import WAIT_MS, Problems

from appliance.protocol import paging

AGENTS = paging.ADMIN_AGENTS + 10


@pytest.fixture
def app(tiny_model: Path):  # type: ignore[no-untyped-def]
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as running_app:
        for index in range(AGENTS):
            running_app.call(running_app.daemon.register(f"agent-{index}", "tiny"))
        yield running_app


@pytest.fixture
def problems() -> Problems:
    return Problems()


def test_next_brings_the_next_page_of_agents_and_the_poll_keeps_it(app, browser, problems: Problems) -> None:
    url = app.appliance.http_url
    page = problems.watch(browser.new_page())
    try:
        page.goto(url + "/admin/")
        assert page.locator("#agents tr[data-agent]").count() == paging.ADMIN_AGENTS
        assert page.inner_text("#agents-total") == f"({AGENTS})"
        page.click("#dashboard .pager-next")
        page.locator('#agents tr[data-agent="agent-55"]').wait_for(timeout=WAIT_MS)
        assert page.locator("#agents tr[data-agent]").count() == AGENTS - paging.ADMIN_AGENTS
        updated = page.get_attribute("#dashboard", "data-updated")
        deadline = time.monotonic() + WAIT_MS / 1000
        while page.get_attribute("#dashboard", "data-updated") == updated:  # until one poll later
            assert time.monotonic() < deadline, "the dashboard did not poll"
            page.wait_for_timeout(100)
        assert page.locator('#agents tr[data-agent="agent-55"]').count() == 1
        assert page.locator('#agents tr[data-agent="agent-0"]').count() == 0
        page.click("#dashboard .pager-previous")
        page.locator('#agents tr[data-agent="agent-0"]').wait_for(timeout=WAIT_MS)

        page.goto(url + "/admin/registry")
        assert page.locator("#registered-agents tr[data-agent]").count() == paging.ADMIN_AGENTS
        page.click("#registry-tables .pager-next")
        page.locator('#registered-agents tr[data-agent="agent-59"]').wait_for(timeout=WAIT_MS)
        held = page.inner_text('#model-states tr[data-model="tiny"]')
        assert f"and {AGENTS - paging.HOLDERS_SHOWN} more" in held
    finally:
        problems.stop()
        page.close()
    assert not problems.seen, problems.seen
