"""Host memory for parked agents: many agents with long conversations stay within ``host_kv_budget``.

Without the budget, each parked conversation kept its KV state in host RAM for good (150 agents with 1,500-token
conversations on the tiny model: 915 MB, while the ledger showed 49 MB). With it, the least recently used parked
state is dropped and re-evaluated from its tokens when its agent comes back.
"""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest
from hostile_checks import HUNG_S, request, rss_bytes

MiB = 1024 * 1024
BUDGET = 4 * MiB
AGENTS = 20
COMING_BACK = 4  # agents decoding again after all have parked: their state was dropped, they are rebuilt
SLACK = 24 * MiB
"""RSS growth allowed beyond the budget: the live context's KV pages, touched as long prompts fill it (ledger bytes
on a CPU box: about 10 MiB for one agent's 1,000 tokens with nothing parked), compute buffers, allocator slack."""
PROMPT = "the quick brown fox jumps over the lazy dog " * 22  # about 500 tokens: ~2 MiB of KV state each


def host_kv(base_url: str) -> dict[str, int]:
    with urllib.request.urlopen(base_url + "/v1/health", timeout=HUNG_S) as response:
        return json.loads(response.read())["host_kv"]


@pytest.mark.hostile_config(host_kv_budget="4MiB")
def test_many_long_conversations_stay_within_the_host_kv_budget(hostile):
    served = hostile.neighbour.served
    rss_before = rss_bytes()
    seen: list[dict[str, int]] = []
    agents = [f"long-{i}" for i in range(AGENTS)]
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(HUNG_S)
        sock.connect(str(hostile.socket))
        reader = sock.makefile("rb")
        for agent in agents:
            assert request(sock, reader, f"REGISTER {agent} demo").startswith("OK")
        for agent, prompt in [(a, PROMPT) for a in agents] + [(a, "and then") for a in agents[:COMING_BACK]]:
            reply = request(sock, reader, f"DECODE {agent} 4 {prompt}")
            assert reply.startswith("OK"), reply[-300:]
            seen.append(host_kv(hostile.http))
        for agent in agents:
            assert request(sock, reader, f"UNREGISTER {agent}").startswith("OK")
    growth = rss_bytes() - rss_before
    assert all(s["budget_bytes"] == BUDGET for s in seen)
    assert max(s["parked_bytes"] for s in seen) <= BUDGET
    last = seen[-1]
    assert last["drops"] >= AGENTS - 3 and last["rebuilds"] >= COMING_BACK
    print(f"RSS growth {growth / MiB:.1f} MiB; {AGENTS * 2} MiB would be parked without the budget")
    assert growth < BUDGET + SLACK < AGENTS * 2 * MiB, f"RSS grew {growth / MiB:.0f} MiB"
    assert hostile.neighbour_served_since(served)
